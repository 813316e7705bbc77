"""A region's memfd, made on the pages and NUMA nodes planned for its table (pageplan.PagePlan).

Reserved huge pages (hugetlb): ``hugetlb.create`` allocates every page before the first byte is copied, so a
short pool or hugetlb cgroup fails at once (ENOMEM), never with a SIGBUS halfway through a shard. A hugetlb memfd
has no policy of its own and its fallocate allocates by the calling thread's, so the plan's NUMA policy is made the
staging thread's for that call (numa.thread_policy) and put back after.

Shared memory: the plan's policy is set with mbind on a short-lived mapping before the first page exists. It is the
memfd's own (kept in its inode): every page allocated later follows it, by sendfile, write or a fault through any
mapping, and every process that maps the region sees it in its numa_maps. Pages that existed before would stay
where they are, so it comes first.

A "prefer-hugetlb" table whose pool ran short between its planning and its staging (another program took the
pages) falls back to shared memory, as "auto" would, and says so; a "hugetlb" one fails with the pool's figures.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
from dataclasses import replace

from pled.daemon.memory import hugetlb, numa
from pled.daemon.memory.pageplan import PagePlan
from pled.shared.errors import StagingError
from pled.shared.pagecache import mapping_address

log = logging.getLogger(__name__)


def create(table: str, size: int, pages: PagePlan | None) -> tuple[int, PagePlan | None]:
    """The region's memfd of ``size`` bytes (owned by the caller) on the pages and nodes of ``pages``, and the plan
    it got. Without a plan: a shared-memory memfd and no NUMA policy (the benchmark's and the demo's)."""
    name = f"pled:{table}"
    policy = pages.numa if pages is not None and not pages.numa.refused else None
    if pages is not None and pages.hugetlb:
        try:
            with numa.thread_policy(policy.mode, policy.nodes) if policy else contextlib.nullcontext():
                return hugetlb.create(name, size, pages.page_size), pages
        except hugetlb.NoHugePages as err:
            why = err.strerror or str(err)
            if pages.mode != "prefer-hugetlb":
                raise StagingError(table, f"{why}; nothing was copied") from err
            log.warning("table %s: %s; staging it on 4 KiB/THP pages (huge_pages = \"prefer-hugetlb\")", table, why)
            pages = replace(pages, page_size=0, reason=f"4 KiB/THP pages as \"auto\": when staging, {why}")
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        if policy is not None and size:
            place(fd, size, policy.mode, policy.nodes)
    except BaseException:
        os.close(fd)
        raise
    return fd, pages


def place(fd: int, size: int, mode: int, nodes: tuple[int, ...]) -> None:
    """Make ``mode``/``nodes`` a shared-memory memfd's own NUMA policy, through a mapping closed at once."""
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        numa.mbind(mapping_address(m), size, mode, nodes)
    finally:
        m.close()
