"""Run in .venv-vllm (which has Triton) with TRITON_INTERPRET=1, by tests/test_device_check_engram.py: the Engram
lookup kernel bench/engram_kernels.py carries from vLLM 0.33.0, executed by Triton's CPU interpreter on CPU tensors
(rank 1 of 2 head shards, and rank 2 of 3 whose second head is padding), against bench/device/engram.py's CPU
references, into bf16 and into packed bytes, unsorted and sorted. Prints one JSON line.
"""
import json
import sys

import numpy as np
import torch

from bench import engram_kernels
from bench.device import engram


def main() -> int:
    rng = np.random.default_rng(7)
    sizes, dim = [53, 59, 61, 67, 71], 64
    rows = sum(sizes)
    weight = rng.integers(0, 256, (rows, dim), dtype=np.uint8)
    weight[(weight & 0x7F) == 0x7F] = 0x3C  # the generator's codes: no NaN
    scale = rng.integers(100, 150, (rows, dim // 32), dtype=np.uint8)
    out = {}
    for world, rank in ((2, 1), (3, 2)):
        hs, local, lo, hi = engram.shard(sizes, world, rank)
        ids = engram.hashed_ids(sizes, 40, lo, hi, seed=3)
        w = torch.from_numpy(weight[lo:hi].copy()).view(torch.float8_e4m3fn)
        s = torch.from_numpy(scale[lo:hi].copy())
        want = torch.from_numpy(engram.reference_f32(weight, scale, ids, lo, hi, hs, local)).to(torch.bfloat16)
        want_packed = engram.reference_packed(weight, scale, ids, lo, hi, hs, local)
        for sort in (False, True):
            bf16 = torch.empty((40, local, dim), dtype=torch.bfloat16)
            packed = torch.empty((40, local, dim + dim // 32), dtype=torch.uint8)
            for dest in (bf16, packed):
                engram_kernels.lookup(w, s, torch.from_numpy(ids), dest, lo, hi, hs, local, len(sizes), dim, 32, 3,
                                      sort=sort)
            owned = (ids[:, hs:hs + local] >= lo) & (ids[:, hs:hs + local] < hi)
            out[f"{world}.{rank}.{'sorted' if sort else 'unsorted'}"] = {
                "bf16": bool(torch.equal(bf16, want)), "packed": bool(np.array_equal(packed.numpy(), want_packed)),
                "owned": int(owned.sum()), "rows": int(owned.size), "nonzero": bool(want.abs().sum() > 0)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
