"""How much of a file sits in the page cache: the cachestat syscall, or mincore where it is missing."""
from __future__ import annotations

import ctypes
import errno
import mmap
import os

_libc = ctypes.CDLL(None, use_errno=True)
# cachestat(2), Linux 6.5+: the same number on every architecture (generic syscall table).
_NR_CACHESTAT = 451
PAGE = os.sysconf("SC_PAGE_SIZE")


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64)
                for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def _cachestat(fd: int) -> int | None:
    rng, st = _Range(0, 0), _Stat()  # len 0: to the end of the file
    if _libc.syscall(_NR_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) == 0:
        return st.nr_cache * PAGE
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM):  # old kernel, or a seccomp filter that does not know it
        return None
    raise OSError(err, os.strerror(err))


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
    return found if found is not None else _mincore(fd, os.fstat(fd).st_size)


def cached_bytes(path: str) -> int:
    """Bytes of ``path`` now in the page cache (whole pages, so up to a page more than the file)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return cached_bytes_fd(fd)
    finally:
        os.close(fd)
