"""Gather + dequant of PLE rows with torch on the CPU: the CPU dequant worker's job.

Row ids are global (rows concatenated in shard order). Every shard lies in the one mapping,
so a row's bytes are found by their byte offset: the shard from a searchsorted over the shard
boundaries, then offset = (the shard's tensor offset - its first row * row bytes) + id * row
bytes. One index_select over a sliding-window view of the mapping (row k = bytes k..k+B-1, an
as_strided view, no copy) then gathers every id's packed row in request order, whatever its
shard; the same for the scales. No sort, no per-shard loop, no int64 index per element. All
rows are then dequantized in one pass: a 256-entry table turns each packed byte into its two
values, the block scales multiply through a broadcast view (no repeat_interleave).

Nothing assumes a tensor starts at a multiple of its dtype's size: the safetensors format does not
align tensors (an nvfp4 shard of 3,001 rows puts its float32 ``weight_scale_2`` at data byte 270,090).
Rows and scales are gathered as bytes into scratch, which is aligned, before any dtype view, and each
shard's ``weight_scale_2`` is copied out as bytes when the Gatherer is made.

Every buffer lives in a ``Scratch`` kept for the next request, sized for the largest request
seen: a steady stream of requests allocates nothing but small 0-d tensors, so it takes no page
faults. ``Gatherer.warm`` pays a process's first gathers before any request: it makes the scratch,
then runs gathers of random ids until two in a row take the same time within 5% (at most 8). One
warm-up gather was not enough: measured when this was written, a fresh process's next gathers
still ran at about 0.85 of their steady speed. Torch on the CPU makes a temporary for every op
whose inputs or output differ in dtype from the computation's, so each dtype change here is an
explicit ``copy_`` into scratch.

The results are bit-identical to the per-shard op chain (index_select, stack the nibbles,
repeat_interleave the scales, multiply in float32, cast to ``out``'s dtype; see
bench/op_chain.py): the same float32 products in the same order.
"""
from __future__ import annotations

import threading
import time

import torch

from pled.shared.layouts import LAYOUTS

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
_BLOCK = 16  # columns per scale in int4 and nvfp4
WARM_TOLERANCE = 0.05  # warm-up ends when two gathers in a row differ by at most this share
WARM_MAX_GATHERS = 8
_WARM_SEED = 0x5EED  # warm-up ids come from their own generator: torch's global RNG is left alone
_SCALE_DTYPE = {"ples_fp8": torch.float32, "ples_int4": torch.float16, "ples_nvfp4": torch.float8_e4m3fn}


def _pair_table(values: list[float]) -> torch.Tensor:
    """[256, 2] float32: byte b -> (values[b & 15], values[b >> 4]), the low nibble first."""
    codes = torch.arange(256)
    lut = torch.tensor(values, dtype=torch.float32)
    return torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=1).contiguous()


_PAIRS = {"ples_int4": _pair_table([float(c - 8) for c in range(16)]), "ples_nvfp4": _pair_table(_E2M1)}


def _windows(data: torch.Tensor, width: int) -> torch.Tensor:
    """[len - width + 1, width] view of a 1-D uint8 tensor: row k is bytes k .. k + width - 1 (no copy)."""
    return data.as_strided((data.numel() - width + 1, width), (1, 1))


def settled(times: list[float], tolerance: float = WARM_TOLERANCE) -> bool:
    """Whether the last two gathers took the same time, within ``tolerance`` of the earlier one."""
    return len(times) >= 2 and abs(times[-1] - times[-2]) <= tolerance * times[-2]


class Scratch:
    """The buffers of one request, sized for ``rows`` rows."""

    def __init__(self, layout: str, width: int, rows: int) -> None:
        self.rows, self.width = rows, width
        packed = width if layout == "ples_fp8" else width // 2
        blocks = 1 if layout == "ples_fp8" else width // _BLOCK
        scale_bytes = blocks * _SCALE_DTYPE[layout].itemsize
        self.ids = torch.empty(rows, dtype=torch.int64)  # request ids as int64, when they come as something else
        self.shard = torch.empty(rows, dtype=torch.int64)
        self.offset = torch.empty(rows, dtype=torch.int64)
        self.packed = torch.empty((rows, packed), dtype=torch.uint8)
        self.scale_bytes = torch.empty((rows, scale_bytes), dtype=torch.uint8)
        self.scale = torch.empty((rows, blocks), dtype=torch.float32) if layout != "ples_fp8" else None
        self.codes = torch.empty((rows, packed), dtype=torch.int32) if layout != "ples_fp8" else None
        self.scale2 = torch.empty(rows, dtype=torch.float32) if layout == "ples_nvfp4" else None
        self.work: torch.Tensor | None = None  # float32 [rows, W], made when an output is not float32 itself

    def work_rows(self, n: int) -> torch.Tensor:
        if self.work is None:
            self.work = torch.empty((self.rows, self.width), dtype=torch.float32)
            self.work.zero_()
        return self.work[:n]

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer (for tests that check they are reused)."""
        return [t for t in vars(self).values() if isinstance(t, torch.Tensor)]


class Gatherer:
    """Gathers of one mapped table, with its scratch. Calls on one Gatherer run one at a time."""

    def __init__(self, manifest, data: torch.Tensor) -> None:
        """``data``: the whole mapping as a 1-D uint8 tensor (a view, not a copy)."""
        if manifest.layout not in LAYOUTS:
            what = ("a model checkpoint's PLE tables as arrays (vLLM 0.33's PLE path looks them up itself)"
                    if manifest.arrays else "a plain safetensors table")
            raise ValueError(f"table {manifest.table} is {what}; gather needs a PLE sidecar's layout "
                             f"({', '.join(LAYOUTS)})")
        self.table, self.layout = manifest.table, manifest.layout
        self.rows, self.width = manifest.rows, manifest.row_width
        main, scale, *second = (spec.name for spec in LAYOUTS[self.layout].tensors)
        self._row_bytes = self.width if self.layout == "ples_fp8" else self.width // 2
        self._scale_bytes = ((1 if self.layout == "ples_fp8" else self.width // _BLOCK)
                             * _SCALE_DTYPE[self.layout].itemsize)
        offsets = {(t.shard, t.name): t.offset for t in manifest.tensors}
        first, main_base, scale_base, scale2 = 0, [], [], []
        starts = []
        for index, shard in enumerate(manifest.shards):
            starts.append(first)
            main_base.append(offsets[index, main] - first * self._row_bytes)
            scale_base.append(offsets[index, scale] - first * self._scale_bytes)
            if second:  # its 4 bytes: safetensors does not align tensors, so a float32 view could be refused
                at = offsets[index, second[0]]
                scale2.append(data[at : at + 4])
            first += shard.rows
        self._boundaries = torch.tensor(starts[1:], dtype=torch.int64)  # first row of shards 1..S-1
        self._main_base = torch.tensor(main_base, dtype=torch.int64)  # byte offset of row 0 if the shard began there
        self._scale_base = torch.tensor(scale_base, dtype=torch.int64)
        self._scale2 = torch.cat(scale2).view(torch.float32) if second else None  # a copy: aligned
        self._main = _windows(data, self._row_bytes)
        self._scales = _windows(data, self._scale_bytes)
        self._pairs = _PAIRS.get(self.layout)
        self.scratch: Scratch | None = None
        self._lock = threading.Lock()

    def reserve(self, rows: int) -> Scratch:
        """Scratch for requests of up to ``rows`` rows, made now (its pages faulted in) if it is smaller."""
        if self.scratch is None or self.scratch.rows < rows:
            self.scratch = Scratch(self.layout, self.width, rows)
            for t in self.scratch.buffers():
                t.zero_()  # fault the pages in now, not during a request
        return self.scratch

    def warm(self, rows: int, max_gathers: int = WARM_MAX_GATHERS, clock=time.perf_counter) -> list[float]:
        """Scratch for ``rows`` rows, then gathers of ``rows`` random ids until two in a row take the
        same time (``settled``), at most ``max_gathers``. Returns each gather's seconds by ``clock``."""
        self.reserve(rows)
        out = torch.empty((rows, self.width), dtype=torch.bfloat16)
        generator = torch.Generator().manual_seed(_WARM_SEED)
        times: list[float] = []
        while len(times) < max_gathers and not settled(times):
            ids = torch.randint(0, self.rows, (rows,), generator=generator)
            start = clock()
            self.gather(ids, out=out)
            times.append(clock() - start)
        return times

    def gather(self, row_ids, out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        ids = torch.as_tensor(row_ids).reshape(-1)
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"row ids must be integers, got {ids.dtype}")
        n = ids.numel()
        if out is None:
            out = torch.empty((n, self.width), dtype=dtype or torch.bfloat16)
        elif tuple(out.shape) != (n, self.width):
            raise ValueError(f"out has shape {tuple(out.shape)}; "
                             f"{n} rows of table {self.table} need ({n}, {self.width})")
        elif dtype is not None and out.dtype != dtype:
            raise ValueError(f"out is {out.dtype} but dtype={dtype} was asked for")
        if n == 0:
            return out
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= self.rows:
            bad = lo if lo < 0 else hi
            raise IndexError(f"row id {bad} is out of range for table {self.table}: ids must be in [0, {self.rows})")
        with self._lock:
            self._gather(ids, n, out)
        return out

    def _gather(self, ids: torch.Tensor, n: int, out: torch.Tensor) -> None:
        s = self.reserve(n)
        if ids.dtype != torch.int64 or not ids.is_contiguous():
            ids = s.ids[:n].copy_(ids)
        shard, offset = s.shard[:n], s.offset[:n]
        torch.searchsorted(self._boundaries, ids, right=True, out=shard)
        torch.index_select(self._main_base, 0, shard, out=offset).add_(ids, alpha=self._row_bytes)
        packed = torch.index_select(self._main, 0, offset, out=s.packed[:n])
        torch.index_select(self._scale_base, 0, shard, out=offset).add_(ids, alpha=self._scale_bytes)
        scale_bytes = torch.index_select(self._scales, 0, offset, out=s.scale_bytes[:n])
        work = out if out.dtype == torch.float32 and out.is_contiguous() else s.work_rows(n)
        if self.layout == "ples_fp8":
            work.copy_(packed.view(torch.float8_e4m3fn))
            work.mul_(scale_bytes.view(torch.float32))  # [n, 1]: one scale a row
        else:
            scale = s.scale[:n].copy_(scale_bytes.view(_SCALE_DTYPE[self.layout]))
            codes = s.codes[:n].copy_(packed)
            torch.index_select(self._pairs, 0, codes.view(-1), out=work.view(-1, 2))
            blocks = work.view(n, self.width // _BLOCK, _BLOCK)
            blocks.mul_(scale.unsqueeze(2))
            if self._scale2 is not None:
                blocks.mul_(torch.index_select(self._scale2, 0, shard, out=s.scale2[:n]).view(n, 1, 1))
        if work is not out:
            out.copy_(work)
