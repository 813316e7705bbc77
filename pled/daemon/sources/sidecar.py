"""A table's source files: found, ordered, validated, described.

A table is either a sidecar directory (``shard_N.safetensors`` plus an optional
``META.json``) or a glob of ``.safetensors`` files, such as a checkpoint's own
``model-00001-of-00004.safetensors``. Everything here reads headers only; the
bytes a table needs are the sum of its files, never an estimate.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

from pled.daemon.sources import sidecar_meta
from pled.daemon.sources.safetensors_file import SafetensorsHeader, read_header
from pled.shared import layouts
from pled.shared.boundary import BoundaryError, clip, load_json, read_bounded
from pled.shared.digests import HEX_LENGTH
from pled.shared.errors import SidecarError

SUFFIX = ".safetensors"
META = "META.json"
MAX_META = 4 * 1024 * 1024  # META.json: a few keys and a digest per shard
MAX_SUMS = 4 * 1024 * 1024  # B3SUMS, SHA256SUMS: a line per shard


@dataclass(frozen=True)
class Shard:
    index: int
    path: str  # real path: the identity a client compares against
    header: SafetensorsHeader
    mtime_ns: int
    dev: int
    ino: int
    rows: int = 0  # 0 for a generic table

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def size(self) -> int:
        return self.header.size


@dataclass(frozen=True)
class Sidecar:
    source: str  # as configured: a directory, a file or a glob
    layout: str  # a layouts.LAYOUTS name or layouts.GENERIC
    shards: tuple[Shard, ...]
    rows: int  # total rows in shard order (0 for generic)
    row_width: int  # columns of the dequantized table (0 for generic)
    meta: dict = field(default_factory=dict)
    # File name -> (algorithm, hex, where it was written), if the sidecar ships digests.
    expected_digests: dict = field(default_factory=dict)
    arrays: tuple = ()  # a sidecar's files are staged whole (a checkpoint's PLE tables: pled.daemon.sources.checkpoint)

    @property
    def nbytes(self) -> int:
        """Bytes of the source files, exactly."""
        return sum(s.size for s in self.shards)

    def describe(self) -> dict:
        return {
            "source": self.source,
            "layout": self.layout,
            "shards": len(self.shards),
            "rows": self.rows,
            "row_width": self.row_width,
            "bytes": self.nbytes,
            "meta": {k: v for k, v in self.meta.items() if k != "digests"},
            "files": [
                {"path": s.path, "bytes": s.size, "rows": s.rows, "tensors": len(s.header.tensors),
                 "fingerprint": s.header.fingerprint}
                for s in self.shards
            ],
        }


def _trailing_number(stem: str) -> tuple[str, str]:
    """(what comes before, the run of decimal digits that ends ``stem``), from the end in one pass."""
    i = len(stem)
    while i and stem[i - 1].isdecimal():  # what \d matches in a str pattern
        i -= 1
    if len(stem[i:].lstrip("0")) > 18:  # no shard count or number has so many digits (and int() refuses 4,300)
        return stem, ""
    return stem[:i], stem[i:]


def numbered(name: str) -> tuple[str, int] | None:
    r"""(prefix, n) of ``<prefix><n>.safetensors`` (shard_12.safetensors: ("shard_", 12)), else None. Read from the
    end with str methods: a pattern with a lazy prefix (``^(.*?)(\d+)\.safetensors$``) took time that grew with the
    square of a name's digits (1.7 ms for one name of 240), and a directory may hold any number of names."""
    if not name.endswith(SUFFIX):
        return None
    prefix, digits = _trailing_number(name[:-len(SUFFIX)])
    return (prefix, int(digits)) if digits else None


def numbered_of(name: str) -> tuple[str, int, int] | None:
    """(prefix, n, total) of ``<prefix>-<n>-of-<total>.safetensors`` (model-00002-of-00004.safetensors), else
    None; as ``numbered``, from the end."""
    if not name.endswith(SUFFIX):
        return None
    rest, total = _trailing_number(name[:-len(SUFFIX)])
    if not total or not rest.endswith("-of-"):
        return None
    rest, n = _trailing_number(rest[:-len("-of-")])
    if not n or not rest.endswith("-"):
        return None
    return rest[:-1], int(n), int(total)


def natural_key(name: str) -> list:
    """shard_2 before shard_10: runs of ASCII digits compared as numbers (by length without leading zeros, then
    text: no int() of a run however long), everything else as text."""
    parts: list = re.split(r"(\d+)", name, flags=re.ASCII)
    for i in range(1, len(parts), 2):
        digits = parts[i].lstrip("0")
        parts[i] = (len(digits), digits)
    return parts


def find_files(source: str, numbering: bool = True) -> list[str]:
    """The .safetensors files a table path names, in numeric order; with ``numbering``, a gap in their numbers
    refused (a sidecar's, or a glob's; a checkpoint's files are whatever holds its PLE tensors)."""
    if "\0" in source:
        raise SidecarError(source, "the table's path contains a NUL byte")
    if os.path.isdir(source):
        try:
            names = [n for n in os.listdir(source) if n.endswith(".safetensors")]
        except OSError as err:
            raise SidecarError(source,
                               f"cannot list the directory ({err.strerror or err}); give pled's user access") from err
        if not names:
            raise SidecarError(source, "directory holds no .safetensors files; "
                                       "point the table at a sidecar directory or a glob")
        files = [os.path.join(source, n) for n in names]
    elif glob.has_magic(source):
        files = [f for f in glob.glob(source) if os.path.isfile(f)]
        if not files:
            raise SidecarError(source, "the pattern matches no files; check the table's path")
        not_st = [f for f in files if not f.endswith(".safetensors")]
        if not_st:
            raise SidecarError(not_st[0],
                               "matched by the table's pattern but not a .safetensors file; narrow the pattern")
    elif os.path.exists(source):
        files = [source]
    else:
        raise SidecarError(source, "no such file or directory; check the table's path")
    files.sort(key=lambda f: natural_key(os.path.basename(f)))
    if numbering:
        check_numbering(files)
    return files


def check_numbering(files: list[str]) -> None:
    """Refuse a gap or a duplicate in shard_N or model-0000K-of-0000M numbering."""
    names = [os.path.basename(f) for f in files]
    of = [numbered_of(n) for n in names]
    if all(of) and len({m[0] for m in of if m}) == 1:
        totals = {m[2] for m in of if m}
        if len(totals) != 1:
            raise SidecarError(files[0], f"files disagree on the shard count ({sorted(totals)})")
        (total,) = totals
        _contiguous(files, [m[1] for m in of if m], expect=range(1, total + 1))
        return
    found = [numbered(n) for n in names]
    if all(found) and len({m[0] for m in found if m}) == 1 and len(files) > 1:
        numbers = [m[1] for m in found if m]
        start = min(numbers)
        if start not in (0, 1):
            raise SidecarError(files[0], f"shard numbering starts at {start}; shards before it are missing")
        _contiguous(files, numbers, expect=range(start, start + len(numbers)))


def _contiguous(files: list[str], numbers: list[int], expect: range) -> None:
    seen: dict[int, str] = {}
    for n, f in zip(numbers, files, strict=True):
        if n in seen:
            raise SidecarError(f, f"shard number {n} appears twice (also {os.path.basename(seen[n])})")
        seen[n] = f
    missing = []  # the first few: a name may claim a count of 10**18 (model-00001-of-99999999999999)
    for n in expect:
        if n not in seen:
            missing.append(n)
            if len(missing) > 5:
                break
    if missing:
        directory = os.path.dirname(files[0])
        shown = ", ".join(str(n) for n in missing[:5]) + (" …" if len(missing) > 5 else "")
        raise SidecarError(directory,
                           f"shard numbering has a gap: number {shown} missing of {expect.start}..{expect.stop - 1}")
    if len(seen) != len(expect):
        extra = sorted(n for n in seen if n not in expect)
        raise SidecarError(seen[extra[0]], f"shard number {extra[0]} is outside {expect.start}..{expect.stop - 1}")


def open_table(source: str) -> Sidecar:
    """Find, read and validate every file of a table; SidecarError names the file and the fault."""
    files = find_files(source)
    headers = [read_header(f) for f in files]
    layout = _detect_layout(headers)
    rows_per_shard: list[int] = []
    width = 0
    if layout is not None:
        for h in headers:
            try:
                rows, w = layouts.rows_and_width(
                    layout, {t.name: t.shape for t in h.tensors}, {t.name: t.dtype for t in h.tensors}
                )
            except ValueError as err:
                raise SidecarError(h.path, str(err)) from err
            if width and w != width:
                raise SidecarError(h.path, f"row width {w} differs from {width} in {os.path.basename(headers[0].path)}")
            width = w
            rows_per_shard.append(rows)
    elif len(headers) > 1 and all(numbered(os.path.basename(h.path)) and not numbered_of(os.path.basename(h.path))
                                  for h in headers):
        _check_alike(headers)  # shards of one unknown layout must at least agree with each other
    shards = []
    for i, h in enumerate(headers):
        try:
            st = os.stat(h.path)
        except OSError as err:
            raise SidecarError(h.path, f"vanished while being read ({err.strerror or err})") from err
        shards.append(
            Shard(index=i, path=os.path.realpath(h.path), header=h, mtime_ns=st.st_mtime_ns, dev=st.st_dev,
                  ino=st.st_ino, rows=rows_per_shard[i] if rows_per_shard else 0)
        )
    sidecar = Sidecar(
        source=source,
        layout=layout.name if layout else layouts.GENERIC,
        shards=tuple(shards),
        rows=sum(rows_per_shard),
        row_width=width,
    )
    if os.path.isdir(source):
        meta = _read_meta(os.path.join(source, META), sidecar)
        digests = _read_digests(source, meta, {s.name for s in sidecar.shards})
        sidecar = Sidecar(**{**sidecar.__dict__, "meta": meta, "expected_digests": digests})
    return sidecar


def _detect_layout(headers: list[SafetensorsHeader]) -> layouts.Layout | None:
    found = None
    for h in headers:
        try:
            layout = layouts.detect({t.name for t in h.tensors})
        except ValueError as err:
            raise SidecarError(h.path, str(err)) from err
        if h is headers[0]:
            found = layout
        elif layout is not found:
            this = layout.name if layout else "no PLE layout"
            raise SidecarError(h.path, f"holds {this} but {os.path.basename(headers[0].path)} "
                                       f"holds {found.name if found else 'no PLE layout'}")
    return found


def _check_alike(headers: list[SafetensorsHeader]) -> None:
    def sig(h: SafetensorsHeader) -> dict:
        return {t.name: (t.dtype, t.shape[1:]) for t in h.tensors}

    first = sig(headers[0])
    for h in headers[1:]:
        this = sig(h)
        if set(this) != set(first):
            raise SidecarError(h.path, f"tensors {clip(sorted(this), 400)} differ from {clip(sorted(first), 400)} "
                                       f"in {os.path.basename(headers[0].path)}")
        for name, (dtype, trailing) in this.items():
            if (dtype, trailing) != first[name]:
                raise SidecarError(
                    h.path,
                    f"tensor {clip(name, 120)!r} is {dtype}[*, {', '.join(map(str, trailing))}] but "
                    f"{first[name][0]}[*, {', '.join(map(str, first[name][1]))}] "
                    f"in {os.path.basename(headers[0].path)}",
                )


def _read_meta(path: str, sidecar: Sidecar) -> dict:
    """META.json is optional; where present, what it says must match the shards (see sidecar_meta)."""
    if not os.path.lexists(path):
        return {}
    try:
        meta = load_json(read_bounded(path, MAX_META, "META.json"), max_bytes=MAX_META, max_values=MAX_META // 8)
    except BoundaryError as err:
        raise SidecarError(path, f"cannot be read as JSON ({err}); fix or remove it") from err
    if not isinstance(meta, dict):
        raise SidecarError(path, "is not a JSON object")
    sidecar_meta.check(path, meta, sidecar.layout, len(sidecar.shards), sidecar.rows, sidecar.row_width)
    return meta


_SUMS = {"B3SUMS": "blake3", "SHA256SUMS": "sha256"}
_FORMS = ", ".join(f'"{algo}:<{n} hex>"' for algo, n in HEX_LENGTH.items())


def _read_digests(directory: str, meta: dict, names: set[str]) -> dict:
    """Digests the sidecar ships: META.json's "digests" ({"shard_0.safetensors": "xxh3_128:<hex>"}, or blake3:,
    or sha256:) or a
    b3sum / sha256sum file beside the shards ("<hex>  shard_0.safetensors" per line)."""
    found: dict = {}
    where = os.path.join(directory, META)
    listed = meta.get("digests")
    if listed is not None:
        if not isinstance(listed, dict):
            raise SidecarError(where, f'"digests" must map shard file names to {_FORMS}')
        for name, value in listed.items():
            algo, _, hexdigest = str(value).partition(":")
            if not _is_hex(algo, hexdigest):
                raise SidecarError(where,
                                   f"digest of {clip(name, 80)} is {clip(value, 80)!r}; expected one of {_FORMS}")
            found[name] = (algo, hexdigest, where)
    for sums, algo in _SUMS.items():
        path = os.path.join(directory, sums)
        if not os.path.lexists(path):
            continue
        try:
            raw = read_bounded(path, MAX_SUMS, sums)
        except BoundaryError as err:
            raise SidecarError(path, f"{err}; fix or remove it") from err
        for name, hexdigest in parse_sums(path, algo, raw).items():
            found.setdefault(name, (algo, hexdigest, path))
    unknown = sorted(set(found) - names)
    if unknown:
        raise SidecarError(found[unknown[0]][2],
                           f"lists a digest for {clip(unknown[0], 80)}, which is not a shard of this table")
    return found


def parse_sums(path: str, algo: str, raw: bytes) -> dict[str, str]:
    """A b3sum or sha256sum file's lines ("<hex>  <file name>", "*" before a binary one's name): name -> hex;
    SidecarError names ``path`` and the line. One pass over the text."""
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise SidecarError(path, f"is not UTF-8 text ({err.reason}); fix or remove it") from err
    found: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        hexdigest, _, name = line.partition(" ")
        name = name.strip().lstrip("*")
        if not _is_hex(algo, hexdigest) or not name:
            raise SidecarError(path, f"line {number} is not '<hex>  <file name>'")
        found.setdefault(name, hexdigest)
    return found


def _is_hex(algo: str, text: str) -> bool:
    return algo in HEX_LENGTH and len(text) == HEX_LENGTH[algo] and all(c in "0123456789abcdef" for c in text)
