"""The region's second form: a model checkpoint's PLE tables as assembled arrays (vLLM 0.33's own PLE path).

A checkpoint splits each PLE table into ``….ngram_embedding.shard_<i>.weight`` tensors (nvfp4 also
``.weight_scale``), rows in order. vLLM 0.33 gives each rank of its embedding group a contiguous row range of the
whole table, ``[r·P, (r+1)·P)``, for every group size: so the table must lie in one piece for a rank's rows to be a
view. The arrays form holds, per table and pinned parameter, one array: every shard tensor's data bytes verbatim,
in shard order (``shard_0 ‖ shard_1 ‖ …``), the array starting on a 2 MiB boundary and padded to one.

The manifest (pled.shared.region.Manifest) of this form has:
- ``shards``: the checkpoint files that hold the tables' tensors (their identity; not placed: offset 0, rows 0);
- ``tensors``: each source tensor (its name in the checkpoint, its file, dtype, shape) where it lies in the region,
  inside its array, so a file's tensors can be served as views;
- ``arrays``: per array its checkpoint prefix, parameter, dtype, shape [rows, width], offset, the number of shards
  the checkpoint split it into, and its sources in row order, as columns: each one's tensor, where its data begins
  in its file, the first row of the array it fills, and its content digest (recorded while staging).
A client of a pled release without this form refuses such a region: its manifest reader knows no ``arrays`` key (the
manifest nests no deeper than a sidecar's, 4 levels, so that is what it says).
"""
from __future__ import annotations

from dataclasses import dataclass

from pled.shared.boundary import clip, in_time
from pled.shared.hugepages import PMD_SIZE
from pled.shared.records import fields_of
from pled.shared.tensors import DTYPE_BITS, nbits, shape_problem

LAYOUT = "ple-arrays"  # the manifest's layout for this form, as Status shows it
SUFFIX = ".ple.ple_embedding.ngram_embedding"  # what every PLE table's prefix ends with, in the checkpoint and vLLM
PARAMS = ("weight", "weight_scale")  # the parameters vLLM 0.33 pins (weight_scale: nvfp4's block scales)
# DeepSeek V4.1's Engram tables (vLLM 0.33's ParallelEngramEmbedding): per layer one unsharded tensor pair,
# ``layers.L.engram.embed.weight`` [N_L, 256] F8_E4M3 and ``layers.L.engram.embed.scale`` [N_L, 8] F8_E8M0 (one ue8m0
# scale byte a 32 values), held as two arrays in that order; vLLM maps them to ``weight`` and ``weight_scale_inv``.
ENGRAM_SUFFIX = ".engram.embed"
ENGRAM_PARAMS = ("weight", "scale")
ENGRAM_DTYPES = {"weight": "F8_E4M3", "scale": "F8_E8M0"}
ENGRAM_BLOCK = 32  # values a scale byte covers (ParallelEngramEmbedding's block_size)
ORDER = (*PARAMS, "scale")  # an array's place beside the others of its prefix


def is_engram(prefix: str) -> bool:
    """Whether an array's prefix is an Engram table's (``layers.1.engram.embed``), not a PLE table's."""
    return prefix.endswith(ENGRAM_SUFFIX)


@dataclass(frozen=True)
class SourceEntry:
    """One source tensor of an array, as ``ArrayEntry.sources`` gives it."""

    tensor: int  # index in the manifest's tensors
    begin: int  # where its data begins in its file
    rows: tuple[int, int]  # the rows of the array it fills, [lo, hi)
    digest: str  # "<digests.OWN>:<hex>" of its bytes, recorded while staging ("" in an identity)


@dataclass(frozen=True)
class ArrayEntry:
    """One array. Its sources are columns of equal length (the manifest nests no deeper than a sidecar's, so a client
    of a release without this form refuses it by its unknown ``arrays`` key, not by its depth)."""

    prefix: str  # in the checkpoint: "model.language_model.layers.3.ple.ple_embedding.ngram_embedding"
    param: str  # "weight" or "weight_scale"
    dtype: str
    shape: tuple[int, ...]  # [rows, width]
    offset: int  # in the region, on a 2 MiB boundary
    nbytes: int
    parts: int  # how many shard tensors the checkpoint split it into (0: one unsharded tensor)
    tensors: tuple[int, ...]  # each source: its index in the manifest's tensors, in row order
    begins: tuple[int, ...]  # each source: where its data begins in its file
    starts: tuple[int, ...]  # each source: its first row in the array
    digests: tuple[str, ...]  # each source: the digest of its bytes

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape[0] else nbits(self.dtype, self.shape[1:]) // 8

    @property
    def sources(self) -> tuple[SourceEntry, ...]:
        columns = (self.tensors, self.begins, self.starts, (*self.starts[1:], self.shape[0]), self.digests)
        return tuple(SourceEntry(t, b, (lo, hi), d) for t, b, lo, hi, d in zip(*columns, strict=True))

    @property
    def key(self) -> str:
        """The prefix from its last ``layers.<n>.`` on: what a model's module prefix is matched by (vLLM renames the
        checkpoint's ``model.language_model.`` to ``model.``, or nests it under ``language_model.``)."""
        return layer_key(self.prefix)


def layer_key(prefix: str) -> str:
    """``layers.3.ple.ple_embedding.ngram_embedding`` from any prefix with a ``layers.<n>`` (else the prefix itself):
    its components from the last ``layers`` followed by a number on. One pass over the prefix."""
    parts = prefix.split(".")
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == "layers" and parts[i + 1].isascii() and parts[i + 1].isdigit():
            return ".".join(parts[i:])
    return prefix


def parse(docs: object) -> tuple[ArrayEntry, ...]:
    """The manifest's ``arrays`` list from untrusted JSON; ValueError says what is wrong."""
    if type(docs) is not list:
        raise ValueError("has arrays as something other than a list")
    out = []
    for i, doc in enumerate(docs):
        a = fields_of(doc, ArrayEntry, f"array {i}")
        columns = ("tensors", "begins", "starts", "digests")
        if len({len(a[c]) for c in columns}) != 1:
            raise ValueError(f"gives array {i} {', '.join(f'{len(a[c])} {c}' for c in columns)}: one of each a source")
        out.append(ArrayEntry(a["prefix"], a["param"], a["dtype"], tuple(a["shape"]), a["offset"], a["nbytes"],
                              a["parts"], *(tuple(a[c]) for c in columns)))
    return tuple(out)


def check(m) -> None:
    """The arrays form's geometry (``m``: a region.Manifest with arrays): files not placed; each array on a 2 MiB
    boundary inside the region, in order, without overlap, its size its shape's; its sources its tensors in order,
    each of the array's dtype and width, lying where its rows are, inside its file; every tensor one source."""
    for i, s in enumerate(m.shards):
        if s.index != i or s.size < 0 or s.offset != 0 or s.rows != 0:
            raise ValueError(f"gives checkpoint file {i} index {s.index}, {s.size} bytes, offset {s.offset}, rows "
                             f"{s.rows}; a file of an arrays table has offset 0 and rows 0")
    sourced = [False] * len(m.tensors)
    for t in m.tensors:
        if not 0 <= t.shard < len(m.shards):
            raise ValueError(f"puts tensor {clip(t.name, 80)!r} in file {t.shard}; there are {len(m.shards)} files")
    free, seen = m.data_offset, set()  # free: the first byte after the header, the manifest and the arrays so far
    for a in m.arrays:
        what = f"array {clip(a.prefix, 120)}.{clip(a.param, 20)}"
        if (a.prefix, a.param) in seen:
            raise ValueError(f"lists {what} twice")
        seen.add((a.prefix, a.param))
        problem = shape_problem(a.shape) or (None if len(a.shape) == 2 else "is not [rows, width]")
        if a.dtype not in DTYPE_BITS or problem:
            raise ValueError(f"gives {what} dtype {clip(a.dtype, 40)!r} and a shape that {problem or 'is fine'}")
        if nbits(a.dtype, a.shape[1:]) % 8 or nbits(a.dtype, a.shape) != 8 * a.nbytes or a.parts < 0:
            raise ValueError(f"gives {what} {a.nbytes} bytes for {a.dtype}{list(a.shape)}, {a.parts} parts")
        if a.offset % PMD_SIZE or a.offset < free or a.offset + a.nbytes > m.region_bytes:
            raise ValueError(f"places {what} at bytes {a.offset}..{a.offset + a.nbytes}, not on a 2 MiB boundary at "
                             f"or after byte {free} (past the header and the arrays before it) and inside the "
                             f"region's {m.region_bytes}")
        free = a.offset + a.nbytes
        lo = 0
        ends = (*a.starts[1:], a.shape[0])
        for index, begin, start, end in zip(a.tensors, a.begins, a.starts, ends, strict=True):  # the columns
            in_time(1024)  # a client's attach(timeout) bounds these checks too (boundary.deadline)
            if not 0 <= index < len(m.tensors) or sourced[index]:
                raise ValueError(f"gives {what} a source tensor {index} that is not one of the manifest's "
                                 "tensors, or is another array's too")
            sourced[index] = True
            t = m.tensors[index]
            hi = lo + (t.shape[0] if len(t.shape) == 2 else -1)
            place = a.offset + lo * a.row_bytes
            if (t.dtype != a.dtype or len(t.shape) != 2 or t.shape[1] != a.shape[1] or (start, end) != (lo, hi)
                    or t.offset != place or t.nbytes != (hi - lo) * a.row_bytes):
                raise ValueError(f"gives {what} a source {clip(t.name, 120)!r} ({t.dtype}{list(t.shape)} at "
                                 f"{t.offset}, rows {[start, end]}) that is not its rows {lo}.. at {place}")
            if begin < 8 or begin + t.nbytes > m.shards[t.shard].size:
                raise ValueError(f"reads {clip(t.name, 120)!r} from bytes {begin}..{begin + t.nbytes} of a "
                                 f"{m.shards[t.shard].size}-byte file")
            lo = hi
        if lo != a.shape[0]:
            raise ValueError(f"says {what} has {a.shape[0]} rows; its sources hold {lo}")
    if not all(sourced):
        raise ValueError(f"lists tensor {clip(m.tensors[sourced.index(False)].name, 120)!r}, which no array holds")


def place(source, data_offset: int, make_tensor, placeholder: str) -> tuple[list, tuple[ArrayEntry, ...], int]:
    """Where each array of ``source`` (pled.daemon.sources.checkpoint.Checkpoint) sits from ``data_offset`` on: the
    tensors (made by ``make_tensor(name, file, dtype, shape, offset, nbytes)``), the arrays (each source's digest
    ``placeholder``), and where the last one ends, rounded up to a 2 MiB boundary (the region's size)."""
    tensors: list = []
    entries = []
    offset = data_offset
    for a in source.arrays:
        lo, sources = 0, []
        row_bytes = nbits(a.dtype, (a.width,)) // 8
        for file_index, info in a.tensors:
            rows = info.shape[0]
            sources.append((len(tensors), info.begin, lo))
            tensors.append(make_tensor(info.name, file_index, info.dtype, tuple(info.shape),
                                       offset + lo * row_bytes, info.nbytes))
            lo += rows
        indices, begins, starts = (tuple(c) for c in zip(*sources, strict=True)) if sources else ((), (), ())
        entries.append(ArrayEntry(a.prefix, a.param, a.dtype, (lo, a.width), offset, lo * row_bytes, a.parts,
                                  indices, begins, starts, (placeholder,) * len(sources)))
        offset = _align(offset + lo * row_bytes)
    return tensors, tuple(entries), offset


def _align(n: int) -> int:
    return -(-n // PMD_SIZE) * PMD_SIZE
