"""A table's source files: found, ordered, validated, described.

A table is either a sidecar directory (``shard_N.safetensors`` plus an optional
``META.json``) or a glob of ``.safetensors`` files, such as a checkpoint's own
``model-00001-of-00004.safetensors``. Everything here reads headers only; the
bytes a table needs are the sum of its files, never an estimate.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from pled.daemon.sources import sidecar_meta
from pled.daemon.sources.naming import find_files, numbered, numbered_of, odd_one_out
from pled.daemon.sources.safetensors_file import SafetensorsHeader, read_header
from pled.shared import layouts
from pled.shared.boundary import BoundaryError, clip, load_json, read_bounded
from pled.shared.digests import HEX_LENGTH
from pled.shared.errors import SidecarError

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


def open_table(source: str) -> Sidecar:
    """Find, read and validate every file of a table; SidecarError names the file and the fault."""
    files = find_files(source)
    headers = [read_header(f) for f in files]
    layout = _detect_layout(headers)
    rows_per_shard: list[int] = []
    width = 0
    if layout is not None:
        widths = []
        for h in headers:
            try:
                rows, w = layouts.rows_and_width(
                    layout, {t.name: t.shape for t in h.tensors}, {t.name: t.dtype for t in h.tensors}
                )
            except ValueError as err:
                raise SidecarError(h.path, str(err)) from err
            widths.append(w)
            rows_per_shard.append(rows)
        disagree = odd_one_out(widths)
        if disagree is not None:
            odd, other = disagree
            raise SidecarError(headers[odd].path, f"row width {widths[odd]} differs from {widths[other]} in the "
                                                  f"table's other shards (as in "
                                                  f"{os.path.basename(headers[other].path)})")
        width = widths[0] if widths else 0
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
    """The layout every shard holds; a shard that holds another than the table's other shards is refused, named."""
    found = []
    for h in headers:
        try:
            found.append(layouts.detect({t.name for t in h.tensors}))
        except ValueError as err:
            raise SidecarError(h.path, str(err)) from err
    names = [layout.name if layout else "no PLE layout" for layout in found]
    disagree = odd_one_out(names)
    if disagree is not None:
        odd, other = disagree
        this, that = names[odd], names[other]
        raise SidecarError(headers[odd].path, f"holds {this} but {os.path.basename(headers[other].path)} "
                                              f"holds {that}, as the table's other shards do")
    return found[0] if found else None


def _check_alike(headers: list[SafetensorsHeader]) -> None:
    """Shards of one unknown layout must agree with each other: the same tensor names, each of one dtype and one
    width in every shard. The shard refused is the one that disagrees with most of the others."""
    def sig(h: SafetensorsHeader) -> dict:
        return {t.name: (t.dtype, t.shape[1:]) for t in h.tensors}

    sigs = [sig(h) for h in headers]
    disagree = odd_one_out([frozenset(s) for s in sigs])
    if disagree is not None:
        odd, other = disagree
        raise SidecarError(headers[odd].path, f"tensors {clip(sorted(sigs[odd]), 400)} differ from the table's other "
                                              f"shards' {clip(sorted(sigs[other]), 400)} (as in "
                                              f"{os.path.basename(headers[other].path)})")
    for name in sigs[0]:
        disagree = odd_one_out([s[name] for s in sigs])
        if disagree is not None:
            odd, other = disagree
            (dtype, trailing), (want, wanted) = sigs[odd][name], sigs[other][name]
            raise SidecarError(
                headers[odd].path,
                f"tensor {clip(name, 120)!r} is {dtype}[*, {', '.join(map(str, trailing))}] but "
                f"{want}[*, {', '.join(map(str, wanted))}] in the table's other shards (as in "
                f"{os.path.basename(headers[other].path)})",
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
