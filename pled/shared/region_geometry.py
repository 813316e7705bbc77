"""The geometry a region's manifest must have (pled.shared.region's Manifest.from_json, and the daemon's check of its
own plan): every shard and tensor inside the region, in order, without overlap, each tensor's size its shape's, a
PLE layout's tensors with the rows and width it says. Apart from region.py, which calls it, so that each stays
readable; it takes the format's figures as arguments rather than importing region (no import circle)."""
from __future__ import annotations

from typing import Any

from pled.shared import arrays as arrays_form, layouts
from pled.shared.boundary import clip, in_time
from pled.shared.tensors import DTYPE_BITS, nbits, shape_problem


def check_geometry(m: Any, format_version: int, prefix_size: int) -> None:
    """Every shard and tensor lies inside the region, in order and without overlap; every tensor's dtype is known
    and its size is its shape's (the shape checked before any product); a PLE table's shards hold its layout's
    tensors with the rows and width it says. The arrays form: pled.shared.arrays.check."""
    if m.format != format_version:
        raise ValueError(f"is of format {m.format}; this pled reads format {format_version}")
    if min(m.rows, m.row_width) < 0 or not prefix_size <= m.data_offset <= m.region_bytes:
        raise ValueError(f"gives rows {m.rows}, width {m.row_width}, data at {m.data_offset} of {m.region_bytes} bytes")
    seen: dict[int, dict[str, Any]] = {i: {} for i in range(len(m.shards))}
    for t in m.tensors:
        in_time(1024)  # within a caller's deadline (boundary.deadline: attach()'s timeout)
        if t.shard not in seen:
            raise ValueError(f"puts tensor {clip(t.name, 80)!r} in shard {t.shard}; there are {len(m.shards)} shards")
        if t.name in seen[t.shard]:
            raise ValueError(f"lists tensor {clip(t.name, 80)!r} of shard {t.shard} twice")
        seen[t.shard][t.name] = t
        if t.dtype not in DTYPE_BITS:
            raise ValueError(f"gives tensor {clip(t.name, 80)!r} an unknown dtype {clip(t.dtype, 40)!r} "
                             f"(known: {', '.join(DTYPE_BITS)})")
        problem = shape_problem(t.shape)
        if problem:
            raise ValueError(f"gives tensor {clip(t.name, 80)!r} a shape that {problem}")
        if nbits(t.dtype, t.shape) != 8 * t.nbytes:
            raise ValueError(f"gives tensor {clip(t.name, 80)!r} {t.nbytes} bytes ({8 * t.nbytes} bits), but "
                             f"{t.dtype}{list(t.shape)} is {nbits(t.dtype, t.shape)} bits")
    if m.arrays:
        arrays_form.check(m)
        return
    end = m.data_offset
    for i, s in enumerate(m.shards):
        if s.index != i or s.rows < 0 or s.size < 0 or s.offset < end or s.offset + s.size > m.region_bytes:
            raise ValueError(f"places shard {s.index} ({s.size} bytes, {s.rows} rows) at {s.offset}, outside bytes "
                             f"{end}..{m.region_bytes} of the region (after the header and the shards before it)")
        end = s.offset + s.size
    for t in m.tensors:
        in_time(1024)
        s = m.shards[t.shard]
        if t.offset < s.offset or t.offset + t.nbytes > s.offset + s.size:
            raise ValueError(f"places tensor {clip(t.name, 80)!r} at bytes {t.offset}..{t.offset + t.nbytes}, outside "
                             f"its shard {t.shard} (bytes {s.offset}..{s.offset + s.size} of {m.region_bytes})")
    _refuse_overlapping_tensors(m.tensors)
    layout = layouts.LAYOUTS.get(m.layout)
    if layout is None:  # a generic table (or a layout this pled does not know): its tensors are all there is
        return
    for i, tensors in seen.items():
        if set(tensors) != layout.names:
            raise ValueError(f"gives shard {i} tensors {sorted(map(clip, tensors))}; "
                             f"{layout.name} has {sorted(layout.names)}")
        rows, width = layouts.rows_and_width(layout, {n: t.shape for n, t in tensors.items()},
                                             {n: t.dtype for n, t in tensors.items()})
        if (rows, width) != (m.shards[i].rows, m.row_width):
            raise ValueError(f"says shard {i} has {m.shards[i].rows} rows of width {m.row_width}; its tensors have "
                             f"{rows} of width {width}")
    if sum(s.rows for s in m.shards) != m.rows:
        raise ValueError(f"says {m.rows} rows; its shards hold {sum(s.rows for s in m.shards)}")


def _refuse_overlapping_tensors(tensors: tuple[Any, ...]) -> None:
    """No two tensors of the files form share a byte (each lies in its shard, so shards apart, only a shard's own
    can): sorted by offset, each begins at or after the end of every one before it. O(n log n); an empty tensor
    holds no byte, and may lie anywhere in its shard."""
    placed = sorted((t.offset, t.offset + t.nbytes, i) for i, t in enumerate(tensors) if t.nbytes)
    for (_, end, i), (begin, _, j) in zip(placed, placed[1:], strict=False):
        if begin < end:
            a, b = tensors[i], tensors[j]
            raise ValueError(f"places tensor {clip(b.name, 80)!r} at bytes {b.offset}..{b.offset + b.nbytes}, over "
                             f"tensor {clip(a.name, 80)!r} at {a.offset}..{a.offset + a.nbytes} (shard {a.shard})")
