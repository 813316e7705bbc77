"""NUMA placement of a region: the nodes with memory, mbind and set_mempolicy by raw syscall, numa_maps read back.

Facts this module relies on, measured on Linux 6.18 (x86-64, one node) and read in mm/mempolicy.c:

- A shared memfd (shmem) keeps a policy set with ``mbind`` on any of its ``MAP_SHARED`` mappings in its inode (a
  "shared policy"): pages it allocates later, through any mapping or by ``write``/``sendfile``, follow it, and
  every process that maps it sees it in its own numa_maps (``interleave:0``).
- A hugetlb memfd has no shared policy: ``mbind`` sets the policy of that one mapping (VMA) only. Pages faulted
  through it follow it; another process's mapping of the same memfd shows its own task policy (``default``).
  ``fallocate`` (hugetlb.create's reservation) allocates through a pseudo-VMA with no policy, so by the calling
  thread's (read in fs/hugetlbfs; one node here cannot show where pages land): place a hugetlb region with
  ``thread_policy`` around hugetlb.create, or ``mbind`` a mapping and fault every page through it.
- ``set_mempolicy`` on a thread does not follow a memfd into another process: numa_maps shows ``default`` there.
- A policy must be in place before the pages are first allocated: ``mbind`` without MPOL_MF_MOVE leaves pages
  already there where they are.

No libnuma: three syscalls through ctypes, nothing to install.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from pled.shared.hugepages import pmd_mapped_bytes
from pled.shared.pagecache import is_hugetlb

# linux/mempolicy.h
MPOL_DEFAULT = 0
MPOL_PREFERRED = 1
MPOL_BIND = 2
MPOL_INTERLEAVE = 3
MPOL_LOCAL = 4
MODES = {"default": MPOL_DEFAULT, "preferred": MPOL_PREFERRED, "bind": MPOL_BIND, "interleave": MPOL_INTERLEAVE,
         "local": MPOL_LOCAL}
_MODE_FLAGS = 7 << 13  # MPOL_F_NUMA_BALANCING, MPOL_F_RELATIVE_NODES, MPOL_F_STATIC_NODES: or-ed into a mode
MPOL_MF_STRICT = 1  # mbind: fail with EIO where pages already there break the policy
MPOL_MF_MOVE = 2  # mbind: move this process's pages already there to follow the policy

# (mbind, set_mempolicy, get_mempolicy) per architecture; the generic table (arm64, riscv64) shares one line.
_SYSCALLS = {"x86_64": (237, 238, 239), "aarch64": (235, 237, 236), "riscv64": (235, 237, 236),
             "ppc64le": (259, 261, 260), "s390x": (268, 270, 269)}
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8
_MAX_NODES = 1024  # the mask get_mempolicy reads into (CONFIG_NODES_SHIFT is 10 at most on x86-64)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class NumaError(OSError):
    """A NUMA syscall failed, or the architecture's syscall numbers are not known here."""


def nodes_with_memory(sys_root: str = "/") -> list[int]:
    """The nodes that have memory, from /sys/devices/system/node/has_memory ("0-1,3"); [0] on a kernel without
    NUMA (no such file: one node holds everything)."""
    path = os.path.join(sys_root, "sys/devices/system/node/has_memory")
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return [0]
    return parse_nodelist(text)


MAX_NODES = 1 << 12  # more than the kernel's MAX_NUMNODES (1,024): a list naming more nodes is no kernel's


def parse_nodelist(text: str) -> list[int]:
    """A kernel node list ("0-3,5", "" for none) as sorted node numbers; ValueError for one that names a node past
    MAX_NODES (a range is never expanded beyond it)."""
    nodes: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        lo, hi = (int(x) if len(x) <= 6 and x.isascii() and x.isdigit() else MAX_NODES for x in (first, last or first))
        if hi >= MAX_NODES:
            raise ValueError(f"node list {text[:40]!r} names a node past {MAX_NODES - 1}")
        nodes.update(range(lo, hi + 1))
    return sorted(nodes)


def format_nodelist(nodes: Iterable[int]) -> str:
    """Node numbers as the kernel writes a list ("0-3,5"), as in numa_maps' "interleave:0-3,5"."""
    runs: list[list[int]] = []
    for n in sorted(set(nodes)):
        if runs and runs[-1][1] == n - 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _mask(nodes: Iterable[int]) -> tuple[ctypes.Array[ctypes.c_ulong] | None, int]:
    """A nodemask for the kernel and its maxnode (bits + 1: the kernel reads maxnode - 1 bits)."""
    nodes = list(nodes)
    if not nodes:
        return None, 0
    words = max(nodes) // _ULONG_BITS + 1
    mask = (ctypes.c_ulong * words)()
    for n in nodes:
        if n < 0:
            raise ValueError(f"node {n} is not a node number")
        mask[n // _ULONG_BITS] |= 1 << (n % _ULONG_BITS)
    return mask, words * _ULONG_BITS + 1


def _syscall(index: int, *args: object) -> None:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        raise NumaError(0, f"NUMA syscall numbers are not known for {platform.machine()}")
    if _libc.syscall(ctypes.c_long(numbers[index]), *args) != 0:
        err = ctypes.get_errno()
        raise NumaError(err, os.strerror(err))


def mbind(address: int, length: int, mode: int, nodes: Iterable[int] = (), flags: int = 0) -> None:
    """Set the policy of the pages in [address, address + length) of this process's mappings (address page
    aligned; for hugetlb, huge-page aligned). MPOL_LOCAL and MPOL_DEFAULT take no nodes. Apply it before the
    pages are first touched: pages already there stay put unless ``flags`` has MPOL_MF_MOVE."""
    mask, maxnode = _mask(nodes)
    _syscall(0, ctypes.c_void_p(address), ctypes.c_ulong(length), ctypes.c_int(mode), mask,
             ctypes.c_ulong(maxnode), ctypes.c_uint(flags))


def set_mempolicy(mode: int, nodes: Iterable[int] = ()) -> None:
    """The calling thread's policy, for what it allocates where no mapping has one (hugetlb fallocate does)."""
    mask, maxnode = _mask(nodes)
    _syscall(1, ctypes.c_int(mode), mask, ctypes.c_ulong(maxnode))


def _get_mempolicy() -> tuple[int, list[int]]:
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * (_MAX_NODES // _ULONG_BITS))()
    _syscall(2, ctypes.byref(mode), mask, ctypes.c_ulong(_MAX_NODES + 1), None, ctypes.c_ulong(0))
    return mode.value, [n for n in range(_MAX_NODES) if mask[n // _ULONG_BITS] >> (n % _ULONG_BITS) & 1]


def get_mempolicy() -> tuple[int, list[int]]:
    """The calling thread's policy: (mode, nodes), the mode without its flags (MPOL_F_STATIC_NODES...)."""
    mode, nodes = _get_mempolicy()
    return mode & ~_MODE_FLAGS, nodes


def refused() -> str:
    """Why this process may not set NUMA policies ("" where it may): mbind on one page of its own and
    set_mempolicy to the policy it has, each changing nothing; a seccomp filter that refuses them (systemd's
    SystemCallFilter=~@resources) answers EPERM."""
    page = mmap.mmap(-1, mmap.PAGESIZE)
    anchor = ctypes.c_char.from_buffer(page)
    try:
        mbind(ctypes.addressof(anchor), mmap.PAGESIZE, MPOL_DEFAULT)
        set_mempolicy(*_get_mempolicy())
    except NumaError as err:
        return f"the kernel refuses mbind/set_mempolicy here ({err.strerror or err})"
    finally:
        del anchor
        page.close()
    return ""


@contextlib.contextmanager
def thread_policy(mode: int, nodes: Iterable[int] = ()) -> Iterator[None]:
    """Run a block under a thread policy (for hugetlb.create's fallocate), then put the thread's back."""
    before = _get_mempolicy()
    set_mempolicy(mode, nodes)
    try:
        yield
    finally:
        set_mempolicy(*before)


@dataclass(frozen=True)
class NumaMapping:
    """One line of /proc/PID/numa_maps: a mapping's policy as the kernel writes it and its pages per node."""

    start: int
    policy: str  # "default", "interleave:0", "bind:0-1", "prefer:0", "local"...
    file: str | None
    pages: dict[int, int] = field(default_factory=dict)  # node -> pages of this mapping there (kernelpagesize each)
    page_size: int | None = None  # kernelpagesize_kB in bytes; written only where the mapping has pages
    huge: bool = False  # the "huge" word: a hugetlb mapping

    @property
    def bytes_per_node(self) -> dict[int, int]:
        return {n: p * (self.page_size or 0) for n, p in self.pages.items()}


_NODE = re.compile(r"N(\d+)=(\d+)$")
_ESCAPED = re.compile(rb"\\([0-7]{3})")


def _unescape(path: str) -> str:
    """numa_maps writes a path's newline, tab, space and "=" as octal escapes (\\040 for a space)."""
    raw = path.encode("utf-8", "surrogateescape")
    return _ESCAPED.sub(lambda m: bytes([int(m[1], 8)]), raw).decode("utf-8", "surrogateescape")


def read_numa_maps(pid: int | str = "self", proc_root: str = "/") -> list[NumaMapping]:
    """Every mapping of a process in /proc/PID/numa_maps."""
    path = os.path.join(proc_root, f"proc/{pid}/numa_maps")
    out = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            words = line.split()
            if len(words) < 2:
                continue
            file = pages_kb = None
            pages: dict[int, int] = {}
            huge = False
            for w in words[2:]:
                if w.startswith("file="):
                    file = _unescape(w[5:])
                elif w.startswith("kernelpagesize_kB="):
                    pages_kb = int(w.split("=", 1)[1])
                elif w == "huge":
                    huge = True
                elif (m := _NODE.match(w)) is not None:
                    pages[int(m[1])] = int(m[2])
            out.append(NumaMapping(int(words[0], 16), words[1], file, pages, pages_kb and pages_kb * 1024, huge))
    return out


def mapping_policy(address: int, pid: int | str = "self", proc_root: str = "/") -> NumaMapping | None:
    """The numa_maps line of the mapping that starts at ``address`` (a region's mapping), or None."""
    return next((m for m in read_numa_maps(pid, proc_root) if m.start == address), None)


def memfd_mappings(name: str, pid: int | str = "self", proc_root: str = "/") -> list[NumaMapping]:
    """The mappings of a memfd by its name: numa_maps names it ``/memfd:<name> (deleted)``, hugetlb memfds too."""
    want = f"/memfd:{name}"
    return [m for m in read_numa_maps(pid, proc_root) if m.file in (want, want + " (deleted)")]


# A short-lived read-only mapping made by libc itself: Python's mmap cannot tell where a read-only mapping lies.
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_PROT_READ, _MAP_SHARED, _MADV_POPULATE_READ = 1, 1, 22
_WINDOW = 2 * 1024 * 1024
SURVEY_WINDOWS = 64  # 2 MiB windows faulted in a larger shmem region: about 4 ms on 4 KiB pages


@dataclass(frozen=True)
class Survey:
    """Where a region's pages lie, seen through a short-lived read-only mapping in this process."""

    policy: str  # the mapping's policy as numa_maps writes it: a shmem memfd's own (shared) policy
    bytes_per_node: dict[int, int]  # measured, or scaled up from ``sampled`` bytes
    huge_share: float  # share of the sampled bytes mapped by huge pages (THP PMDs, or hugetlb)
    sampled: int  # bytes faulted in and counted


def survey(fd: int, length: int, windows: int = SURVEY_WINDOWS) -> Survey:
    """Map ``fd`` read-only, fault in its pages (MADV_POPULATE_READ: pages that exist are mapped, none is made or
    reserved), read this mapping's numa_maps and ShmemPmdMapped, unmap. A hugetlb region is faulted whole (one
    entry per huge page, cheap); a shmem one larger than ``windows`` 2 MiB windows only in that many windows spread
    over it (faulting 4 KiB pages costs about 130 ms/GiB), its figures scaled up."""
    address = _libc.mmap(None, length, _PROT_READ, _MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    try:
        huge = is_hugetlb(fd)
        spans = [(0, length)]
        if not huge and length > windows * _WINDOW:
            step = length // _WINDOW // windows * _WINDOW
            spans = [(i * step, _WINDOW) for i in range(windows)]
        for offset, n in spans:
            if _libc.madvise(ctypes.c_void_p(address + offset), n, _MADV_POPULATE_READ) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"MADV_POPULATE_READ: {os.strerror(err)}")
        line = mapping_policy(address)
        sampled = sum(n for _, n in spans)
        pmd = sampled if huge else pmd_mapped_bytes(address)
    finally:
        _libc.munmap(address, length)
    if line is None:
        raise OSError(0, "the mapping is not in numa_maps")
    scale = length / sampled if sampled else 0.0
    return Survey(line.policy, {n: int(b * scale) for n, b in line.bytes_per_node.items()},
                  pmd / sampled if sampled else 0.0, sampled)
