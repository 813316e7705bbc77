"""The meaning of the bytes, from hand-written values: dequant.py (numpy) and gather.py (torch) must both give
them. Neither is checked against the other or against itself."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pled.client.gather import Gatherer
from pled.shared import dequant
from pled.shared.layouts import LAYOUTS

# One row of 32 columns (two blocks of 16), packed two codes per byte, LOW nibble first (layouts.py).
# Byte 0x21 holds code 1 (column 0) and code 2 (column 1); byte 0xF0 holds 0 then 15.
PACKED = np.array([[0x21, 0xF0] + [0x88] * 14], dtype=np.uint8)


def torch_rows(layout: str, tensors: dict[str, np.ndarray], width: int = 32) -> torch.Tensor:
    """Row 0 of a one-shard, one-row table holding ``tensors``, through pled's own torch gather (gather.py): the
    tensors laid out one after another as a region would hold them, with a manifest that says where."""
    buf, entries = bytearray(), []
    for spec in LAYOUTS[layout].tensors:
        if spec.name in tensors:
            entries.append(SimpleNamespace(shard=0, name=spec.name, offset=len(buf)))
            buf += np.ascontiguousarray(tensors[spec.name]).tobytes()
            buf += bytes(-len(buf) % 16)
    manifest = SimpleNamespace(table="t", layout=layout, rows=1, row_width=width, tensors=entries,
                               shards=[SimpleNamespace(rows=1)])
    return Gatherer(manifest, torch.frombuffer(buf, dtype=torch.uint8)).gather([0], dtype=torch.float32)


def test_int4_low_nibble_first_and_minus_eight():
    scale = np.array([[0.5, 2.0]], dtype=np.float16)  # per block of 16 columns
    want = np.array([(1 - 8) * 0.5, (2 - 8) * 0.5, (0 - 8) * 0.5, (15 - 8) * 0.5] + [0.0] * 12 + [0.0] * 16, np.float32)
    got = dequant.dequant_rows("ples_int4", {"weight_i4": PACKED, "weight_scale": scale}, np.array([0]))
    assert got.tolist() == [want.tolist()]
    t = torch_rows("ples_int4", {"weight_i4": PACKED, "weight_scale": scale})
    assert t.tolist() == [want.tolist()]


def test_nvfp4_low_nibble_first_sign_in_bit_three():
    # e2m1 codes: 1 -> 0.5, 2 -> 1.0, 0 -> 0, 15 -> -6.0 (sign bit 8 | magnitude index 7), 8 -> -0.
    # Scales as e4m3 codes: 0x38 is 1.0 (exponent 7 = bias), 0x40 is 2.0; scale_2 is 0.25.
    codes = np.array([[0x38, 0x40]], dtype=np.uint8)
    scale_2 = np.array(0.25, dtype=np.float32)
    want = [0.5 * 0.25, 1.0 * 0.25, 0.0, -6.0 * 0.25] + [-0.0] * 12 + [-0.0] * 16
    got = dequant.dequant_rows("ples_nvfp4", {"weight_e2m1": PACKED, "weight_scale": codes, "weight_scale_2": scale_2},
                               np.array([0]))
    assert got.tolist() == [want]
    t = torch_rows("ples_nvfp4", {"weight_e2m1": PACKED, "weight_scale": codes, "weight_scale_2": scale_2})
    assert t.tolist() == [want]


@pytest.mark.parametrize("code,value", [(0x38, 1.0), (0x40, 2.0), (0xC0, -2.0), (0x30, 0.5), (0x01, 2.0**-9),
                                        (0x7E, 448.0), (0x00, 0.0)])
def test_fp8_e4m3_codes(code, value):
    assert dequant.fp8_e4m3(np.array([code], np.uint8)).tolist() == [value]
    assert torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).tolist() == [value]


def test_fp8_rows_times_their_scale():
    w = np.array([[0x38, 0xC0]], np.uint8)
    got = dequant.dequant_rows("ples_fp8", {"weight_fp8": w, "weight_scale": np.array([3.0], np.float32)},
                               np.array([0]))
    assert got.tolist() == [[3.0, -6.0]]
