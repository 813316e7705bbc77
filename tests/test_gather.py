"""Table.gather against a reference written here, element by element, from the layout table alone."""
import math
import struct

import pytest
import torch

from conftest import LAYOUTS
from pled import client

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * (man / 8) * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def reference_row(path: str, layout: str, r: int) -> list[float]:
    """Row r of one shard file, read with struct from the file itself."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    import json

    header = json.loads(raw[8 : 8 + n])
    base = 8 + n

    def tensor(name):
        begin, end = header[name]["data_offsets"]
        return raw[base + begin : base + end], header[name]["shape"]

    out = []
    if layout == "ples_fp8":
        w, (_, width) = tensor("weight_fp8")
        s, _ = tensor("weight_scale")
        scale = struct.unpack_from("<f", s, 4 * r)[0]
        return [e4m3(w[r * width + c]) * scale for c in range(width)]
    packed_name = "weight_i4" if layout == "ples_int4" else "weight_e2m1"
    w, (_, half) = tensor(packed_name)
    s, (_, blocks) = tensor("weight_scale")
    for c in range(half * 2):
        byte = w[r * half + c // 2]
        code = byte & 0xF if c % 2 == 0 else byte >> 4
        if layout == "ples_int4":
            scale = struct.unpack_from("<e", s, 2 * (r * blocks + c // 16))[0]
            out.append((code - 8) * scale)
        else:
            scale = e4m3(s[r * blocks + c // 16])
            s2 = struct.unpack("<f", tensor("weight_scale_2")[0])[0]
            value = E2M1[code & 7] * (-1 if code & 8 else 1)
            out.append(value * scale * s2)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_matches_the_reference(sidecar, daemon, layout):
    d = sidecar(layout, shards=5, rows=300, seed=11)
    pled = daemon({layout: d})
    with client.attach(layout, socket=pled.socket) as t:
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 1500, (64,), generator=g)
        ids[:4] = torch.tensor([0, 299, 300, 1499])  # shard edges
        out = torch.empty((64, 160), dtype=torch.float32)
        ptr = out.data_ptr()
        result = t.gather(ids, out=out)
        assert result is out and out.data_ptr() == ptr  # filled in place
        for i, row in enumerate(ids.tolist()):
            shard, local = divmod(row, 300)
            want = torch.tensor(reference_row(str(d / f"shard_{shard}.safetensors"), layout, local), dtype=torch.float32)
            assert torch.allclose(out[i], want, rtol=1e-6, atol=0), (layout, row)
        bf16 = t.gather(ids)  # default output: bfloat16
        assert bf16.dtype == torch.bfloat16 and torch.allclose(bf16.float(), out, rtol=1e-2, atol=1e-6)
        assert torch.equal(t.gather(ids[:1], dtype=torch.float32), out[:1])  # one shard only: the fast path
        assert t.gather(torch.empty(0, dtype=torch.int64)).shape == (0, 160)


def test_gather_rejects_bad_requests(sidecar, daemon):
    pled = daemon({"t": sidecar("ples_int4", shards=2, rows=100)})
    with client.attach("t", socket=pled.socket) as t:
        with pytest.raises(IndexError, match=r"row id 200 is out of range .* \[0, 200\)"):
            t.gather([0, 200])
        with pytest.raises(IndexError, match="row id -1"):
            t.gather([-1])
        with pytest.raises(ValueError, match=r"out has shape \(3, 160\)"):
            t.gather([1, 2], out=torch.empty(3, 160))
        with pytest.raises(TypeError, match="integers"):
            t.gather(torch.tensor([1.5]))


def test_gather_on_a_generic_table_is_refused(tmp_path, daemon):
    import numpy as np

    from pled.daemon.safetensors_file import write

    write(str(tmp_path / "model-00001-of-00001.safetensors"), [("w", "F32", (2, 2), np.ones((2, 2), np.float32).tobytes())])
    pled = daemon({"ckpt": tmp_path / "model-*.safetensors"})
    with client.attach("ckpt", socket=pled.socket) as t:
        assert torch.equal(t.tensors["w"], torch.ones(2, 2))
        with pytest.raises(ValueError, match="needs a PLE layout"):
            t.gather([0])
