"""The sealed memfd a region lives in: its seals, the check a client makes before reading it, its read-only
mapping, and ``Region``, the one owner of a staged table's fd. Needs nothing beyond the standard library.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat

from pled.shared.errors import RegionError

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
# A writable table's (gpu_access = "writable"): sealed against shrinking, growing and further seals, not writing.
# Only the writers named in the config receive a read-write fd; its inode is WRITABLE_MODE (no write bit for anyone,
# no access at all for others), so no one reopens it writable through /proc.
WRITABLE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
WRITABLE_MODE = 0o440


def seals(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS)


def is_sealed(fd: int) -> bool:
    return seals(fd) & SEALS == SEALS


def check_sealed_memfd(fd: int, writable: bool = False) -> None:
    """Refuse an fd that is not a memfd with all four ``SEALS``; RegionError says what it is instead. Check this
    before reading the region: once sealed, nothing read can change (WRITE) or vanish under a mapping (SHRINK).
    ``writable``: the daemon said the table is a writable one; then exactly ``WRITABLE_SEALS`` (plus WRITE) are
    required: nothing vanishes under a mapping, but a writer named in pled's config may change bytes.

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
    if writable:
        if have & WRITABLE_SEALS != WRITABLE_SEALS:
            raise RegionError(f"fd {fd} is not sealed (seals {have:#x}; a writable table's region has "
                              f"{WRITABLE_SEALS:#x}: shrink, grow, seal)")
        return
    if have & SEALS != SEALS:
        raise RegionError(f"fd {fd} is not sealed "
                          f"(seals {have:#x}; a region has {SEALS:#x}: shrink, grow, write, seal)")


def map_readonly(fd: int) -> mmap.mmap:
    """A shared, read-only mapping of the whole region: the same pages every client sees."""
    return mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)


class Region:
    """Owns one staged table's memfd. ``close()`` drops this handle and is safe to repeat."""

    _fd = -1

    def __init__(self, fd: int, manifest, stats=None) -> None:  # manifest: pled.shared.region.Manifest
        self._fd = fd
        self.manifest = manifest
        self.stats = stats  # pled.daemon.regions.staging.StageStats where this process staged it; None if adopted

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
