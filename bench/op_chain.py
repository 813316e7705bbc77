"""The op chain the published PLE offload worker runs, per shard, with plain torch ops.

index_select the packed rows and the scales, stack the two nibbles, repeat_interleave the scales to
the row width, multiply, and copy each shard's rows into the output with index_copy_. This was
pled's own ``Table.gather`` before it kept scratch space; the benchmarks run it beside
``Table.gather`` and the tests check that both give the same bits.
"""
from __future__ import annotations

import torch

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[k, W/2] bytes -> [k, W] codes, low nibble first."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def _block_scale(scale: torch.Tensor) -> torch.Tensor:
    return scale.to(torch.float32).repeat_interleave(16, dim=1)


def dequant_shard(layout: str, t: dict[str, torch.Tensor], local: torch.Tensor) -> torch.Tensor:
    """Rows ``local`` of one shard's tensors, as float32 [k, W]."""
    if layout == "ples_fp8":
        codes = t["weight_fp8"].view(torch.uint8).index_select(0, local)
        return codes.view(torch.float8_e4m3fn).to(torch.float32) * t["weight_scale"].index_select(0, local).unsqueeze(1)
    if layout == "ples_int4":
        nib = _unpack_nibbles(t["weight_i4"].index_select(0, local))
        return (nib.to(torch.float32) - 8.0) * _block_scale(t["weight_scale"].index_select(0, local))
    if layout == "ples_nvfp4":
        codes = _unpack_nibbles(t["weight_e2m1"].index_select(0, local))
        scale = t["weight_scale"].view(torch.uint8).index_select(0, local).view(torch.float8_e4m3fn)
        return _E2M1[codes.long()] * _block_scale(scale) * t["weight_scale_2"].to(torch.float32)
    raise ValueError(f"no dequantization for layout {layout!r}")


def gather(layout: str, shards: list[dict[str, torch.Tensor]], starts: torch.Tensor, ids: torch.Tensor,
           out: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (global, int64) into ``out`` [n, W]; ``starts`` holds each shard's first row."""
    shard = torch.searchsorted(starts, ids, right=True) - 1
    order = torch.argsort(shard)
    counts = torch.bincount(shard, minlength=len(shards)).tolist()
    pos = 0
    for s, count in enumerate(counts):
        if count:
            where = order[pos : pos + count]
            values = dequant_shard(layout, shards[s], ids.index_select(0, where) - starts[s])
            out.index_copy_(0, where, values.to(out.dtype))
            pos += count
    return out
