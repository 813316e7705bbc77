"""The region format: one sealed memfd per table, self-describing.

    offset 0          64-byte prefix: magic "PLEDRGN\\0", format version (u32),
                      reserved (u32), data offset (u64), manifest length (u64),
                      sha256 of the manifest (32 bytes)
    offset 64         the manifest, JSON: table, layout, rows, shards (source
                      identity, offset, size, header fingerprint), tensors
                      (dtype, shape, absolute offset)
    data offset       shard 0, byte for byte as its file, at a 2 MiB boundary
    ...               shard i at the next 2 MiB boundary after shard i-1

A region can be recognised and used from its own bytes alone, without its
source files. This module is shared by the daemon and its clients: it needs
nothing beyond the standard library.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import struct
from dataclasses import asdict, dataclass, replace

from pled.shared.digests import PLACEHOLDER as DIGEST_PLACEHOLDER
from pled.shared.errors import RegionError
from pled.shared.hugepages import PMD_SIZE

MAGIC = b"PLEDRGN\0"
FORMAT_VERSION = 1
ALIGN = PMD_SIZE  # shards start on a PMD huge-page boundary
_PREFIX = struct.Struct("<8sIIQQ32s")  # 64 bytes
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


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

    def identity(self) -> "Manifest":
        """The manifest without content digests: what staging the same files would plan again."""
        return replace(self, shards=tuple(replace(s, digest="") for s in self.shards))

    def with_digests(self, digests: list[str]) -> "Manifest":
        return replace(self, shards=tuple(replace(s, digest=d) for s, d in zip(self.shards, digests)))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Manifest":
        doc = json.loads(raw)
        doc["shards"] = tuple(ShardEntry(**s) for s in doc["shards"])
        doc["tensors"] = tuple(TensorEntry(**{**t, "shape": tuple(t["shape"])}) for t in doc["tensors"])
        return cls(**doc)


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
        if _PREFIX.size + len(manifest.to_json()) <= data_offset:
            return manifest
        data_offset = align(_PREFIX.size + len(manifest.to_json()))


def encode_header(manifest: Manifest) -> bytes:
    raw = manifest.to_json()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, manifest.data_offset, len(raw), hashlib.sha256(raw).digest()) + raw


_parsed: dict[bytes, Manifest] = {}  # sha256 of a manifest -> the manifest: parsing is the slow part of attaching


def read_manifest(fd: int) -> Manifest:
    """The manifest of the region behind ``fd``, checked against the fd's real size."""
    size = os.fstat(fd).st_size
    prefix = os.pread(fd, _PREFIX.size, 0)
    if len(prefix) < _PREFIX.size:
        raise RegionError(f"fd {fd} is not a pled region: {size} bytes, too short for a header")
    magic, version, _, data_offset, length, digest = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise RegionError(f"fd {fd} is not a pled region (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise RegionError(f"fd {fd} is a pled region of format {version}; this pled reads format {FORMAT_VERSION}")
    if _PREFIX.size + length > data_offset or data_offset > size:
        raise RegionError(f"fd {fd}: region header claims {length} bytes of manifest in a {size}-byte region")
    raw = os.pread(fd, length, _PREFIX.size)
    if hashlib.sha256(raw).digest() != digest:
        raise RegionError(f"fd {fd}: region manifest does not match its checksum")
    manifest = _parsed.get(digest)
    if manifest is None:  # the same bytes always parse to the same manifest (frozen): parse once a process
        manifest = _parsed[digest] = Manifest.from_json(raw)
        if len(_parsed) > 64:
            _parsed.pop(next(iter(_parsed)))
    if manifest.region_bytes != size:
        raise RegionError(f"fd {fd}: manifest says {manifest.region_bytes} bytes but the region has {size}")
    return manifest


def seals(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS)


def is_sealed(fd: int) -> bool:
    return seals(fd) & SEALS == SEALS


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

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
