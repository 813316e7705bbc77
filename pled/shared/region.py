"""The region format: one sealed memfd per table, self-describing.

    offset 0          64-byte prefix: magic "PLEDRGN\\0", format version (u32),
                      reserved (u32), data offset (u64), manifest length (u64),
                      sha256 of the manifest (32 bytes)
    offset 64         the manifest, JSON: table, layout, rows, shards (source
                      identity, offset, size, header fingerprint), tensors
                      (dtype, shape, absolute offset); the arrays form also arrays
    data offset       shard 0, byte for byte as its file, at a 2 MiB boundary
    ...               shard i at the next 2 MiB boundary after shard i-1; the end at one too (hugetlb: a page's)

The arrays form (pled.shared.arrays: a model checkpoint's PLE tables for vLLM 0.33) places arrays assembled from
tensors instead of files; everything else (prefix, sealing, digests) is the same.

A region can be recognised and used from its own bytes alone, without its
source files. This module is shared by the daemon and its clients: it needs
nothing beyond the standard library.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, fields, replace
from functools import cached_property

from pled.shared import arrays as arrays_form, region_geometry
from pled.shared.arrays import ArrayEntry
from pled.shared.boundary import load_json
from pled.shared.digests import PLACEHOLDER as DIGEST_PLACEHOLDER
from pled.shared.errors import RegionError
from pled.shared.hugepages import PMD_SIZE
from pled.shared.memfd import (
    SEALS,
    WRITABLE_MODE,
    WRITABLE_SEALS,
    Region,
    check_sealed_memfd,
    is_sealed,
    map_readonly,
    seals,
)
from pled.shared.records import fields_of
from pled.shared.tensors import DTYPE_BITS, MAX_DIMS

MAGIC = b"PLEDRGN\0"
FORMAT_VERSION = 1
ALIGN = PMD_SIZE  # shards start on a PMD huge-page boundary
_PREFIX = struct.Struct("<8sIIQQ32s")  # 64 bytes
# A region's manifest is read like any untrusted JSON (a client cannot trust the fd it was sent): at most this
# size (a generic table of 100,000 tensors needs about 15 MB) and this depth (the manifest, its shards or tensors
# list, one entry, a tensor's shape).
MAX_MANIFEST = 64 * 1024 * 1024
MANIFEST_DEPTH = 4  # the manifest, its shards, tensors or arrays list, one entry, a shape or a column
MANIFEST_VALUES = 2_000_000  # ~10 a tensor: 200,000 tensors (json.loads of that many empty lists: ~0.5 s)
_PAGED_SLACK = 20  # header bytes kept free for a longer region_bytes (Manifest.paged): a u64 has at most 20 digits
# Re-exported: the dtypes and rank a region's tensors may have (pled.shared.tensors), and the sealed memfd a region
# lives in (pled.shared.memfd), as the daemon and the clients have always found them here.
__all__ = ["DTYPE_BITS", "MAX_DIMS", "SEALS", "WRITABLE_MODE", "WRITABLE_SEALS",
           "Region", "check_sealed_memfd", "is_sealed", "map_readonly", "seals"]


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
class Piece:
    """A byte range staging copies from a source file into the region, and verify compares: a sidecar's whole
    shard, or one tensor of a checkpoint (the arrays form)."""

    file: int  # index in the manifest's shards
    begin: int  # in the file
    nbytes: int
    offset: int  # in the region
    name: str  # the file's base name, or the tensor's name
    digest: str


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
    arrays: tuple[ArrayEntry, ...] = ()  # the arrays form (pled.shared.arrays); written only where there are some

    @property
    def form(self) -> str:
        """"files" (a sidecar or a glob: each file byte for byte) or "arrays" (a checkpoint's PLE tables)."""
        return "arrays" if self.arrays else "files"

    def pieces(self) -> tuple[Piece, ...]:
        """What staging copies, in the order it copies them (file by file, each front to back). Worked out once a
        manifest (it is frozen): Status and each loop turn while staging ask for its sums."""
        return self._pieces

    @cached_property
    def _pieces(self) -> tuple[Piece, ...]:
        if not self.arrays:
            return tuple(Piece(s.index, 0, s.size, s.offset, os.path.basename(s.path), s.digest) for s in self.shards)
        out = [Piece(t.shard, src.begin, t.nbytes, t.offset, t.name, src.digest)
               for a in self.arrays for src in a.sources for t in (self.tensors[src.tensor],)]
        return tuple(sorted(out, key=lambda p: (p.file, p.begin)))

    @cached_property
    def source_bytes(self) -> int:
        """Bytes copied from the sources: the files, or the arrays' tensors."""
        return sum(p.nbytes for p in self.pieces()) if self.arrays else sum(s.size for s in self.shards)

    @cached_property
    def content_digest(self) -> str:
        """One digest of the table's content: of its pieces' digests, in order ("" before staging)."""
        digests = [p.digest for p in self.pieces()]
        if not all(d and d != DIGEST_PLACEHOLDER for d in digests):
            return ""
        return "sha256:" + hashlib.sha256("\n".join(digests).encode()).hexdigest()

    def identity(self) -> Manifest:
        """The manifest without content digests: what staging the same files would plan again."""
        return self.with_digests([""] * len(self.pieces()))

    def paged(self, page_size: int) -> Manifest:
        """This plan on ``page_size`` pages (hugetlb): the size rounded up to whole pages, all else as planned."""
        return replace(self, region_bytes=align(self.region_bytes, page_size)) if page_size > ALIGN else self

    def with_digests(self, digests: list[str]) -> Manifest:
        """This manifest with each piece's digest (in ``pieces()`` order)."""
        if not self.arrays:
            return replace(self, shards=tuple(replace(s, digest=d) for s, d in zip(self.shards, digests, strict=True)))
        order = sorted(((self.tensors[src.tensor].shard, src.begin), i, j)
                       for i, a in enumerate(self.arrays) for j, src in enumerate(a.sources))
        new = [list(a.digests) for a in self.arrays]
        for (_, i, j), d in zip(order, digests, strict=True):
            new[i][j] = d
        return replace(self, arrays=tuple(replace(a, digests=tuple(n)) for a, n in zip(self.arrays, new, strict=True)))

    def to_json(self) -> bytes:
        doc = _fields(self)
        if not self.arrays:  # a sidecar's manifest is exactly what it was before the arrays form
            del doc["arrays"]
        return json.dumps(doc, separators=(",", ":"), sort_keys=True, default=_fields).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        """Parse and check a manifest from untrusted bytes; ValueError says what is wrong with it."""
        doc = fields_of(load_json(raw, max_bytes=MAX_MANIFEST, max_depth=MANIFEST_DEPTH,
                                    max_values=MANIFEST_VALUES), cls, "its top object")
        shards = [fields_of(s, ShardEntry, f"shard {i}") for i, s in enumerate(doc["shards"])]
        doc["shards"] = tuple(ShardEntry(**s) for s in shards)
        tensors = [fields_of(t, TensorEntry, f"tensor {i}") for i, t in enumerate(doc["tensors"])]
        doc["tensors"] = tuple(TensorEntry(**{**t, "shape": tuple(t["shape"])}) for t in tensors)
        if "arrays" in doc:
            doc["arrays"] = arrays_form.parse(doc["arrays"])
        manifest = cls(**doc)
        if manifest.data_offset < _PREFIX.size + len(raw):
            raise ValueError(f"puts the data at byte {manifest.data_offset}, over the header's {_PREFIX.size} bytes "
                             f"and the manifest's {len(raw)}")
        _check_geometry(manifest)
        return manifest


def _fields(record) -> dict:
    """A manifest record's fields, for json.dumps (dataclasses.asdict deep-copies every value: 10x slower)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


def _check_geometry(m: Manifest) -> None:
    region_geometry.check_geometry(m, FORMAT_VERSION, _PREFIX.size)


def check(manifest: Manifest) -> None:
    """The checks every client makes of a region's manifest (the geometry of ``Manifest.from_json``), for the daemon
    to make of its own plan: ValueError says what a client would refuse."""
    _check_geometry(manifest)


def plan(table: str, source) -> Manifest:
    """Where each shard and tensor of a pled.daemon.sources.sidecar.Sidecar (or each array of a
    pled.daemon.sources.checkpoint.Checkpoint) will sit; the region's exact size."""
    arrays = source.arrays
    identity: list = [source.layout, [(s.size, s.header.fingerprint) for s in source.shards]]
    if arrays:
        identity.append([(a.prefix, a.param, [(f, t.name) for f, t in a.tensors]) for a in source.arrays])
    fingerprint = hashlib.sha256(json.dumps(identity).encode()).hexdigest()
    data_offset = ALIGN
    while True:  # the manifest records offsets that depend on its own size: grow until it fits
        if arrays:
            files = [ShardEntry(s.index, s.path, s.size, s.mtime_ns, s.dev, s.ino, s.header.fingerprint, 0, 0)
                     for s in source.shards]
            tensors, entries, offset = arrays_form.place(source, data_offset, TensorEntry, DIGEST_PLACEHOLDER)
            manifest = Manifest(table, source.layout, 0, 0, data_offset, offset, fingerprint, tuple(files),
                                tuple(tensors), arrays=entries)
        else:
            manifest = _place_files(table, source, data_offset, fingerprint)
        if _PREFIX.size + len(manifest.to_json()) + _PAGED_SLACK <= data_offset:
            return manifest
        data_offset = align(_PREFIX.size + len(manifest.to_json()) + _PAGED_SLACK)


def _place_files(table: str, sidecar, data_offset: int, fingerprint: str) -> Manifest:
    shards, tensors, offset = [], [], data_offset
    for s in sidecar.shards:
        shards.append(ShardEntry(s.index, s.path, s.size, s.mtime_ns, s.dev, s.ino, s.header.fingerprint, offset,
                                 s.rows, DIGEST_PLACEHOLDER))
        for t in s.header.tensors:
            tensors.append(TensorEntry(t.name, s.index, t.dtype, t.shape, offset + t.begin, t.nbytes))
        offset = align(offset + s.size)
    return Manifest(table, sidecar.layout, sidecar.rows, sidecar.row_width, data_offset, offset,
                    fingerprint, tuple(shards), tuple(tensors))


def encode_header(manifest: Manifest) -> bytes:
    raw = manifest.to_json()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, manifest.data_offset, len(raw), hashlib.sha256(raw).digest()) + raw


_parsed: dict[bytes, Manifest] = {}  # sha256 of a manifest -> the manifest: parsing is the slow part of attaching


def staged_manifest_sha256(header: bytes) -> str:
    """The manifest's sha256 (hex) that a region's header, as ``encode_header`` made it, records."""
    return _PREFIX.unpack_from(header)[5].hex()


def read_manifest(fd: int, expect_sha256: bytes | None = None) -> Manifest:
    """The manifest of the region behind ``fd``, checked against the fd's real size, parsed within bounds and
    checked (``Manifest.from_json``): RegionError says what is wrong. Parsed once a process per manifest.
    ``expect_sha256``: the manifest's sha256 as pled staged it (a writable table's Attach reply says it: its writers
    can write the header too); a header that records another is refused before anything of it is parsed."""
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
    if expect_sha256 is not None and digest != expect_sha256:
        raise RegionError(f"fd {fd}: the region's header is not the one pled staged: a writer of this writable table "
                          "changed it (its manifest, with every path and place, is not taken); `pled verify --repair` "
                          "stages a clean generation")
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
