"""Reserved huge pages (hugetlbfs): the kernel's pools, the hugetlb cgroup's limits, and a region's memfd.

Readers are rooted at a path, as hostmem.py's are, so tests feed fixture trees. Facts measured on Linux 6.18
(x86-64) that the code relies on:

- A hugetlb memfd's size is a whole number of its pages: ``ftruncate`` to anything else is EINVAL.
- It has no write path: ``write``/``pwrite`` are EINVAL (so is ``sendfile`` into it). Fill it through a
  ``MAP_SHARED`` mapping (``copy_into`` reads a file straight into one with ``preadv``).
- ``fallocate`` allocates (and zeroes) every page at once and charges them to the caller's hugetlb cgroup: a
  short pool or a cgroup limit fails at once (ENOSPC, in well under a millisecond), and closing the fd gives back
  what it took. A ``MAP_SHARED`` mapping without ``MAP_NORESERVE`` only reserves: it fails at once on a short
  pool (ENOMEM) but not on a hugetlb cgroup limit, which is charged at fault time: the fault past the limit is a
  SIGBUS. So ``create`` reserves with fallocate. Its pages follow the calling thread's NUMA policy (a hugetlb
  memfd has no shared policy; see numa.py): wrap ``create`` in ``numa.thread_policy`` to place them.
- Once allocated, the pages belong to the memfd: another process maps and reads them without a new reservation
  and without a charge, even on a full pool and in a cgroup whose hugetlb limit is 0. They are never swapped or
  reclaimed, and ``fstat().st_blocks`` counts them (pagecache.py's residency).
- ``fstat().st_blksize`` of a hugetlb memfd is its page size (4096 for a shmem one).
- All four seals apply once no writable mapping is left, and a sealed one refuses ``PROT_WRITE`` ``MAP_SHARED``.
"""
from __future__ import annotations

import errno
import mmap
import os
from dataclasses import dataclass

# The cgroup plumbing is hostmem's: the mounts, and where our cgroup lies under one.
from pled.daemon.memory.hostmem import UNLIMITED, HostInfoUnavailable, _int, _join, locate_cgroup
from pled.shared.boundary import ascii_count

HUGEPAGES = "/sys/kernel/mm/hugepages"
# linux/memfd.h: MFD_HUGETLB takes the page size's log2 in these bits (MFD_HUGE_2MB is 21 << 26).
MFD_HUGE_SHIFT = 26
MFD_HUGE_MASK = 0x3F


def page_sizes(sys_root: str = "/") -> list[int]:
    """The huge-page sizes the kernel offers, in bytes, smallest first ([] without hugetlb)."""
    try:
        names = os.listdir(_join(sys_root, HUGEPAGES))
    except FileNotFoundError:
        return []
    sizes = []
    for name in names:
        kib = ascii_count(name[10:-2]) if name.startswith("hugepages-") and name.endswith("kB") else None
        if kib is not None:
            sizes.append(kib * 1024)
    return sorted(sizes)


def size_name(page_size: int) -> str:
    """A page size as the hugetlb cgroup's files name it: "2MB", "1GB", "64KB"."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20)):
        if page_size >= scale:
            return f"{page_size // scale}{unit}"
    return f"{page_size // 1024}KB"


def round_up(nbytes: int, page_size: int) -> int:
    """A hugetlb region's size: ``nbytes`` rounded up to whole pages."""
    return -(-nbytes // page_size) * page_size


@dataclass(frozen=True)
class CgroupLevel:
    """One hugetlb cgroup with a limit for a page size, on the way from ours to the root."""

    path: str  # the cgroup's name, as /proc/self/cgroup writes it
    limit: int  # bytes of pages faulted or allocated (v1 limit_in_bytes, v2 max)
    usage: int
    rsvd_limit: int = UNLIMITED  # bytes reserved (rsvd.*, Linux 5.7+): a reservation is charged here first
    rsvd_usage: int = 0

    @property
    def headroom(self) -> int:
        return max(0, min(self.limit - self.usage, self.rsvd_limit - self.rsvd_usage))


@dataclass(frozen=True)
class HugetlbCgroup:
    version: int
    path: str  # our own hugetlb cgroup
    limited: tuple[CgroupLevel, ...]  # every level with a limit for this size, ours first

    @property
    def binding(self) -> CgroupLevel | None:
        """The level with the least headroom: the one that decides."""
        return min(self.limited, key=lambda lv: lv.headroom, default=None)


@dataclass(frozen=True)
class Pool:
    """One page size's pool (/sys/kernel/mm/hugepages/hugepages-<N>kB), in pages, and our cgroup's limits."""

    page_size: int
    total: int  # nr_hugepages
    free: int  # free_hugepages: includes pages promised to mappings already made...
    reserved: int  # resv_hugepages: ...which are these
    surplus: int  # surplus_hugepages: pages over nr_hugepages taken through nr_overcommit_hugepages
    overcommit: int  # nr_overcommit_hugepages: the most surplus pages the kernel may try to find (no promise)
    cgroup: HugetlbCgroup | None = None

    @property
    def available_pages(self) -> int:
        """Pages a new memfd can surely take: free, less those reserved."""
        return max(0, self.free - self.reserved)

    @property
    def available(self) -> int:
        """Bytes a new memfd can take: the pool's available pages, within our hugetlb cgroup's headroom."""
        room = self.available_pages * self.page_size
        binding = self.cgroup.binding if self.cgroup else None
        return room if binding is None else min(room, binding.headroom // self.page_size * self.page_size)


def pool(page_size: int, root: str = "/") -> Pool | None:
    """The pool of ``page_size`` pages and the hugetlb cgroup limits on it; None where the kernel has no such
    size. HostInfoUnavailable where a file is there but unreadable."""
    base = _join(root, f"{HUGEPAGES}/hugepages-{page_size // 1024}kB")
    if not os.path.isdir(base):
        return None
    values = {}
    for name in ("nr_hugepages", "free_hugepages", "resv_hugepages", "surplus_hugepages",
                 "nr_overcommit_hugepages"):
        value = _int(os.path.join(base, name))
        if value is None:
            raise HostInfoUnavailable(os.path.join(base, name), "is missing")
        values[name] = value
    return Pool(page_size, values["nr_hugepages"], values["free_hugepages"], values["resv_hugepages"],
                values["surplus_hugepages"], values["nr_overcommit_hugepages"], read_cgroup(page_size, root))


# (limit, usage, reserved limit, reserved usage) per cgroup version, for a size name.
_FILES = {
    1: ("hugetlb.{}.limit_in_bytes", "hugetlb.{}.usage_in_bytes",
        "hugetlb.{}.rsvd.limit_in_bytes", "hugetlb.{}.rsvd.usage_in_bytes"),
    2: ("hugetlb.{}.max", "hugetlb.{}.current", "hugetlb.{}.rsvd.max", "hugetlb.{}.rsvd.current"),
}


def read_cgroup(page_size: int, root: str = "/") -> HugetlbCgroup | None:
    """This process's hugetlb cgroup and every level above it with a limit for ``page_size``; None where no
    hugetlb controller is mounted for it (v1) or enabled on its path (v2: the levels without the files)."""
    place = locate_cgroup("hugetlb", root)
    if place is None:
        return None
    name = size_name(page_size)
    limit_file, usage_file, rsvd_limit_file, rsvd_usage_file = (f.format(name) for f in _FILES[place.version])
    levels = []
    for level, directory in place.upwards():
        limit = _int(os.path.join(directory, limit_file))
        rsvd_limit = _int(os.path.join(directory, rsvd_limit_file))
        if (limit is not None and limit < UNLIMITED) or (rsvd_limit is not None and rsvd_limit < UNLIMITED):
            usage = _int(os.path.join(directory, usage_file))
            if usage is None:
                raise HostInfoUnavailable(os.path.join(directory, usage_file), "is missing beside its limit")
            levels.append(CgroupLevel(level, UNLIMITED if limit is None else limit,
                                      usage, UNLIMITED if rsvd_limit is None else rsvd_limit,
                                      _int(os.path.join(directory, rsvd_usage_file)) or 0))
    return HugetlbCgroup(place.version, place.path, tuple(levels))


class NoHugePages(OSError):
    """A hugetlb memfd could not have all its pages: the pool or a hugetlb cgroup is short (errno ENOMEM)."""


def memfd_flags(page_size: int) -> int:
    """memfd_create's flags for a sealable hugetlb memfd of ``page_size`` pages."""
    shift = page_size.bit_length() - 1
    if page_size <= 0 or page_size != 1 << shift or shift > MFD_HUGE_MASK:
        raise ValueError(f"{page_size} is not a page size")
    return os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB | shift << MFD_HUGE_SHIFT


def create(name: str, size: int, page_size: int) -> int:
    """A sealable hugetlb memfd of ``round_up(size, page_size)`` bytes with every page allocated now.

    A short pool or hugetlb cgroup fails here at once with NoHugePages (ENOMEM), which names what was asked
    and the pool's figures, never as a SIGBUS halfway through a copy; the fd is then closed and what it had
    taken is back in the pool. The caller owns the fd it returns. Pages follow the calling thread's NUMA
    policy (numa.thread_policy). The pages are zeroed by the kernel (the cost of a first fault, paid now).
    """
    length = round_up(size, page_size)
    fd = os.memfd_create(name, memfd_flags(page_size))
    try:
        os.ftruncate(fd, length)
        if length:
            os.posix_fallocate(fd, 0, length)
    except OSError as err:
        os.close(fd)
        if err.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        raise NoHugePages(errno.ENOMEM, f"{length // page_size} pages of {size_name(page_size)} "
                                        f"({length} bytes) could not be allocated: {_short(page_size)}") from err
    except BaseException:
        os.close(fd)
        raise
    return fd


def _short(page_size: int) -> str:
    """What the pool and our hugetlb cgroup have now, for an error message."""
    try:
        p = pool(page_size)
    except HostInfoUnavailable as err:
        return f"the pool cannot be read ({err})"
    if p is None:
        return "the kernel offers no such pages"
    text = f"{p.available_pages} of {p.total} pages available (free {p.free}, reserved {p.reserved})"
    binding = p.cgroup.binding if p.cgroup else None
    if binding is not None:
        text += f"; hugetlb cgroup {binding.path} has room for {binding.headroom // page_size} pages"
    return text


def page_size_of(fd: int) -> int:
    """The page size of a memfd (or any file's preferred I/O size): a hugetlb memfd's huge-page size, 4096 for
    a shmem one."""
    return os.fstat(fd).st_blksize


def map_for_fill(fd: int, length: int) -> mmap.mmap:
    """A writable ``MAP_SHARED`` mapping of a memfd, to fill it (hugetlbfs has no write path). Close it, and
    every memoryview of it, before sealing: F_SEAL_WRITE fails with EBUSY while a writable mapping exists."""
    return mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def copy_into(view: memoryview | mmap.mmap, offset: int, src_fd: int, src_offset: int, length: int) -> None:
    """Read ``length`` bytes of ``src_fd`` from ``src_offset`` straight into a mapping at ``offset`` (preadv: one
    copy, from the page cache into the region's pages). EOFError where the file ends first."""
    target = view if isinstance(view, memoryview) else memoryview(view)
    try:
        done = 0
        while done < length:
            with target[offset + done:offset + length] as part:
                n = os.preadv(src_fd, [part], src_offset + done)
            if n == 0:
                raise EOFError(f"the source ended {length - done} bytes short of {length} at {src_offset + done}")
            done += n
    finally:
        if target is not view:
            target.release()
