"""How much of a file sits in the page cache: the cachestat syscall, or mincore where it is missing.

A hugetlb memfd is counted from ``fstat().st_blocks`` instead: cachestat refuses it (EOPNOTSUPP), and mincore
cannot serve. Measured on Linux 6.18: mincore over a hugetlb mapping reports only the pages this process has
mapped (a fresh mapping reports none of a full region), and the fallback's MAP_PRIVATE mapping reserves pool
pages (ENOMEM on a full pool). hugetlbfs adds a page's blocks to the inode when the page enters the memfd (by
fault or fallocate) and takes them off only when it leaves (truncate, hole punch, the last close): hugetlb
pages are never swapped or reclaimed, so those blocks are exactly its resident pages, read without mapping
anything, reserving anything or touching the pool.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os

_libc = ctypes.CDLL(None, use_errno=True)
# cachestat(2), Linux 6.5+: the same number on every architecture (generic syscall table).
_NR_CACHESTAT = 451
PAGE = os.sysconf("SC_PAGE_SIZE")
HUGETLBFS_MAGIC = 0x958458F6  # linux/magic.h: statfs's f_type of hugetlbfs, where hugetlb memfds live


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64)
                for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


class _StatFs(ctypes.Structure):
    # struct statfs begins with f_type (__fsword_t, a long on 64-bit Linux); the rest is room for its other fields.
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 248)]


def _cachestat(fd: int) -> int | None:
    rng, st = _Range(0, 0), _Stat()  # len 0: to the end of the file
    if _libc.syscall(_NR_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) == 0:
        return st.nr_cache * PAGE
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM):  # old kernel, or a seccomp filter that does not know it
        return None
    if err == errno.EOPNOTSUPP and is_hugetlb(fd):
        return hugetlb_bytes(fd)
    raise OSError(err, os.strerror(err))


def is_hugetlb(fd: int) -> bool:
    """Whether ``fd`` is a hugetlbfs file (a MFD_HUGETLB memfd); False where fstatfs cannot tell."""
    buf = _StatFs()
    if _libc.fstatfs(fd, ctypes.byref(buf)) != 0:
        return False
    return buf.f_type & 0xFFFFFFFF == HUGETLBFS_MAGIC


def hugetlb_bytes(fd: int) -> int:
    """Bytes of a hugetlb memfd's pages that exist: each one is resident (see the module's docstring)."""
    return os.fstat(fd).st_blocks * 512


def page_size(fd: int) -> int:
    """The page size of a memfd: its huge-page size for a hugetlb one, the base page (4096) for shmem."""
    return os.fstat(fd).st_blksize if is_hugetlb(fd) else PAGE


def _mincore(fd: int, size: int) -> int:
    if size == 0:
        return 0
    # A private mapping is writable, so ctypes can take its address; mincore still reports
    # the file's page-cache pages as long as nothing is written through it.
    m = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    try:
        vec = (ctypes.c_ubyte * -(-size // PAGE))()
        if _libc.mincore(ctypes.c_void_p(mapping_address(m)), ctypes.c_size_t(size), vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return sum(v & 1 for v in vec) * PAGE
    finally:
        m.close()


def mapping_address(m: mmap.mmap) -> int:
    """Where a writable (or copy-on-write) mapping starts; the mapping stays put while it is open."""
    anchor = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # an export of the mapping would keep it from closing


def cached_bytes_fd(fd: int) -> int:
    """Bytes of the file behind ``fd`` in memory: page cache for a file, resident pages for a memfd."""
    found = _cachestat(fd)
    if found is not None:
        return found
    return hugetlb_bytes(fd) if is_hugetlb(fd) else _mincore(fd, os.fstat(fd).st_size)


def cached_bytes(path: str) -> int:
    """Bytes of ``path`` now in the page cache (whole pages, so up to a page more than the file)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return cached_bytes_fd(fd)
    finally:
        os.close(fd)
