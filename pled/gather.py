"""Gather + dequant of PLE rows with torch on the CPU: the CPU dequant worker's job.

Row ids are global (rows concatenated in shard order). Ids are grouped by
shard, each group is gathered with index_select from the zero-copy views and
dequantized, and the result is written into ``out`` in place: a caller's
(possibly pinned) buffer is filled, never replaced.
"""
from __future__ import annotations

import torch

from .layouts import LAYOUTS

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


def gather(table, row_ids, out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    m = table.manifest
    if m.layout not in LAYOUTS:
        raise ValueError(f"table {m.table} is a plain safetensors table; gather needs a PLE layout ({', '.join(LAYOUTS)})")
    ids = torch.as_tensor(row_ids).reshape(-1)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"row ids must be integers, got {ids.dtype}")
    ids = ids.to(torch.int64)
    n, width = ids.numel(), m.row_width
    if out is None:
        out = torch.empty((n, width), dtype=dtype or torch.bfloat16)
    elif out.shape != (n, width):
        raise ValueError(f"out has shape {tuple(out.shape)}; {n} rows of table {m.table} need ({n}, {width})")
    elif dtype is not None and out.dtype != dtype:
        raise ValueError(f"out is {out.dtype} but dtype={dtype} was asked for")
    if n == 0:
        return out
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= m.rows:
        bad = lo if lo < 0 else hi
        raise IndexError(f"row id {bad} is out of range for table {m.table}: ids must be in [0, {m.rows})")
    starts = _starts(table)
    shard = torch.searchsorted(starts, ids, right=True) - 1
    if len(m.shards) == 1 or int(shard.min()) == int(shard.max()):
        s = int(shard[0])
        out.copy_(dequant_shard(m.layout, table.shard_tensors(s), ids - starts[s]))
        return out
    order = torch.argsort(shard)
    counts = torch.bincount(shard, minlength=len(m.shards)).tolist()
    pos = 0
    for s, count in enumerate(counts):
        if count:
            where = order[pos : pos + count]
            values = dequant_shard(m.layout, table.shard_tensors(s), ids.index_select(0, where) - starts[s])
            out.index_copy_(0, where, values.to(out.dtype))
            pos += count
    return out


def _starts(table) -> torch.Tensor:
    cached = getattr(table, "_row_starts", None)
    if cached is None:
        rows = torch.tensor([0] + [s.rows for s in table.manifest.shards], dtype=torch.int64)
        cached = torch.cumsum(rows, 0)[:-1].contiguous()
        table._row_starts = cached
    return cached
