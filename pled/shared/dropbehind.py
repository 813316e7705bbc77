"""Drop from the page cache what pled's reads of one file brought in, and nothing else.

A sidecar's shard is pled's alone: it is read with POSIX_FADV_SEQUENTIAL (the kernel's readahead at its widest),
every page of it dropped behind the copy, chunk by chunk, and the whole file once read (``everything=True``). A model
checkpoint is not: its PLE tensors are a small part of files whose other tensors a restarting vLLM reads next, maybe
while pled reads. So pled reads a checkpoint file with POSIX_FADV_RANDOM set on its own open file (readahead state
is per open file: another reader's is untouched): the kernel then reads exactly the pages asked for, and no
readahead runs past a range into pages pled would have to guess about. pled reads ahead itself instead: after each
read, POSIX_FADV_WILLNEED for as many bytes again, never past the end of the range (the kernel reads exactly those,
without waiting, and sets no readahead marker). Of a checkpoint file pled drops only

* pages inside the byte ranges it read, rounded inward (a page shared with a neighbouring tensor stays),
* that were not in the page cache before pled read any of the file (one snapshot, taken when the file is opened:
  taken later, pled's own read-ahead for one range would pass for pages that were cached before).

Nothing past a range is ever dropped. A page of a range that another reader brings in while pled stages goes with
pled's (pled read it too); pages another reader's own readahead marked may still make the kernel read ahead on
pled's open file, and those are left cached, as another reader's.

Residency comes from cachestat(2) (Linux 6.5+) where the whole file is cold or wholly cached, else from mincore(2)
on a mapping of the file. Both tell the truth only to a process that owns the file or may write it (Linux 5.2's
side-channel fix: cachestat then fails with EPERM, mincore reports every page cached). Where pled may not know, it
drops the ranges it read (inward), as if the file had been cold: the other tensors stay.

Dropping works on whole folios: the page cache holds a file in folios of up to 2 MiB, and POSIX_FADV_DONTNEED leaves
any folio that runs past either end of the range. So a read in progress drops up to the last 2 MiB boundary behind
it, and the rest when its range is done; adjacent ranges (a checkpoint's PLE tensors follow each other) are one.
"""
from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import re
from collections.abc import Iterable

from pled.shared.hugepages import PMD_SIZE
from pled.shared.pagecache import _NR_CACHESTAT, PAGE, _libc, _Range, _Stat, mapping_address

log = logging.getLogger(__name__)

_LOW_BIT = bytes(i & 1 for i in range(256))  # mincore's vector: bit 0 is residency, the others are reserved
_COLD = re.compile(rb"\x00+")


def page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def page_down(n: int) -> int:
    return n // PAGE * PAGE


def merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges sorted, those that touch or overlap made one."""
    out: list[tuple[int, int]] = []
    for begin, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out


def _may_see(fd: int) -> bool:
    """Whether the kernel tells this process the truth about ``fd``'s page cache (mm/mincore.c, can_do_mincore)."""
    st = os.fstat(fd)
    return os.geteuid() in (0, st.st_uid) or os.access(f"/proc/self/fd/{fd}", os.W_OK)


def _cached_pages(fd: int, offset: int, length: int) -> int | None:
    """Pages of ``fd``'s [offset, offset + length) in the page cache by cachestat(2); None where it cannot say."""
    rng, st = _Range(offset, length), _Stat()
    if _libc.syscall(_NR_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) == 0:
        return int(st.nr_cache)
    return None  # ENOSYS (before 6.5), EPERM (a file this process may not see, or a seccomp filter), ...


def resident(fd: int, size: int, lo: int = 0, hi: int | None = None) -> bytes | None:
    """One byte a page of ``fd``'s first ``size`` bytes, 1 where it is in the page cache now; None where this
    process cannot know. Only pages of [lo, hi) are looked at: the others count as cached (never dropped)."""
    pages = -(-size // PAGE)
    lo, hi = page_down(lo), min(page_up(size if hi is None else hi), pages * PAGE)
    if hi <= lo:
        return b"\x01" * pages
    head, tail, n = b"\x01" * (lo // PAGE), b"\x01" * (pages - hi // PAGE), (hi - lo) // PAGE
    counted = _cached_pages(fd, lo, hi - lo)
    if counted == 0:
        return head + bytes(n) + tail  # a cold file: the common case, and no mapping needed
    if counted is not None and counted >= n:
        return b"\x01" * pages
    if not _may_see(fd):
        return None
    vec = _mincore(fd, lo, min(hi, size) - lo)  # a mapping may not run past the file's end
    return None if vec is None else head + vec + tail


def _mincore(fd: int, offset: int, length: int) -> bytes | None:
    """mincore over a mapping of [offset, offset + length) (offset page-aligned); None where it cannot be had."""
    try:  # never written: mincore still sees the file's pages
        m = mmap.mmap(fd, length, access=mmap.ACCESS_COPY, offset=offset)
    except (OSError, ValueError):  # a file system that cannot map it, a file cut short since: not known
        return None
    try:
        vec = (ctypes.c_ubyte * -(-length // PAGE))()
        if _libc.mincore(ctypes.c_void_p(mapping_address(m)), ctypes.c_size_t(length), vec) != 0:
            return None
        return bytes(vec).translate(_LOW_BIT)
    finally:
        m.close()


class DropBehind:
    """The page cache of one file while pled reads ``ranges`` of it (opened here: POSIX_FADV_RANDOM on a checkpoint's
    file, SEQUENTIAL on a sidecar's): call ``read`` after each read (in order within a range) and ``close`` once done
    (also after an error: what was read is dropped)."""

    def __init__(self, fd: int, ranges: Iterable[tuple[int, int]], path: str, *, everything: bool = False) -> None:
        self.fd, self.path, self.everything = fd, path, everything
        self.runs = merged(ranges)
        self._starts = [b for b, _ in self.runs]
        self._to = [page_up(b) for b, _ in self.runs]  # dropped up to, in each run
        self._touched = [False] * len(self.runs)
        self._warned = False
        size = os.fstat(fd).st_size
        self.size = size
        # Before the first read of the file: later, pled's read-ahead for one range would pass for the next one's
        # cache. Only the pages pled may drop are looked at: from the first range to the last one's end.
        span = (self.runs[0][0], self.runs[-1][1]) if self.runs else (0, 0)
        self.before = None if everything else resident(fd, size, *span)
        if self.before is None and not everything:
            log.info("pled cannot see which pages of %r were cached (it neither owns nor may write it): it drops "
                     "the pages of the ranges it read, cached or not, and leaves the rest of the file's", path)
        # No kernel readahead past what pled asks for, on pled's own open file only (a checkpoint's)
        self._advise(0, 0, os.POSIX_FADV_SEQUENTIAL if everything else os.POSIX_FADV_RANDOM)

    def read(self, begin: int, end: int) -> None:
        """Bytes [begin, end) were just read: drop what of them pled brought in, up to the last 2 MiB boundary (a
        folio running on past ``end`` is dropped with the next read, or by ``close``); of a checkpoint's file, ask
        for the next as many bytes of the range, never past its end."""
        i = bisect.bisect_right(self._starts, begin) - 1
        if i < 0 or begin >= self.runs[i][1]:
            return  # not in a range pled reads: a header, say
        self._touched[i] = True
        stop = page_down(self.runs[i][1]) if end >= self.runs[i][1] else end // PMD_SIZE * PMD_SIZE
        if stop > self._to[i]:
            self._drop(self._to[i], stop)
            self._to[i] = stop
        ahead = min(self.runs[i][1], end + (end - begin)) - end
        if not self.everything and ahead > 0:
            self._advise(end, ahead, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        """Drop the rest of every range read; a sidecar's file is dropped whole."""
        if self.everything:
            self._advise(0, 0)  # readahead may have brought in pages past the last chunk
            return
        for i, (_, end) in enumerate(self.runs):
            if self._touched[i] and page_down(end) > self._to[i]:
                self._drop(self._to[i], page_down(end))
                self._to[i] = page_down(end)

    def _drop(self, lo: int, hi: int) -> None:
        """Drop pages [lo, hi) (page-aligned) that were not cached before."""
        if hi <= lo:
            return
        if self.before is None:
            self._advise(lo, hi - lo)
            return
        was = self.before[lo // PAGE: -(-hi // PAGE)]
        if b"\x01" not in was:
            self._advise(lo, hi - lo)
            return
        for m in _COLD.finditer(was):
            self._advise(lo + m.start() * PAGE, (m.end() - m.start()) * PAGE)

    def _advise(self, offset: int, length: int, advice: int = os.POSIX_FADV_DONTNEED) -> None:
        try:
            os.posix_fadvise(self.fd, offset, length, advice)
        except OSError as err:  # os.posix_fadvise raises on the returned error, unlike a bare libc call
            self._warn(str(err))

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("could not advise the kernel on the page cache of %r (%s); pled goes on, the kernel "
                        "reclaims what pled read later", self.path, why)
