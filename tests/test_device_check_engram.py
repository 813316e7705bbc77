"""The device check's Engram section (bench/device/engram.py, issue 46 item 5) on this machine, which has no GPU:
the kernel it carries from vLLM 0.33.0 names its source and licence and is vLLM's text; the CPU reference reads
e4m3 and ue8m0 as torch's own float8 dtypes do (vLLM's weight loader hands the kernel those bytes) and is what the
carried kernel computes in Triton's CPU interpreter; the slice is sized as asked and sharded as vLLM shards heads;
without CUDA the check lists the section and measures nothing.

Nothing here touches a GPU: registration through each route, the kernel over pled's device views and the rows/s
against a private pinned copy are untested until the check runs on one.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.device import check as device_check, engram
from pled import generator
from pled.shared import dequant

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "bench" / "engram_kernels.py"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_033 = ROOT / ".cache" / "vllm-0.33.0" / "vllm"
SOURCE = "models/deepseek_v41/common/engram.py"


def test_the_carried_kernel_names_its_source_and_licence():
    text = KERNELS.read_text()
    head = text[:text.index('"""', text.index('"""') + 3)]
    assert text.startswith("# SPDX-License-Identifier: Apache-2.0\n")
    assert "Copyright contributors to the vLLM project" in text.splitlines()[1]
    assert "vLLM 0.33.0" in head and "Apache" in head and "License 2.0" in head
    assert f"vllm/{SOURCE}" in head and "_engram_lookup_kernel" in head
    assert "def _engram_lookup_kernel(" in text


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_033.exists(), reason="vLLM 0.33.0's sources are not unpacked: `make vllm-env`")
def test_the_carried_kernel_is_vllm_0_33s_text():
    from tests.test_device_check import _functions

    assert _functions(KERNELS)["_engram_lookup_kernel"] == _functions(VLLM_033 / SOURCE)["_engram_lookup_kernel"]


def test_the_reference_decodes_as_torchs_float8_dtypes():
    """Every e4m3 code but the two NaNs through pled's decoder equals torch's float8_e4m3fn; every ue8m0 byte but 0
    and 255 read as the kernel reads it (the byte in a float32's exponent) equals torch's float8_e8m0fnu."""
    codes = np.arange(256, dtype=np.uint8)
    torch_e4m3 = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    real = ~np.isnan(torch_e4m3)
    assert real.sum() == 254 and np.array_equal(np.isnan(dequant.E4M3_LUT), ~real)
    assert np.array_equal(dequant.E4M3_LUT[real].view(np.uint32), torch_e4m3[real].view(np.uint32))
    torch_e8m0 = torch.from_numpy(codes).view(torch.float8_e8m0fnu).float().numpy()
    assert np.array_equal(engram.scale_f32(codes)[1:255], torch_e8m0[1:255])


def test_the_reference_looks_up_the_ranks_heads_and_zeroes_the_rest():
    """A tiny table written by hand: the reference's rows are value times scale for owned ids, zero for an id
    outside the rank's rows and for a padded head; the packed form is the row's bytes."""
    sizes = [3, 4, 5]
    rows = sum(sizes)
    weight = np.full((rows, 64), 0x38, dtype=np.uint8)  # e4m3 1.0
    weight[:, 1] = np.arange(rows, dtype=np.uint8)  # a code per row, for telling rows apart
    scale = np.tile(np.array([[127, 128]], dtype=np.uint8), (rows, 1))  # 1.0, 2.0
    hs, local, lo, hi = engram.shard(sizes, 2, 1)
    assert (hs, local, lo, hi) == (2, 2, 7, 12)
    ids = np.array([[0, 3, 7], [1, 4, 6], [2, 5, 11]], dtype=np.int64)
    got = engram.reference_f32(weight, scale, ids, lo, hi, hs, local)
    assert got.shape == (3, 2, 64) and not got[:, 1].any()  # head 3 is padding
    assert not got[1, 0].any()  # id 6 is rank 0's
    for t, row in ((0, 7), (2, 11)):
        assert got[t, 0, 0] == 1.0 and got[t, 0, 40] == 2.0 and got[t, 0, 1] == dequant.E4M3_LUT[row]
    packed = engram.reference_packed(weight, scale, ids, lo, hi, hs, local)
    assert np.array_equal(packed[2, 0], np.concatenate([weight[11], scale[11]])) and not packed[1].any()


def test_the_slice_is_as_large_as_asked_and_sharded_as_vllm_shards_heads():
    for world, rank in ((1, 0), (2, 1), (4, 3)):
        c = engram.plan(8 << 20, world, rank)
        sizes = generator.engram_head_sizes(c)[0]
        hs, local, lo, hi = engram.shard(sizes, world, rank)
        assert 8 << 20 <= (hi - lo) * 264 < (8 << 20) * 1.1
        assert len(sizes) == 4 and c["engram_layer_ids"] == [engram.LAYER]
        assert local == -(-4 // world) and hs == rank * local and lo == sum(sizes[:hs])
    with pytest.raises(ValueError, match="without heads"):
        engram.shard([5, 7, 11, 13], 3, 0)  # vLLM's assert: 2 heads a shard leave the third none


@pytest.mark.vllm
@pytest.mark.slow
def test_the_carried_kernel_computes_the_reference_in_tritons_interpreter():
    """Triton's CPU interpreter runs the carried kernel (bf16 and packed, unsorted and sorted) for a rank of 2 and a
    rank of 3 with a padded head; each equals the CPU reference exactly (e4m3 times a power of two fits bf16)."""
    done = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_env" / "engram_kernel.py")], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert set(out) == {f"{r}.{s}" for r in ("2.1", "3.2") for s in ("sorted", "unsorted")}
    for case in out.values():
        assert case["bf16"] and case["packed"] and case["nonzero"] and 0 < case["owned"] < case["rows"]


def test_without_cuda_the_engram_section_is_listed_and_not_run(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.device.check", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "device_check.json").read_text())
    assert result["cuda"] is False and result["sections"] == list(device_check.SECTIONS)
    assert "engram" in result["sections"]
    assert "engram" not in result and result["errors"] == []
