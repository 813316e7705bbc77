"""Run in .venv-vllm (which has Triton) with TRITON_INTERPRET=1, by tests/test_device_check.py: the kernels
bench/ple_kernels.py carries from vLLM 0.33.0, executed by Triton's CPU interpreter on CPU tensors, against
bench/device/lookup.py's references (pled's numpy dequantizer; the rows' bytes). Prints one JSON line.

The interpreter of Triton 3.9 hands ``tl.load``/``tl.store`` the nvfp4 kernel's mask (a scalar ``owned`` and a
block ``in_row`` combined) as int64, which it then refuses ("mask has unsupported dtype"); so the masks are cast to
bool on the way in. That is the interpreter's plumbing, not the kernel's arithmetic. It also rounds float32 to
bf16 by truncation where the GPU rounds to nearest even: the bf16 output is reported in ulps, not held equal.
"""
import json
import sys

import numpy as np
import torch
import triton.runtime.interpreter as interpreter

from bench import ple_kernels
from bench.device import lookup as device_lookup

_load, _store = interpreter._interpreter.load, interpreter._interpreter.store
interpreter._interpreter.load = lambda ptrs, mask, other, dtype: _load(ptrs, mask.astype(bool), other, dtype)
interpreter._interpreter.store = lambda ptrs, value, mask: _store(ptrs, value, mask.astype(bool))


def main() -> int:
    rng = np.random.default_rng(7)
    rows, width, lo, hi, n = 480, 160, 160, 320, 400  # rank 1 of 3
    weight = rng.integers(0, 256, (rows, width // 2), dtype=np.uint8)
    scale = rng.integers(0, 256, (rows, width // 16), dtype=np.uint8)  # every e4m3 code: NaN, negative, subnormal
    global_scale = 0.0037
    ids = device_lookup.check_ids(rows, lo, hi, n, seed=3)
    want = device_lookup.reference_nvfp4(weight, scale, global_scale, ids, lo, hi)
    g = torch.tensor([global_scale], dtype=torch.float32)
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        got = torch.empty((n, width), dtype=dtype)
        ple_kernels.lookup_nvfp4(torch.from_numpy(weight[lo:hi].copy()).view(-1),
                                 torch.from_numpy(scale[lo:hi].copy()).view(-1), g, torch.from_numpy(ids), got,
                                 width, lo, hi)
        if dtype == torch.float32:
            out[name] = device_lookup.f32_compare(got.numpy(), want)
        else:
            out[name] = device_lookup.bf16_compare(torch, got, want)
    raw = rng.integers(0, 256, (rows, width), dtype=np.uint8)
    got = torch.empty((n, width), dtype=torch.uint8)
    ple_kernels.lookup_rows(torch.from_numpy(raw[lo:hi].copy()).view(-1), torch.from_numpy(ids), got, width, lo, hi)
    out["rows"] = {"equal": bool(np.array_equal(got.numpy(), device_lookup.reference_rows(raw, ids, lo, hi)))}
    out["owned"] = int(((ids >= lo) & (ids < hi)).sum())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
