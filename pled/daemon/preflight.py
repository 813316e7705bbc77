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
"""
from __future__ import annotations

import resource
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Final

from pled.daemon import hostmem
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
        }

    def raise_if_refused(self) -> None:
        if not self.ok:
            if self.file_size_limit is not None and max(self.tables.values(), default=0) > self.file_size_limit:
                raise PreflightRefused(self.message, max(self.tables.values()), self.file_size_limit)
            raise PreflightRefused(self.message, self.needed + self.margin, self.available or 0)


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
    if len(tables) == 1:
        (name,) = tables
        return f"table {name}"
    return "tables " + ", ".join(f"{n} ({gib(b)})" for n, b in tables.items())


class _Default(Enum):
    READ = "read from this process"


_READ: Final = _Default.READ


def check(tables: dict[str, int], margin: int, root: str = "/", fsize_limit: int | None | _Default = _READ) -> Verdict:
    """Compare the bytes these tables need with what this process can have (memory, and the file size limit:
    ``fsize_limit`` in bytes, None for unlimited, read from this process by default)."""
    limit = file_size_limit() if fsize_limit is _READ else fsize_limit
    verdict = _check_memory(tables, margin, root)
    refusal = _fsize_refusal(tables, limit)
    if refusal is not None:
        also = "" if verdict.ok else f"; and {verdict.message}"
        return replace(verdict, ok=False, message=refusal + also, file_size_limit=limit)
    return replace(verdict, file_size_limit=limit)


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
            f"to this service ({where}); free memory, raise the limit (MemoryMax= in the unit), "
            f"lower headroom_margin, or stage fewer tables"
        )
        return Verdict(False, needed, margin, available, meminfo, cgroup, tables, message, tuple(problems), **found)
    message = f"preflight passed: {gib(needed)} for {_what(tables)}{plus}, {gib(available)} available ({where})"
    return Verdict(True, needed, margin, available, meminfo, cgroup, tables, message, tuple(problems), **found)
