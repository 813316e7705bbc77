"""A model checkpoint's PLE tables, found by tensor name and checked: the source of the arrays form.

vLLM 0.33 loads each PLE layer's table from the checkpoint's own tensors, not from the published sidecar:
``<prefix>.ple.ple_embedding.ngram_embedding.shard_<i>.weight`` (nvfp4 also ``.weight_scale``, its block
scales), rows in shard order, 512 shards by default with the trailing ones possibly empty, or one unsharded
``….ngram_embedding.weight`` (bf16 and fp8). One table per PLE layer, each with its own row count. The small
tensors (fp8's ``weight_scale``, nvfp4's ``weight_scale_2``, the hash buffers) stay with vLLM's own loader.

A checkpoint is a directory (through ``model.safetensors.index.json`` where it has one, else every
``.safetensors`` file in it), an index file, one ``.safetensors`` file or a glob of them. Only headers are read
here, each within the boundary's bounds; every refusal is a SidecarError naming the file and what to do.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from pled.daemon.sources import engram
from pled.daemon.sources.naming import find_files, natural_key, odd_one_out
from pled.daemon.sources.safetensors_file import SafetensorsHeader, TensorInfo, read_header
from pled.daemon.sources.sidecar import Shard, Sidecar
from pled.shared import arrays
from pled.shared.arrays import LAYOUT as ARRAYS_LAYOUT
from pled.shared.boundary import BoundaryError, ascii_count, clip, load_json, read_bounded
from pled.shared.errors import SidecarError
from pled.shared.tensors import nbits

INDEX = "model.safetensors.index.json"
MAX_ARRAYS = 1024  # a model has a PLE table per layer, nvfp4 two arrays each: a few hundred at the most
MAX_INDEX = 32 * 1024 * 1024  # a large model's index lists ~100,000 tensors in a few MB
LOOKED_FOR = (f"tensors named <prefix>{arrays.SUFFIX}.shard_<i>.weight (nvfp4 also .weight_scale), or an unsharded "
              f"<prefix>{arrays.SUFFIX}.weight, or Engram tables <prefix>{arrays.ENGRAM_SUFFIX}.weight and .scale")


@dataclass(frozen=True)
class PleArray:
    """One array to assemble: a PLE table's pinned parameter, from its shard tensors in row order."""

    prefix: str
    param: str
    dtype: str
    width: int
    parts: int  # shard tensors (0: one unsharded tensor)
    tensors: tuple[tuple[int, TensorInfo], ...]  # (index of its file in Checkpoint.shards, the tensor), row order

    @property
    def rows(self) -> int:
        return sum(t.shape[0] for _, t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self.tensors)


@dataclass(frozen=True)
class Checkpoint:
    source: str  # as configured
    shards: tuple[Shard, ...]  # the files holding PLE tensors, in name order
    arrays: tuple[PleArray, ...]
    layout: str = ARRAYS_LAYOUT
    rows: int = 0
    row_width: int = 0
    meta: dict = field(default_factory=dict)
    expected_digests: dict = field(default_factory=dict)  # a checkpoint ships none pled reads

    @property
    def nbytes(self) -> int:
        """Bytes the arrays hold, exactly (what staging copies)."""
        return sum(a.nbytes for a in self.arrays)

    def describe(self) -> dict:
        held = [f for a in self.arrays for f, _ in a.tensors]
        return {
            "source": self.source, "form": "arrays", "layout": self.layout, "bytes": self.nbytes,
            "arrays": [{"prefix": a.prefix, "param": a.param, "dtype": a.dtype, "rows": a.rows, "width": a.width,
                        "shards": a.parts, "bytes": a.nbytes, "kind": "engram" if arrays.is_engram(a.prefix) else "ple"}
                       for a in self.arrays],
            "engram": [{"prefix": a.prefix, "rows": a.rows, "bytes": a.nbytes + s.nbytes,
                        "private_copies": engram.private_copies(a.rows, a.width)}
                       for a in self.arrays if arrays.is_engram(a.prefix) and a.param == "weight"
                       for s in self.arrays if s.prefix == a.prefix and s.param == "scale"],
            "files": [{"path": s.path, "bytes": s.size, "ple_tensors": held.count(s.index)} for s in self.shards],
        }


Source = Sidecar | Checkpoint  # what a table is staged from: whole files, or a checkpoint's PLE tables


def ple_name(name: str, where: str) -> tuple[str, int | None, str] | None:
    """(prefix, shard number or None for the unsharded form, parameter) of a PLE table tensor's name; None for any
    other tensor; SidecarError naming ``where`` (the header or index that holds the name) for a shard number vLLM
    reads and pled does not (not ASCII, or 10**9 or more). Total: a value or pled's refusal for any str, linear in
    its length (no int() of more than nine ASCII digits)."""
    head, sep, tail = name.rpartition(arrays.SUFFIX + ".")
    if not sep or not head:
        return None
    prefix = head + arrays.SUFFIX
    if tail == "weight":
        return prefix, None, "weight"
    if not tail.startswith("shard_"):
        return None
    number, dot, param = tail[len("shard_"):].partition(".")
    if not dot or param not in arrays.PARAMS or not number.isdigit():  # what vLLM 0.33 skips too (str.isdigit)
        return None
    value = ascii_count(number, 9)
    if value is None:
        raise SidecarError(where, f"tensor {clip(name, 200)!r}: vLLM reads its shard number {clip(number, 40)!r}, "
                                  "but pled takes shard numbers of ASCII digits below 10**9 only: rename it")
    return prefix, value, param


def table_name(name: str, where: str) -> tuple[str, int | None, str] | None:
    """``ple_name``, or an Engram table's tensor (pled.daemon.sources.engram): what a ``checkpoint`` table holds."""
    return ple_name(name, where) or engram.engram_name(name)


def is_ple(name: str) -> bool:
    """Whether ``name`` is (or claims to be: ``ple_name`` refuses it) a PLE or Engram table's tensor."""
    try:
        return table_name(name, "") is not None
    except SidecarError:
        return True


def parse_index(path: str, raw: bytes) -> dict[str, list[str]]:
    """The PLE tensors ``model.safetensors.index.json`` (at ``path``, its bytes ``raw``) says each file holds: file
    name -> tensor names, in the index's order. Total: that, or a SidecarError naming the index, for any bytes."""
    try:
        doc = load_json(raw, max_bytes=MAX_INDEX, max_depth=3, max_values=MAX_INDEX // 8)
    except BoundaryError as err:
        raise SidecarError(path, f"cannot be read as a checkpoint index ({err}); fix it or point `checkpoint` at "
                                 "the .safetensors files") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SidecarError(path, "has no \"weight_map\" of tensor names to file names")
    wanted: dict[str, list[str]] = {}
    for name, filename in weight_map.items():
        if table_name(name, path) is None:
            continue
        if "/" in filename or filename in ("", ".", "..") or "\0" in filename:  # "/": not its own basename
            raise SidecarError(path, f"names {clip(filename, 120)!r} for {clip(name, 120)!r}; a checkpoint's "
                                     "files are named without a directory")
        if not filename.isascii() and not _encodable(filename):  # isascii: at no cost, as most are
            raise SidecarError(path, f"names {clip(filename, 120)!r} for {clip(name, 120)!r}, which is not a file "
                                     "name (a lone surrogate: not UTF-8); fix the index")
        wanted.setdefault(filename, []).append(name)
    return wanted


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def looks_like_checkpoint(source: str) -> bool:
    """Whether ``pled inspect`` should list ``source`` as a checkpoint: a directory with an index, or an index."""
    return source.endswith(".json") or os.path.isfile(os.path.join(source, INDEX))


def open_checkpoint(source: str) -> Checkpoint:
    """Find and check the PLE tables of the checkpoint at ``source``; SidecarError names the file and the fault."""
    files = _candidate_files(source)
    found: dict[tuple[str, str], dict] = {}  # (prefix, param) -> {shard number or None: (path, tensor)}
    holding: dict[str, SafetensorsHeader] = {}  # path -> header, of the files that hold PLE tensors
    for path, expected in files:
        header = read_header(path)
        names = {t.name: t for t in header.tensors}
        for name in expected or ():
            if name not in names:
                raise SidecarError(path, f"has no tensor {clip(name, 120)!r}, which {INDEX} says it holds; the "
                                         "checkpoint is incomplete or its index stale")
        hits = [(t, parsed) for t in header.tensors if (parsed := table_name(t.name, path)) is not None]
        if hits:  # kept with its table tensors only: a file's other tensors are vLLM's, and a reload's plan carries
            # the headers it keeps from the planning child to pled (regions/parsing.py): 120,000 tensors of an 8 MiB
            # header are a third of a second of pled's CPU to unpickle, in the loop's process
            holding[path] = replace(header, tensors=tuple(t for t, _ in hits))
        for t, (prefix, number, param) in hits:
            slot = found.setdefault((prefix, param), {})
            if number in slot:
                raise SidecarError(path, f"tensor {clip(t.name, 120)!r} is also in {slot[number][0]} (shard "
                                         f"{number} twice); remove one copy")
            slot[number] = (path, t)
    if not found:
        raise SidecarError(source, f"holds no PLE table: pled looked for {LOOKED_FOR}; point `checkpoint` at a "
                                   "Qwen4Exp or DeepSeek V4.1 checkpoint, or serve this with `path`")
    if len(found) > MAX_ARRAYS:
        raise SidecarError(source, f"holds {len(found)} PLE tables and parameters; pled takes at most {MAX_ARRAYS} "
                                   "(each array is placed on its own 2 MiB boundary): is this one model's checkpoint?")
    paths = sorted(holding, key=lambda p: natural_key(os.path.basename(p)))
    shards = tuple(_shard(i, p, holding[p]) for i, p in enumerate(paths))
    file_index = {p: i for i, p in enumerate(paths)}
    built = [_array(prefix, param, slots, file_index) for (prefix, param), slots in found.items()]
    built.sort(key=lambda a: (natural_key(a.prefix), arrays.ORDER.index(a.param)))
    _check_pairs(built, shards)
    engram.check_pairs(built, shards)
    return Checkpoint(source=source, shards=shards, arrays=tuple(built))


def _candidate_files(source: str) -> list[tuple[str, list[str] | None]]:
    """The files to read headers of, each with the PLE tensors the index says it holds (None: no index)."""
    if "\0" in source:
        raise SidecarError(source, "the checkpoint's path contains a NUL byte")
    index = os.path.join(source, INDEX) if os.path.isdir(source) else source if source.endswith(".json") else None
    if index is None or (os.path.isdir(source) and not os.path.lexists(index)):
        return [(f, None) for f in find_files(source, numbering=False)]
    try:
        raw = read_bounded(index, MAX_INDEX, "checkpoint index")
    except BoundaryError as err:
        raise SidecarError(index, f"cannot be read as a checkpoint index ({err}); fix it or point `checkpoint` at "
                                  "the .safetensors files") from None
    wanted = parse_index(index, raw)
    base = os.path.dirname(os.path.abspath(index))
    return [(os.path.join(base, f), names) for f, names in sorted(wanted.items(), key=lambda kv: natural_key(kv[0]))]


def _shard(index: int, path: str, header: SafetensorsHeader) -> Shard:
    try:
        st = os.stat(path)
    except OSError as err:
        raise SidecarError(path, f"vanished while being read ({err.strerror or err})") from err
    return Shard(index=index, path=os.path.realpath(path), header=header, mtime_ns=st.st_mtime_ns, dev=st.st_dev,
                 ino=st.st_ino)


def _array(prefix: str, param: str, slots: dict, file_index: dict[str, int]) -> PleArray:
    name = f"{prefix}.{param}" if None in slots else f"{prefix}.shard_<i>.{param}"
    if None in slots and len(slots) > 1:
        raise SidecarError(slots[None][0], f"holds the unsharded {clip(prefix, 160)}.weight, and the checkpoint "
                                           "shard_<i>.weight tensors of the same table too: keep one form")
    numbers = sorted(n for n in slots if n is not None) if None not in slots else [None]
    if numbers != [None] and numbers != list(range(len(numbers))):
        missing = next(i for i in range(len(numbers) + 1) if i not in slots)
        raise SidecarError(slots[numbers[0]][0], f"table {clip(name, 200)}: shard {missing} is missing "
                                                 f"(found {len(numbers)}, up to {numbers[-1]}); the checkpoint is "
                                                 "incomplete")
    tensors = [(file_index[slots[n][0]], slots[n][1]) for n in numbers]
    for n in numbers:
        path, t = slots[n]
        if len(t.shape) != 2:
            raise SidecarError(path, f"tensor {clip(t.name, 200)!r} is {t.dtype}{list(t.shape)}; a table's shards are "
                                     "[rows, width]")
    # One dtype and one width for every shard (byte order is the format's: every safetensors dtype is little-endian).
    # The shard named is the one that disagrees with the others, not the second where the first is the odd one.
    disagree = odd_one_out([(t.dtype, t.shape[1]) for _, t in tensors])
    if disagree is not None:
        (path, t), (_, agreed) = slots[numbers[disagree[0]]], slots[numbers[disagree[1]]]
        raise SidecarError(path, f"tensor {clip(t.name, 200)!r} is {t.dtype}{list(t.shape)}; the table's other "
                                 f"shards are {agreed.dtype}[rows, {agreed.shape[1]}] (as {clip(agreed.name, 200)!r} "
                                 "is): one table's shards share a dtype and a width")
    first = tensors[0][1]
    width = first.shape[1]
    if width == 0:
        raise SidecarError(slots[numbers[0]][0], f"table {clip(name, 200)} has rows of width 0")
    if nbits(first.dtype, (width,)) % 8:
        raise SidecarError(slots[numbers[0]][0], f"table {clip(name, 200)} has rows of {first.dtype} x {width}, "
                                                 "not a whole number of bytes")
    rows = [t.shape[0] for _, t in tensors]
    total, size = sum(rows), rows[0]
    expected = [max(0, min(size, total - i * size)) for i in range(len(rows))]
    if total == 0 or (numbers != [None] and rows != expected):
        raise SidecarError(slots[numbers[0]][0], f"table {clip(name, 200)}: its shards hold {_runs(rows)} rows; "
                                                 f"vLLM reads shards of {size} rows each, then the rest, then empty "
                                                 f"ones ({_runs(expected)})")
    return PleArray(prefix, param, first.dtype, width, 0 if numbers == [None] else len(numbers), tuple(tensors))


def _runs(rows: list[int]) -> str:
    """[5, 5, 5, 2, 0] as "5 x3, 2, 0": short whatever the shard count."""
    out: list[str] = []
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j] == rows[i]:
            j += 1
        out.append(f"{rows[i]} x{j - i}" if j - i > 1 else str(rows[i]))
        i = j
    return ", ".join(out[:8]) + (", ..." if len(out) > 8 else "")


def _check_pairs(built: list[PleArray], shards: tuple[Shard, ...]) -> None:
    """nvfp4's block scales (``weight_scale``) beside their table's ``weight``: U8 codes two a byte, one F8_E4M3 scale
    each 16 values (the scales' width an eighth of the codes'), split alike (the same shards, the same rows each)."""
    weights = {a.prefix: a for a in built if a.param == "weight"}
    for scale in (a for a in built if a.param == "weight_scale" and not arrays.is_engram(a.prefix)):
        where = shards[scale.tensors[0][0]].path
        weight = weights.get(scale.prefix)
        if weight is None:
            raise SidecarError(where, f"table {clip(scale.prefix, 200)} has block scales (weight_scale shards) but no "
                                      "weight: the checkpoint is incomplete")
        if (weight.dtype, scale.dtype) != ("U8", "F8_E4M3") or scale.width * 8 != weight.width:
            raise SidecarError(where, f"table {clip(scale.prefix, 200)}: weight {weight.dtype} x {weight.width} and "
                                      f"weight_scale {scale.dtype} x {scale.width} are not nvfp4's (U8 x W/2 and "
                                      "F8_E4M3 x W/16)")
        rows = ([t.shape[0] for _, t in weight.tensors], [t.shape[0] for _, t in scale.tensors])
        if weight.parts != scale.parts or rows[0] != rows[1]:
            raise SidecarError(where, f"table {clip(scale.prefix, 200)}: its weight and weight_scale shards hold "
                                      f"different rows ({_runs(rows[0])} against {_runs(rows[1])})")
