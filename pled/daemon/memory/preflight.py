"""Can this host, and this process's memory cgroup, hold the tables? Decided in milliseconds.

Needed: the exact bytes of every region (the source files plus their 2 MiB
alignment and the region header), plus ``headroom_margin``. Available: MemAvailable
(never MemFree: page cache left by an earlier run is reclaimable and must not
cause a refusal) plus, on a ZFS host, the ARC above its minimum (a cache MemAvailable leaves out though
ZFS shrinks it under pressure; less SReclaimable, since OpenZFS 2.3 accounts part of the ARC as
reclaimable slab, which MemAvailable may already count: never counted twice), and inside a limited memory
cgroup the least headroom of any level above us (the limit less what is charged and not reclaimable file cache).
If none of that can be read the check is skipped and says "headroom unknown":
a preflight must never stop a boot for lack of data.

A region is a file: its memfd's ftruncate and writes obey RLIMIT_FSIZE (systemd's
LimitFSIZE=, a shell's ulimit -f), and a limit below the largest region would fail
staging with EFBIG ("File too large"; Python ignores SIGXFSZ) after the socket is up, and
exit 1 into a restart loop. So the soft limit is checked here too, and refused.

A table on reserved huge pages (hugetlb, pageplan.py) is counted apart: its region, rounded up to whole pages,
against the pool of its page size (free pages less those already reserved: pages a served generation holds are
not free, so a reload's new generation must fit beside it) within the hugetlb cgroup's headroom, never against
MemAvailable or the memory cgroup, which are not charged for those pages.
"""
from __future__ import annotations

import resource
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Final

from pled.daemon.memory import hostmem, hugetlb
from pled.daemon.memory.pageplan import human
from pled.shared import config_file
from pled.shared.errors import PreflightRefused
from pled.shared.sizes import gib


@dataclass(frozen=True)
class Verdict:
    ok: bool
    needed: int  # tables only
    margin: int
    available: int | None  # None: headroom unknown
    meminfo: hostmem.MemInfo | None
    cgroup: hostmem.MemoryCgroup | None
    tables: dict[str, int]
    message: str
    problems: tuple[str, ...] = ()  # files that could not be read
    file_size_limit: int | None = None  # soft RLIMIT_FSIZE in bytes; None: unlimited
    zfs_arc: hostmem.ZfsArc | None = None
    zfs_arc_counted: int = 0  # bytes of the ARC counted as available beside MemAvailable
    hugetlb: tuple[HugeVerdict, ...] = ()  # one per page size some table is to be staged on

    def as_dict(self) -> dict:
        binding = self.cgroup.binding if self.cgroup else None
        return {
            "ok": self.ok,
            "needed_bytes": self.needed,
            "headroom_margin_bytes": self.margin,
            "available_bytes": self.available,
            "mem_available_bytes": self.meminfo.available if self.meminfo else None,
            "cgroup": None if binding is None else {
                "version": binding.version, "path": binding.path, "limit_bytes": binding.limit,
                "usage_bytes": binding.usage, "reclaimable_bytes": binding.reclaimable,
                "headroom_bytes": binding.headroom,
            },
            "tables": self.tables,
            "message": self.message,
            "problems": list(self.problems),
            "file_size_limit_bytes": self.file_size_limit,
            "zfs_arc": None if self.zfs_arc is None else {
                "size_bytes": self.zfs_arc.size, "c_min_bytes": self.zfs_arc.c_min,
                "counted_bytes": self.zfs_arc_counted},
            "hugetlb": [h.as_dict() for h in self.hugetlb],
        }

    def raise_if_refused(self) -> None:
        if not self.ok:
            if self.file_size_limit is not None and max(self.tables.values(), default=0) > self.file_size_limit:
                raise PreflightRefused(self.message, max(self.tables.values()), self.file_size_limit)
            short = next((h for h in self.hugetlb if not h.ok), None)
            if short is not None and self.available is not None and self.needed + self.margin <= self.available:
                raise PreflightRefused(self.message, short.needed, short.available or 0)
            raise PreflightRefused(self.message, self.needed + self.margin, self.available or 0)


@dataclass(frozen=True)
class HugeVerdict:
    """The tables on one size of reserved huge pages against that size's pool and hugetlb cgroup."""

    page_size: int
    tables: dict[str, int]  # name -> region bytes, whole pages
    unrounded: dict[str, int]  # name -> region bytes as planned on 2 MiB boundaries
    available: int | None  # None: the pool could not be read
    pool: hugetlb.Pool | None
    message: str

    @property
    def needed(self) -> int:
        return sum(self.tables.values())

    @property
    def ok(self) -> bool:
        return self.available is None or self.needed <= self.available

    def as_dict(self) -> dict:
        p = self.pool
        binding = p.cgroup.binding if p and p.cgroup else None
        return {"page_size_bytes": self.page_size, "tables": self.tables, "needed_bytes": self.needed,
                "available_bytes": self.available, "pool": None if p is None else {
                    "pages": p.total, "free": p.free, "reserved": p.reserved, "surplus": p.surplus},
                "cgroup": None if binding is None else {"path": binding.path, "limit_bytes": binding.limit,
                                                        "usage_bytes": binding.usage,
                                                        "headroom_bytes": binding.headroom},
                "ok": self.ok, "message": self.message}


def file_size_limit() -> int | None:
    """This process's soft RLIMIT_FSIZE in bytes, None when unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def _fsize_refusal(tables: dict[str, int], limit: int | None) -> str | None:
    """Why the largest region cannot be written under ``limit``, or None when it can."""
    if limit is None or not tables:
        return None
    name, largest = max(tables.items(), key=lambda item: item[1])
    if largest <= limit:
        return None
    return (f"pled needs to write a region of {gib(largest)} ({largest} bytes) for table {name} but this process's "
            f"file size limit (RLIMIT_FSIZE) is {gib(limit)} ({limit} bytes); raise LimitFSIZE= in the unit, "
            f"or ulimit -f in the shell that starts pled")


def _what(tables: dict[str, int]) -> str:
    if not tables:
        return "no table on shared memory"
    if len(tables) == 1:
        (name,) = tables
        return f"table {name}"
    return "tables " + ", ".join(f"{n} ({gib(b)})" for n, b in tables.items())


class _Default(Enum):
    READ = "read from this process"


_READ: Final = _Default.READ


def check(tables: dict[str, int], margin: int, root: str = "/", fsize_limit: int | None | _Default = _READ,
          huge: dict[str, tuple[int, int]] | None = None) -> Verdict:
    """Compare the bytes these tables need with what this process can have (memory, and the file size limit:
    ``fsize_limit`` in bytes, None for unlimited, read from this process by default). ``huge``: the tables of
    ``tables`` to be staged on reserved huge pages, name -> (page size, bytes before rounding to whole pages);
    they are counted against their pools, not memory."""
    limit = file_size_limit() if fsize_limit is _READ else fsize_limit
    huge = huge or {}
    verdict = _check_memory({n: b for n, b in tables.items() if n not in huge}, margin, root)
    sizes = sorted({page_size for page_size, _ in huge.values()})
    pools = tuple(_check_hugetlb(size, {n: tables[n] for n, (s, _) in huge.items() if s == size},
                                 {n: b for n, (s, b) in huge.items() if s == size}, root) for size in sizes)
    refusals = "; and ".join(h.message for h in pools if not h.ok)
    verdict = replace(verdict, tables=dict(tables), hugetlb=pools)
    if refusals:
        verdict = replace(verdict, ok=False, message=refusals if verdict.ok else f"{verdict.message}; and {refusals}")
    elif pools and verdict.ok:  # "preflight passed: ..." of shared memory (or only the margin), then each pool
        memory = verdict.message if len(huge) < len(tables) else f"preflight passed: hugetlb: {pools[0].message}"
        rest = [h.message for h in (pools if len(huge) < len(tables) else pools[1:])]
        margin_note = f"; headroom_margin {gib(margin)} of {gib(verdict.available)} free" \
            if margin and len(huge) == len(tables) and verdict.available is not None else ""
        verdict = replace(verdict, message="; hugetlb: ".join([memory, *rest]) + margin_note)
    refusal = _fsize_refusal(tables, limit)
    if refusal is not None:
        also = "" if verdict.ok else f"; and {verdict.message}"
        return replace(verdict, ok=False, message=refusal + also, file_size_limit=limit)
    return replace(verdict, file_size_limit=limit)


def _check_hugetlb(page_size: int, tables: dict[str, int], unrounded: dict[str, int], root: str) -> HugeVerdict:
    """These tables' whole pages of ``page_size`` against its pool and hugetlb cgroup."""
    size = human(page_size)
    needed = sum(tables.values())
    rounded = [f"{n}'s {gib(unrounded[n])} rounded up to {gib(b)}" for n, b in tables.items() if b > unrounded[n]]
    what = f"{_what(tables)} on {size} huge pages ({needed // page_size:,} pages"
    what += f"; {', '.join(rounded)}: whole pages)" if rounded else ")"
    try:
        pool = hugetlb.pool(page_size, root)
    except hostmem.HostInfoUnavailable as err:
        return HugeVerdict(page_size, tables, unrounded, None, None,
                           f"hugetlb headroom unknown ({err}); skipping the check of {gib(needed)} for {what}")
    available = pool.available if pool else 0
    binding = pool.cgroup.binding if pool and pool.cgroup else None
    where = (f"the {size} pool: {pool.available_pages:,} of {pool.total:,} pages free and not reserved"
             if pool else f"this kernel has no {size} pool")
    if binding is not None and pool is not None and binding.headroom < pool.available_pages * page_size:
        where += (f"; hugetlb cgroup {binding.path} allows {gib(binding.headroom)} more "
                  f"(limit {gib(binding.limit)}, {gib(binding.usage)} used)")
    if needed <= available:
        return HugeVerdict(page_size, tables, unrounded, available, pool,
                           f"{gib(needed)} for {what}, {gib(available)} available ({where})")
    if binding is not None and pool is not None and binding.headroom < needed <= pool.available_pages * page_size:
        name = hugetlb.size_name(page_size)
        fix = f"raise the hugetlb cgroup's limit (hugetlb.{name}.limit_in_bytes, or hugetlb.{name}.max on cgroup v2)"
    else:
        short = -(-(needed - available) // page_size)
        total = (pool.total if pool else 0) + short
        fix = (f"reserve {short:,} more: echo {total} > /sys/kernel/mm/hugepages/hugepages-{page_size // 1024}kB/"
               f"nr_hugepages ({config_file.DOCS}/operations.md, Huge pages)")
    return HugeVerdict(page_size, tables, unrounded, available, pool,
                       f"pled needs {gib(needed)} for {what} but only {gib(available)} "
                       f"({available // page_size:,} pages) is available to this service ({where}); {fix}, "
                       f"or set huge_pages = \"prefer-hugetlb\" to fall back to shared memory")


def _check_memory(tables: dict[str, int], margin: int, root: str) -> Verdict:
    """Compare the bytes these tables need with the memory this process can have."""
    problems: list[str] = []
    meminfo = cgroup = arc = None
    try:
        meminfo = hostmem.read_meminfo(root)
    except hostmem.HostInfoUnavailable as err:
        problems.append(str(err))
    try:
        arc = hostmem.read_zfs_arc(root)
    except hostmem.HostInfoUnavailable as err:
        problems.append(str(err))
    try:
        cgroup = hostmem.read_cgroup(root)
    except hostmem.HostInfoUnavailable as err:
        problems.append(str(err))
    needed = sum(tables.values())
    binding = cgroup.binding if cgroup else None
    arc_counted = max(0, arc.reclaimable - meminfo.slab_reclaimable) if arc and meminfo else 0
    host = meminfo.available + arc_counted if meminfo else None
    candidates = [x for x in (host, binding.headroom if binding else None) if x is not None]
    found: dict[str, Any] = {"zfs_arc": arc, "zfs_arc_counted": arc_counted}
    if not candidates:
        why = "; ".join(problems) or "no /proc/meminfo and no memory cgroup"
        return Verdict(True, needed, margin, None, meminfo, cgroup, tables,
                       f"headroom unknown ({why}); skipping the memory check for {gib(needed)}", tuple(problems),
                       **found)
    available = min(candidates)
    if binding is not None and binding.headroom <= available:
        where = f"cgroup limit {gib(binding.limit)}"
        if binding.path != (cgroup.path if cgroup else None):
            where += f" on {binding.path}"
    elif meminfo is None:
        where = "MemAvailable unknown"
    elif arc is not None:
        where = (f"MemAvailable {gib(meminfo.available)} + ZFS ARC {gib(arc_counted)}: its size {gib(arc.size)} "
                 f"less its minimum {gib(arc.c_min)} and SReclaimable {gib(meminfo.slab_reclaimable)}")
    else:
        where = f"MemAvailable {gib(meminfo.available)}"
    plus = f" plus {gib(margin)} headroom_margin" if margin else ""
    if needed + margin > available:
        message = (
            f"pled needs {gib(needed)} for {_what(tables)}{plus} but only {gib(available)} is available "
            f"to this service ({where}); free memory, raise the limit (MemoryMax= in the unit; --memory or "
            f"resources.limits.memory in a container), "
            f"lower headroom_margin, or stage fewer tables"
        )
        return Verdict(False, needed, margin, available, meminfo, cgroup, tables, message, tuple(problems), **found)
    message = f"preflight passed: {gib(needed)} for {_what(tables)}{plus}, {gib(available)} available ({where})"
    return Verdict(True, needed, margin, available, meminfo, cgroup, tables, message, tuple(problems), **found)
