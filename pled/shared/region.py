"""The region format: one sealed memfd per table, self-describing.

    offset 0          64-byte prefix: magic "PLEDRGN\\0", format version (u32),
                      reserved (u32), data offset (u64), manifest length (u64),
                      sha256 of the manifest (32 bytes)
    offset 64         the manifest, JSON: table, layout, rows, shards (source
                      identity, offset, size, header fingerprint), tensors
                      (dtype, shape, absolute offset)
    data offset       shard 0, byte for byte as its file, at a 2 MiB boundary
    ...               shard i at the next 2 MiB boundary after shard i-1; the end at one too (hugetlb: a page's)

A region can be recognised and used from its own bytes alone, without its
source files. This module is shared by the daemon and its clients: it needs
nothing beyond the standard library.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import math
import mmap
import os
import stat
import struct
from dataclasses import asdict, dataclass, replace

from pled.shared import layouts
from pled.shared.boundary import clip, load_json
from pled.shared.digests import PLACEHOLDER as DIGEST_PLACEHOLDER
from pled.shared.errors import RegionError
from pled.shared.hugepages import PMD_SIZE

MAGIC = b"PLEDRGN\0"
FORMAT_VERSION = 1
ALIGN = PMD_SIZE  # shards start on a PMD huge-page boundary
_PREFIX = struct.Struct("<8sIIQQ32s")  # 64 bytes
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
# A region's manifest is read like any untrusted JSON (a client cannot trust the fd it was sent): at most this
# size (a generic table of 100,000 tensors needs about 15 MB) and this depth (the manifest, its shards or tensors
# list, one entry, a tensor's shape).
MAX_MANIFEST = 64 * 1024 * 1024
MANIFEST_DEPTH = 4
MAX_DIMS = 64  # more than any tensor has: a longer shape is refused before its size is worked out
_PAGED_SLACK = 20  # header bytes kept free for a longer region_bytes (Manifest.paged): a u64 has at most 20 digits
# The dtypes a region's tensors may have, bits per element: the safetensors format's. pled's sidecar reader stages
# exactly these (pled.daemon.safetensors_file uses this table), and a client refuses a region with any other.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "I64": 64, "U64": 64, "F64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


def align(n: int, unit: int = ALIGN) -> int:
    return -(-n // unit) * unit


@dataclass(frozen=True)
class ShardEntry:
    index: int
    path: str
    size: int
    mtime_ns: int
    dev: int
    ino: int
    fingerprint: str  # sha256 of the file's safetensors header
    offset: int  # in the region
    rows: int
    digest: str = ""  # "<digests.OWN>:<hex>" of the whole file's bytes, computed while staging


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shard: int
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, in the region
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    table: str
    layout: str
    rows: int
    row_width: int
    data_offset: int
    region_bytes: int
    fingerprint: str  # of the table's layout and headers: equal tables, equal fingerprints
    shards: tuple[ShardEntry, ...]
    tensors: tuple[TensorEntry, ...]
    format: int = FORMAT_VERSION

    @property
    def source_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def content_digest(self) -> str:
        """One digest of the table's content: of its shards' digests, in order ("" before staging)."""
        if not all(s.digest and s.digest != DIGEST_PLACEHOLDER for s in self.shards):
            return ""
        return "sha256:" + hashlib.sha256("\n".join(s.digest for s in self.shards).encode()).hexdigest()

    def identity(self) -> Manifest:
        """The manifest without content digests: what staging the same files would plan again."""
        return replace(self, shards=tuple(replace(s, digest="") for s in self.shards))

    def paged(self, page_size: int) -> Manifest:
        """This plan on ``page_size`` pages (hugetlb): the size rounded up to whole pages, all else as planned."""
        return replace(self, region_bytes=align(self.region_bytes, page_size)) if page_size > ALIGN else self

    def with_digests(self, digests: list[str]) -> Manifest:
        return replace(self, shards=tuple(replace(s, digest=d) for s, d in zip(self.shards, digests, strict=True)))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        """Parse and check a manifest from untrusted bytes; ValueError says what is wrong with it."""
        doc = _object_of(load_json(raw, max_bytes=MAX_MANIFEST, max_depth=MANIFEST_DEPTH), cls, "its top object")
        shards = [_object_of(s, ShardEntry, f"shard {i}") for i, s in enumerate(doc["shards"])]
        doc["shards"] = tuple(ShardEntry(**s) for s in shards)
        tensors = [_object_of(t, TensorEntry, f"tensor {i}") for i, t in enumerate(doc["tensors"])]
        doc["tensors"] = tuple(TensorEntry(**{**t, "shape": tuple(t["shape"])}) for t in tensors)
        manifest = cls(**doc)
        _check_geometry(manifest)
        return manifest


# each dataclass of the manifest: its fields' types (strings: annotations are postponed here), those without a default
_SCHEMAS = {cls: ({f.name: f.type for f in dataclasses.fields(cls)},
                  {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING})
            for cls in (Manifest, ShardEntry, TensorEntry)}


def _object_of(doc, cls, what: str) -> dict:
    """``doc`` if it is an object with exactly ``cls``'s fields (those with a default may be left out), each of its
    type: ints are ints (not booleans or floats), strings strings, tuples lists (of ints, for a shape)."""
    if type(doc) is not dict:
        raise ValueError(f"has {what} as {type(doc).__name__}, not an object")
    kinds, required = _SCHEMAS[cls]
    if not required <= doc.keys() <= kinds.keys():
        unknown = [k for k in doc if k not in kinds]
        if unknown:
            raise ValueError(f"has an unknown key {clip(unknown[0], 80)!r} in {what}")
        raise ValueError(f"has no {sorted(required - doc.keys())[0]!r} in {what}")
    for key, value in doc.items():
        kind = kinds[key]
        if kind == "int" or kind == "str":
            ok = type(value) is (int if kind == "int" else str)
        else:
            ok = type(value) is list and (kind != "tuple[int, ...]" or all(type(v) is int for v in value))
        if not ok:
            want = {"int": "an integer", "str": "a string", "tuple[int, ...]": "a list of integers"}.get(kind, "a list")
            raise ValueError(f"has {key} as {clip(json.dumps(value), 60)} in {what}, not {want}")
    return doc


def _check_geometry(m: Manifest) -> None:
    """Every shard and tensor lies inside the region, in order and without overlap; every tensor's dtype is known
    and its size is its shape's; a PLE table's shards hold its layout's tensors with the rows and width it says."""
    if m.format != FORMAT_VERSION:
        raise ValueError(f"is of format {m.format}; this pled reads format {FORMAT_VERSION}")
    if min(m.rows, m.row_width) < 0 or not _PREFIX.size <= m.data_offset <= m.region_bytes:
        raise ValueError(f"gives rows {m.rows}, width {m.row_width}, data at {m.data_offset} of {m.region_bytes} bytes")
    end = m.data_offset
    for i, s in enumerate(m.shards):
        if s.index != i or s.rows < 0 or s.size < 0 or s.offset < end or s.offset + s.size > m.region_bytes:
            raise ValueError(f"places shard {s.index} ({s.size} bytes, {s.rows} rows) at {s.offset}, outside bytes "
                             f"{end}..{m.region_bytes} of the region (after the header and the shards before it)")
        end = s.offset + s.size
    seen: dict[int, dict[str, TensorEntry]] = {i: {} for i in range(len(m.shards))}
    for t in m.tensors:
        if t.shard not in seen:
            raise ValueError(f"puts tensor {clip(t.name, 80)!r} in shard {t.shard}; there are {len(m.shards)} shards")
        if t.name in seen[t.shard]:
            raise ValueError(f"lists tensor {clip(t.name, 80)!r} of shard {t.shard} twice")
        seen[t.shard][t.name] = t
        bits = DTYPE_BITS.get(t.dtype)
        if bits is None:
            raise ValueError(f"gives tensor {clip(t.name, 80)!r} an unknown dtype {clip(t.dtype, 40)!r} "
                             f"(known: {', '.join(DTYPE_BITS)})")
        if len(t.shape) > MAX_DIMS:
            raise ValueError(f"gives tensor {clip(t.name, 80)!r} {len(t.shape)} dimensions; at most {MAX_DIMS} are "
                             "accepted")
        if math.prod(t.shape) * bits != 8 * t.nbytes:
            raise ValueError(f"gives tensor {clip(t.name, 80)!r} {t.nbytes} bytes ({8 * t.nbytes} bits), but "
                             f"{t.dtype}{list(t.shape)} is {math.prod(t.shape) * bits} bits")
        s = m.shards[t.shard]
        if t.offset < s.offset or t.offset + t.nbytes > s.offset + s.size:
            raise ValueError(f"places tensor {clip(t.name, 80)!r} at bytes {t.offset}..{t.offset + t.nbytes}, outside "
                             f"its shard {t.shard} (bytes {s.offset}..{s.offset + s.size} of {m.region_bytes})")
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


def plan(table: str, sidecar) -> Manifest:
    """Where each shard and tensor of a pled.daemon.sidecar.Sidecar will sit; the region's exact size."""
    fingerprint = hashlib.sha256(
        json.dumps([sidecar.layout, [(s.size, s.header.fingerprint) for s in sidecar.shards]]).encode()
    ).hexdigest()
    data_offset = ALIGN
    while True:  # the manifest records offsets that depend on its own size: grow until it fits
        shards, tensors, offset = [], [], data_offset
        for s in sidecar.shards:
            shards.append(ShardEntry(s.index, s.path, s.size, s.mtime_ns, s.dev, s.ino, s.header.fingerprint, offset,
                                     s.rows, DIGEST_PLACEHOLDER))
            for t in s.header.tensors:
                tensors.append(TensorEntry(t.name, s.index, t.dtype, t.shape, offset + t.begin, t.nbytes))
            offset = align(offset + s.size)
        manifest = Manifest(table, sidecar.layout, sidecar.rows, sidecar.row_width, data_offset, offset,
                            fingerprint, tuple(shards), tuple(tensors))
        if _PREFIX.size + len(manifest.to_json()) + _PAGED_SLACK <= data_offset:
            return manifest
        data_offset = align(_PREFIX.size + len(manifest.to_json()) + _PAGED_SLACK)


def encode_header(manifest: Manifest) -> bytes:
    raw = manifest.to_json()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, manifest.data_offset, len(raw), hashlib.sha256(raw).digest()) + raw


_parsed: dict[bytes, Manifest] = {}  # sha256 of a manifest -> the manifest: parsing is the slow part of attaching


def read_manifest(fd: int) -> Manifest:
    """The manifest of the region behind ``fd``, checked against the fd's real size, parsed within bounds and
    checked (``Manifest.from_json``): RegionError says what is wrong. Parsed once a process per manifest."""
    size = os.fstat(fd).st_size
    prefix = os.pread(fd, _PREFIX.size, 0)
    if len(prefix) < _PREFIX.size:
        raise RegionError(f"fd {fd} is not a pled region: {size} bytes, too short for a header")
    magic, version, _, data_offset, length, digest = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise RegionError(f"fd {fd} is not a pled region (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise RegionError(f"fd {fd} is a pled region of format {version}; this pled reads format {FORMAT_VERSION}")
    if _PREFIX.size + length > data_offset or data_offset > size or length > MAX_MANIFEST:
        raise RegionError(f"fd {fd}: region header claims {length} bytes of manifest and data at {data_offset} in a "
                          f"{size}-byte region (a manifest may have at most {MAX_MANIFEST} bytes)")
    raw = os.pread(fd, length, _PREFIX.size)
    if hashlib.sha256(raw).digest() != digest:
        raise RegionError(f"fd {fd}: region manifest does not match its checksum")
    manifest = _parsed.get(digest)
    if manifest is None:  # the same bytes always parse to the same manifest (frozen): parse and check once a process
        try:
            manifest = Manifest.from_json(raw)
        except ValueError as err:  # BoundaryError is one; the checks above raise it with what is wrong
            raise RegionError(f"fd {fd}: the region's manifest {err}") from None
        _parsed[digest] = manifest
        if len(_parsed) > 64:
            _parsed.pop(next(iter(_parsed)))
    if manifest.region_bytes != size or manifest.data_offset != data_offset:
        raise RegionError(f"fd {fd}: manifest says {manifest.region_bytes} bytes with data at {manifest.data_offset}, "
                          f"but the region has {size} and its header puts the data at {data_offset}")
    return manifest


def seals(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS)


def is_sealed(fd: int) -> bool:
    return seals(fd) & SEALS == SEALS


def check_sealed_memfd(fd: int) -> None:
    """Refuse an fd that is not a memfd with all four ``SEALS``; RegionError says what it is instead. Check this
    before reading the region: once sealed, nothing read can change (WRITE) or vanish under a mapping (SHRINK).

    The test is the seals, not the fd's name in /proc/self/fd ("/memfd:..."), which needs /proc and which a file
    at /memfd:x on disk has too. F_GET_SEALS fails with EINVAL on every file that cannot be sealed (on disk, a
    pipe, a socket); tmpfs and hugetlbfs files opened by path can, but are born with F_SEAL_SEAL and never gain
    another seal. So all four seals together mean a memfd made with MFD_ALLOW_SEALING and sealed by its maker."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise RegionError(f"fd {fd} is not a memfd: not a regular file (type {stat.S_IFMT(mode):#o})")
    try:
        have = seals(fd)
    except OSError as err:
        why = "a file that cannot be sealed, such as one on disk" if err.errno == errno.EINVAL else err.strerror
        raise RegionError(f"fd {fd} is not a memfd: F_GET_SEALS fails ({why})") from err
    if have & SEALS != SEALS:
        raise RegionError(f"fd {fd} is not sealed "
                          f"(seals {have:#x}; a region has {SEALS:#x}: shrink, grow, write, seal)")


def map_readonly(fd: int) -> mmap.mmap:
    """A shared, read-only mapping of the whole region: the same pages every client sees."""
    return mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)


class Region:
    """Owns one staged table's memfd. ``close()`` drops this handle and is safe to repeat."""

    _fd = -1

    def __init__(self, fd: int, manifest: Manifest, stats=None) -> None:
        self._fd = fd
        self.manifest = manifest
        self.stats = stats  # pled.daemon.staging.StageStats where this process staged it; None where it was adopted

    @property
    def fd(self) -> int:
        if self._fd < 0:
            raise ValueError(f"region of table {self.manifest.table} is closed")
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def release(self) -> int:
        """Give up ownership: return the fd, which the caller must now close."""
        fd, self._fd = self._fd, -1
        return fd

    def close(self, _close=os.close) -> None:
        # os.close is bound here, not looked up: at interpreter exit __del__ may run after this module's
        # globals are gone.
        fd = self.release()
        if fd >= 0:
            _close(fd)

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
