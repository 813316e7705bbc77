"""Gather + dequant of PLE rows with torch on the CPU: the CPU dequant worker's job.

Row ids are global (rows concatenated in shard order). A request is sorted once,
which groups its ids by shard (and walks each shard's rows in address order); each
shard's packed rows and scales are gathered with index_select into scratch, put
back in request order (a few bytes a row), then all rows are dequantized in one
pass over the output: a 256-entry table turns each packed byte into its two
values, the block scales multiply through a broadcast view (no repeat_interleave).

Every buffer lives in a ``Scratch`` kept for the next request, sized for the
largest request seen: a steady stream of requests allocates nothing but small
0-d tensors, so it takes no page faults. Torch on the CPU makes a temporary for
every op whose inputs or output differ in dtype from the computation's, so each
dtype change here is an explicit ``copy_`` into scratch.

The results are bit-identical to the per-shard op chain (index_select, stack the
nibbles, repeat_interleave the scales, multiply in float32, cast to ``out``'s
dtype; see bench/op_chain.py): the same float32 products in the same order.
"""
from __future__ import annotations

import threading

import torch

from .layouts import LAYOUTS

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
_BLOCK = 16  # columns per scale in int4 and nvfp4


def _pair_table(values: list[float]) -> torch.Tensor:
    """[256, 2] float32: byte b -> (values[b & 15], values[b >> 4]), the low nibble first."""
    codes = torch.arange(256)
    lut = torch.tensor(values, dtype=torch.float32)
    return torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=1).contiguous()


_PAIRS = {"ples_int4": _pair_table([float(c - 8) for c in range(16)]), "ples_nvfp4": _pair_table(_E2M1)}


class Scratch:
    """The buffers of one request, sized for ``rows`` rows; ``view(n)`` gives their first n rows."""

    def __init__(self, layout: str, width: int, scale_dtype: torch.dtype, rows: int) -> None:
        self.rows = rows
        packed = width if layout == "ples_fp8" else width // 2
        scale_shape = (rows,) if layout == "ples_fp8" else (rows, width // _BLOCK)
        self.ids = torch.empty(rows, dtype=torch.int64)  # request ids as int64, when they come as something else
        self.sorted = torch.empty(rows, dtype=torch.int64)
        self.order = torch.empty(rows, dtype=torch.int64)
        self.local = torch.empty(rows, dtype=torch.int64)
        self.packed_sorted = torch.empty((rows, packed), dtype=torch.uint8)
        self.packed = torch.empty((rows, packed), dtype=torch.uint8)
        self.scale_sorted = torch.empty(scale_shape, dtype=scale_dtype)
        self.scale = torch.empty(scale_shape, dtype=scale_dtype)
        self.scale_f32 = torch.empty(scale_shape, dtype=torch.float32) if scale_dtype != torch.float32 else self.scale
        self.codes = torch.empty((rows, packed), dtype=torch.int32) if layout != "ples_fp8" else None
        self.scale2_sorted = torch.empty(rows, dtype=torch.float32) if layout == "ples_nvfp4" else None
        self.scale2 = torch.empty(rows, dtype=torch.float32) if layout == "ples_nvfp4" else None
        self.width = width
        self.work: torch.Tensor | None = None  # float32 [rows, W], made when an output is not float32 itself

    def work_rows(self, n: int) -> torch.Tensor:
        if self.work is None:
            self.work = torch.empty((self.rows, self.width), dtype=torch.float32)
        return self.work[:n]

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer (for tests that check they are reused)."""
        return [t for t in vars(self).values() if isinstance(t, torch.Tensor)]


class Gatherer:
    """Gathers of one mapped table, with its scratch. Calls on one Gatherer run one at a time."""

    def __init__(self, manifest, shard_tensors) -> None:
        """``shard_tensors(i)`` gives shard i's tensors by name (zero-copy views of the table)."""
        if manifest.layout not in LAYOUTS:
            raise ValueError(f"table {manifest.table} is a plain safetensors table; gather needs a PLE layout "
                             f"({', '.join(LAYOUTS)})")
        self.table, self.layout, self.rows, self.width = manifest.table, manifest.layout, manifest.rows, manifest.row_width
        main, scale, *second = (spec.name for spec in LAYOUTS[self.layout].tensors)
        shards = [shard_tensors(s) for s in range(len(manifest.shards))]
        # Codes and fp8 scales are gathered as their bytes (index_select has no float8 kernel on the CPU).
        self._main = [t[main].view(torch.uint8) for t in shards]
        self._scale = [t[scale].view(torch.uint8) if t[scale].dtype == torch.float8_e4m3fn else t[scale] for t in shards]
        self._scale2 = [t[second[0]].to(torch.float32) for t in shards] if second else None
        self._scale_dtype = self._scale[0].dtype
        starts = [0]
        for s in manifest.shards:
            starts.append(starts[-1] + s.rows)
        self._starts = starts  # each shard's first row, then the table's row count
        self._starts_t = torch.tensor(starts, dtype=torch.int64)
        self._bounds = torch.empty(len(starts), dtype=torch.int64)
        self._pairs = _PAIRS.get(self.layout)
        self.scratch: Scratch | None = None
        self._lock = threading.Lock()

    def reserve(self, rows: int) -> Scratch:
        """Scratch for requests of up to ``rows`` rows, made now (its pages faulted in) if it is smaller."""
        if self.scratch is None or self.scratch.rows < rows:
            self.scratch = Scratch(self.layout, self.width, self._scale_dtype, rows)
            for t in self.scratch.buffers():
                t.zero_()  # fault the pages in now, not during a request
        return self.scratch

    def gather(self, row_ids, out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        ids = torch.as_tensor(row_ids).reshape(-1)
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"row ids must be integers, got {ids.dtype}")
        n = ids.numel()
        if out is None:
            out = torch.empty((n, self.width), dtype=dtype or torch.bfloat16)
        elif tuple(out.shape) != (n, self.width):
            raise ValueError(f"out has shape {tuple(out.shape)}; {n} rows of table {self.table} need ({n}, {self.width})")
        elif dtype is not None and out.dtype != dtype:
            raise ValueError(f"out is {out.dtype} but dtype={dtype} was asked for")
        if n == 0:
            return out
        with self._lock:
            self._gather(ids, n, out)
        return out

    def _gather(self, ids: torch.Tensor, n: int, out: torch.Tensor) -> None:
        s = self.reserve(n)
        if ids.dtype != torch.int64 or not ids.is_contiguous():
            ids = s.ids[:n].copy_(ids)
        ids_sorted, order = s.sorted[:n], s.order[:n]
        torch.sort(ids, out=(ids_sorted, order))
        lo, hi = int(ids_sorted[0]), int(ids_sorted[n - 1])
        if lo < 0 or hi >= self.rows:
            bad = lo if lo < 0 else hi
            raise IndexError(f"row id {bad} is out of range for table {self.table}: ids must be in [0, {self.rows})")
        torch.searchsorted(ids_sorted, self._starts_t, out=self._bounds)
        bounds = self._bounds.tolist()
        packed_sorted, scale_sorted, local = s.packed_sorted[:n], s.scale_sorted[:n], s.local[:n]
        for shard, (a, b) in enumerate(zip(bounds, bounds[1:])):
            if a == b:
                continue
            torch.sub(ids_sorted[a:b], self._starts[shard], out=local[a:b])
            torch.index_select(self._main[shard], 0, local[a:b], out=packed_sorted[a:b])
            torch.index_select(self._scale[shard], 0, local[a:b], out=scale_sorted[a:b])
            if self._scale2 is not None:
                s.scale2_sorted[a:b].fill_(self._scale2[shard])
        # Back to request order: the packed bytes and scales, a few bytes a row, rather than the float rows.
        packed = s.packed[:n].index_copy_(0, order, packed_sorted)
        scale = s.scale[:n].index_copy_(0, order, scale_sorted)
        work = out if out.dtype == torch.float32 and out.is_contiguous() else s.work_rows(n)
        if self.layout == "ples_fp8":
            work.copy_(packed.view(torch.float8_e4m3fn))
            work.mul_(scale.unsqueeze(1))
        else:
            if self.layout == "ples_nvfp4":
                scale = s.scale_f32[:n].copy_(scale.view(torch.float8_e4m3fn))
            else:
                scale = s.scale_f32[:n].copy_(scale)
            codes = s.codes[:n].copy_(packed)
            torch.index_select(self._pairs, 0, codes.view(-1), out=work.view(-1, 2))
            blocks = work.view(n, self.width // _BLOCK, _BLOCK)
            blocks.mul_(scale.unsqueeze(2))
            if self._scale2 is not None:
                scale2 = s.scale2[:n].index_copy_(0, order, s.scale2_sorted[:n])
                blocks.mul_(scale2.view(n, 1, 1))
        if work is not out:
            out.copy_(work)
