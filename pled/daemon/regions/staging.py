"""Copy a table's files into one sealed, shared, anonymous memfd, one shard at a time.

Every byte is copied once, straight from the page cache into the region, never
through a second buffer; the pages each chunk brought into the page cache are dropped as
soon as it is copied, so the transient page cache is a chunk or two, not a table. When every
shard is in, every writable mapping is gone and the memfd is sealed against
shrinking, growing and writing: no client can ever change the table.

The memfd is made on the pages and NUMA nodes planned for the table (regionfd.py). A hugetlb one has no
write path: the whole region, header included, is filled through a writable mapping, and hashed from it.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pled.daemon.memory.pageplan import PagePlan, human
from pled.daemon.regions import regionfd
from pled.daemon.regions.pacer import CHUNK, Pacer
from pled.daemon.sources.checkpoint import Source
from pled.daemon.sources.sidecar import Shard
from pled.shared import hugepages, region
from pled.shared.boundary import BoundaryError, open_regular
from pled.shared.digests import OWN, new_hasher
from pled.shared.dropbehind import DropBehind
from pled.shared.errors import EX_OK, PledError, SidecarError, StagingError
from pled.shared.layouts import LAYOUTS
from pled.shared.pagecache import mapping_address
from pled.shared.region import Manifest, Piece, Region
from pled.shared.sizes import gib, rate

log = logging.getLogger(__name__)

SENDFILE = "sendfile"  # kernel copy, page cache -> shmem: fastest with 4 KiB pages
FAULT = "fault"  # read() into a MADV_HUGEPAGE mapping: page faults are what allocate huge pages
HUGETLB = "hugetlb"  # read() into a mapping of reserved huge pages, every one allocated beforehand


class StagingCancelled(PledError):
    """Staging stopped on request (SIGTERM); nothing is wrong."""

    exit_status = EX_OK


@dataclass(frozen=True)
class FillPlan:
    method: str
    policy: str  # what the kernel allows, for logs and status: "advise", "never", "off (config)", ...
    note: str  # one sentence for the log when the table cannot get huge pages, else ""


def plan_fill(huge_pages: str, policy: hugepages.ShmemPolicy | None) -> FillPlan:
    if huge_pages == "off":
        return FillPlan(SENDFILE, "off (config)", "huge_pages = \"off\" in the config: the table uses 4 KiB pages")
    if policy is None:
        return FillPlan(SENDFILE, "unsupported",
                        "this kernel has no transparent huge pages: the table uses 4 KiB pages")
    if not policy.allows_huge:
        return FillPlan(
            SENDFILE, policy.effective,
            f"shmem_enabled is {policy.effective}: the table uses 4 KiB pages; to enable huge pages for shared memory: "
            f"{hugepages.ENABLE_HINT}",
        )
    # advise needs MADV_HUGEPAGE on a mapping and faults through it (sendfile gets none there);
    # under always/within_size faults get them too, so one path serves every mode that allows them.
    return FillPlan(FAULT, policy.effective, "")


def _plan_fill_from(huge_pages: str, sys_root: str) -> FillPlan:
    if huge_pages == "off":
        return plan_fill(huge_pages, None)
    try:
        return plan_fill(huge_pages, hugepages.read_policy(sys_root))
    except hugepages.PolicyUnreadable as err:
        return FillPlan(SENDFILE, "unreadable", f"cannot read {err.filename} ({err.strerror}): the table uses 4 KiB "
                                                 "pages; let pled's user read it, or set huge_pages = \"off\"")


@dataclass(frozen=True)
class StageStats:
    seconds: float
    huge_bytes: int  # bytes of the region backed by huge pages: as mapped while filling (THP), or all (hugetlb)
    fill: FillPlan
    pages: PagePlan | None = None  # the pages it was staged on (a prefer-hugetlb table's fallback included)

    @property
    def page_size(self) -> int:
        """The hugetlb page size; 0 on shared memory."""
        return self.pages.page_size if self.pages else 0

    @property
    def numa(self) -> str:
        """The NUMA policy its pages were placed by, as numa_maps writes it; "" where none was applied."""
        return self.pages.numa.label if self.pages and not self.pages.numa.refused else ""


def _copy_file(shard: Shard, pieces: list[Piece], fd: int, view: memoryview | None, pacer: Pacer, table: str) -> None:
    """Copy ``pieces`` of one source file (the whole of a sidecar's shard, or a checkpoint's PLE tensors) to their
    places in the region, in the file's order, dropping behind the copy, chunk by chunk, the pages it brought into
    the page cache (dropbehind.py: a sidecar's every page; of a checkpoint, only what pled brought in); the file
    checked unchanged before and after. The page cache is charged to pled's cgroup: never a table's worth of it."""
    try:
        src = open_regular(shard.path)  # a FIFO or device put in its place since validation is never opened
    except BoundaryError as err:
        raise StagingError(table, f"cannot stage {shard.path}: {err}; nothing of it is served") from err
    try:
        _check_unchanged(src, shard, table)
        whole = len(pieces) == 1 and pieces[0].begin == 0 and pieces[0].nbytes == shard.size
        pieces = sorted(pieces, key=lambda p: p.begin)
        behind = DropBehind(src, [(p.begin, p.begin + p.nbytes) for p in pieces], shard.path, everything=whole)
        try:
            for piece in pieces:
                _copy_piece(src, shard, piece, fd, view, pacer, table, behind)
        finally:
            behind.close()
        _check_unchanged(src, shard, table)
        # A whole file's header is checked as copied; a checkpoint's (not copied) as the file has it now.
        header = (os.pread(fd, shard.header.header_len, pieces[0].offset + 8) if whole
                  else os.pread(src, shard.header.header_len, 8))
    except OSError as err:
        raise StagingError(table, f"reading {shard.path} failed ({err.strerror or err})") from err
    finally:
        os.close(src)
    if hashlib.sha256(header).hexdigest() != shard.header.fingerprint:
        raise StagingError(table, f"{shard.path} changed while staging (its header differs from the one validated)")


def _copy_piece(src: int, shard: Shard, piece: Piece, fd: int, view: memoryview | None, pacer: Pacer,
                table: str, behind: DropBehind) -> None:
    if view is None:
        os.lseek(fd, piece.offset, os.SEEK_SET)
    done = 0
    while done < piece.nbytes:
        if pacer.should_stop():
            raise StagingCancelled(f"staging of table {table} cancelled at {shard.name}")
        want = min(pacer.chunk, piece.nbytes - done)
        at = piece.begin + done
        try:
            if view is None:
                got = os.sendfile(fd, src, at, want)
            else:
                got = os.preadv(src, [view[piece.offset + done: piece.offset + done + want]], at)
        except OSError as err:
            raise StagingError(table, f"reading {shard.path} failed at offset {at} of {shard.size}: "
                                      f"{err.strerror}; check the disk (dmesg) or copy the table's files "
                                      "elsewhere") from err
        if got == 0:
            raise StagingError(table, f"{shard.path} ended at byte {at} of {shard.size}: it was truncated while "
                                      "staging")
        behind.read(at, at + got)
        done += got
        pacer.account(got)


def _check_unchanged(src: int, shard: Shard, table: str) -> None:
    st = os.fstat(src)  # an open fd's file type cannot change: open_regular saw a regular file
    if st.st_size != shard.size or st.st_mtime_ns != shard.mtime_ns:
        what = f"size {st.st_size}, was {shard.size}" if st.st_size != shard.size else "modified"
        raise StagingError(
            table, f"{shard.path} changed while pled was staging it ({what}); nothing of it is served: "
                   "start pled again once the sidecar is completely written"
        )


def stage(
    table: str,
    sidecar: Source,
    *,
    planned: Manifest | None = None,
    huge_pages: str = "auto",
    sys_root: str = "/",
    on_shard: Callable[[Shard, int, float], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    bandwidth: int | None = None,
    digests: bool = True,
    chunk: int = CHUNK,
    pages: PagePlan | None = None,
    writable: bool = False,
) -> Region:
    """Stage ``sidecar`` (or a checkpoint's PLE tables) into a new sealed memfd; the caller owns the returned Region.
    ``planned``: the region's plan (the daemon's, made once by planning.py); planned here when not given.
    ``pages``: the pages and NUMA policy decided for it (pageplan.py); without one, shared memory as
    ``huge_pages`` says and no NUMA policy. ``digests=False`` skips hashing (the benchmark's baseline for what
    hashing costs). ``chunk``: bytes copied (and dropped from the page cache) at a time; ``should_stop`` is asked
    before each chunk. ``writable`` (gpu_access = "writable"): sealed against all but writing, its inode 0440.
    """
    planned = region.plan(table, sidecar) if planned is None else planned
    fd, pages = regionfd.create(table, planned.region_bytes, pages)
    try:
        fill = (FillPlan(HUGETLB, f"hugetlb {human(pages.page_size)}", "") if pages and pages.hugetlb
                else _plan_fill_from(pages.shmem_mode if pages else huge_pages, sys_root))
        start = time.perf_counter()
        manifest, huge_bytes = _fill(fd, planned, sidecar, fill, on_shard, Pacer(bandwidth, should_stop, chunk), table,
                                     digests)
        seconds = time.perf_counter() - start
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, region.WRITABLE_SEALS if writable else region.SEALS)
        # a client cannot reopen it writable through /proc either (the seals hold regardless); a writable table's
        # inode is not even readable by others: pled hands each non-writer a read-only fd it reopened itself
        os.fchmod(fd, region.WRITABLE_MODE if writable else 0o444)
    except BaseException:
        os.close(fd)  # a half-built region frees its memory with its last fd
        raise
    return Region(fd, manifest, StageStats(seconds, huge_bytes, fill, pages))


_HASH_CHUNK = 4 * 1024 * 1024


def _digests(fd: int, offset: int, size: int, shipped: str | None,
             mapped: memoryview | None = None) -> tuple[str, str | None]:
    """Digest a shard's bytes in the region, read with pread in chunks: a mapping would cost a page fault
    per 4 KiB page, which contends with the copy still writing the same memfd. A hugetlb region's are read
    from its fill mapping (``mapped``): its pages are mapped already, a few entries per GiB."""
    hashers = {algo: new_hasher(algo) for algo in {OWN, shipped} - {None}}
    buffer = memoryview(bytearray(min(_HASH_CHUNK, size) if mapped is None else 0))
    done = 0
    while done < size:
        want = min(_HASH_CHUNK, size - done)
        if mapped is not None:
            part, n = mapped[offset + done: offset + done + want], want
        else:
            part = buffer[:want]
            n = os.preadv(fd, [part], offset + done)
        with part:
            for hasher in hashers.values():
                hasher.update(part[:n])
        done += n
    return f"{OWN}:{hashers[OWN].hexdigest()}", (hashers[shipped].hexdigest() if shipped else None)


def _check_digest(source, shard: Shard, actual: str | None) -> None:
    """Refuse a shard whose content does not match the digest its sidecar ships."""
    expected = source.expected_digests.get(shard.name)
    if expected is None:
        return
    algo, hexdigest, where = expected
    if actual != hexdigest:
        raise SidecarError(shard.path, f"content {algo}:{actual[:16]}... does not match {algo}:{hexdigest[:16]}... "
                                       f"in {where}; the file is damaged or the digest is stale: copy the shard again")


def _gaps(manifest: Manifest, pieces: list[Piece]) -> list[tuple[int, int]]:
    """The data area's bytes no piece fills, up to the 2 MiB boundary after the last one: alignment padding."""
    out, end = [], manifest.data_offset
    for p in sorted(pieces, key=lambda p: p.offset):
        if p.offset > end:
            out.append((end, p.offset))
        end = max(end, p.offset + p.nbytes)
    if region.align(end) > end:
        out.append((end, region.align(end)))
    return out


def _fill(fd, manifest, source, fill, on_shard, pacer, table, hashing: bool = True) -> tuple[Manifest, int]:
    """Copy every file's pieces in, hash each piece from memory while the next is copied, write the final header."""
    m = view = None
    if fill.method in (FAULT, HUGETLB):  # hugetlbfs has no write path: the mapping is the only way in
        m = mmap.mmap(fd, manifest.region_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if fill.method == FAULT:
            m.madvise(mmap.MADV_HUGEPAGE)
        view = memoryview(m)
    hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pled-hash")
    digests = []
    pieces = manifest.pieces()
    try:
        header = region.encode_header(manifest)
        planned_length = len(header)
        _write(fd, view, 0, header)
        _write(fd, view, len(header), bytes(manifest.data_offset - len(header)))
        # Zero the alignment padding too: every page of the region is then allocated once, here, so the region is
        # exactly as large as the preflight said, and a client's read of a padding page never allocates one on its
        # own account.
        for start, stop in _gaps(manifest, pieces):
            _write(fd, view, start, bytes(stop - start))
        by_file: dict[int, list[Piece]] = {}
        for p in pieces:
            by_file.setdefault(p.file, []).append(p)
        for shard in source.shards:
            mine = by_file.get(shard.index, [])
            t = time.perf_counter()
            _copy_file(shard, mine, fd, view, pacer, table)
            for p in mine if hashing else ():
                shipped = source.expected_digests.get(shard.name, (None,))[0]
                digests.append((shard, hasher.submit(_digests, fd, p.offset, p.nbytes, shipped,
                                                     view if fill.method == HUGETLB else None)))
            if on_shard:
                on_shard(shard, sum(p.nbytes for p in mine), time.perf_counter() - t)
        tail = region.align(max((p.offset + p.nbytes for p in pieces), default=manifest.data_offset))
        if tail < manifest.region_bytes and fill.method != HUGETLB:  # planned on 1 GiB pages, fallen back to shmem
            os.posix_fallocate(fd, tail, manifest.region_bytes - tail)  # allocated too, as hugetlb's would be
        done = [(shard, f.result()) for shard, f in digests]
        for shard, (_, shipped) in done:  # done is [] when not hashing
            _check_digest(source, shard, shipped)
        final = manifest.with_digests([own for _, (own, _) in done]) if hashing else manifest
        header = region.encode_header(final)
        if len(header) != planned_length:
            raise AssertionError("a digest changed the manifest's length")  # DIGEST_PLACEHOLDER has their length
        _write(fd, view, 0, header)
        huge = manifest.region_bytes if fill.method == HUGETLB else 0
        if fill.method == FAULT:
            huge = hugepages.pmd_mapped_bytes(mapping_address(m))
        return final, huge
    finally:
        for _, f in digests:
            f.cancel()
        hasher.shutdown(wait=True)  # no hash may still read the region when an error closes it
        # Every writable mapping must be gone before F_SEAL_WRITE can be set.
        if view is not None:
            view.release()
        if m is not None:
            m.close()


def _write(fd: int, view: memoryview | None, offset: int, data: bytes) -> None:
    if not data:
        return
    if view is not None:
        view[offset : offset + len(data)] = data
    elif os.pwrite(fd, data, offset) != len(data):
        raise OSError(f"short write to the region at offset {offset}")


def describe_ready(r: Region) -> str:
    """The log line for a staged table: size, files (shards, or a glob's or checkpoint's), time, rate, huge pages."""
    m, s, n = r.manifest, r.stats, len(r.manifest.shards)
    files = ("checkpoint file" if m.form == "arrays" else "shard" if m.layout in LAYOUTS else "file")
    share = s.huge_bytes / m.region_bytes if m.region_bytes else 0.0
    pages = s.fill.policy if s.fill.method == HUGETLB else f"shmem_enabled: {s.fill.policy}"
    line = (
        f"table {m.table} staged: {gib(m.source_bytes)} in {n} {files}{'s' * (n != 1)}, {s.seconds * 1000:.0f} ms "
        f"({rate(m.source_bytes, s.seconds)}), huge pages {share:.0%} ({pages}), "
        + ("sealed" if region.is_sealed(r.fd) else "sealed against shrinking and growing but NOT against writing "
           "(gpu_access = \"writable\")")
    )
    return line + (f", NUMA {s.numa}" if s.numa else "") + (f"; {s.fill.note}" if s.fill.note else "")
