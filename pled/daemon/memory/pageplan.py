"""Which pages each table gets, and on which NUMA nodes: the config's huge_pages, huge_page_size and numa, checked
against this host and decided per table before anything is copied.

    huge_pages = "auto"            shared memory (shmem): transparent huge pages where shmem_enabled allows them,
                                   else 4 KiB (staging.plan_fill); a reserved pool is never taken unasked
    huge_pages = "off"             shmem on 4 KiB pages
    huge_pages = "hugetlb"         reserved huge pages (hugetlb.py), required: without room the preflight refuses
    huge_pages = "prefer-hugetlb"  reserved huge pages where the pool has room, else as "auto" (PostgreSQL's "try")
    huge_page_size = "2M" | "1G"   the hugetlb page size; default: the largest offered whose pool has room
    numa = "interleave" | "local" | [node, ...]   default: interleave over every node with memory

A [[table]] may give each key for itself, overriding the global one. ``resolve`` checks the settings against the
host (a ConfigError names the file and the key: a page size the kernel does not offer, a node without memory,
"hugetlb" where this process cannot make a hugetlb memfd). ``decide`` gives each table to stage its PagePlan, in
config order, counting the pages each hugetlb table takes from its pool (free less reserved, within the hugetlb
cgroup's headroom: ``hugetlb.Pool.available``) so that two tables never count the same pages. ``mismatch`` says why
a region made before (kept in systemd's fd store, or a generation a reload would keep) is not on the pages the
config asks for now. ``status_fields`` is what Status says of a region's pages, read from the memfd itself.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from pled.daemon.config import Config, page_size_bytes
from pled.daemon.memory import hugetlb, numa
from pled.daemon.memory.hostmem import HostInfoUnavailable
from pled.shared import config_file, pagecache
from pled.shared.errors import ConfigError
from pled.shared.hugepages import PMD_SIZE
from pled.shared.region import align
from pled.shared.sizes import gib

SHMEM = {"auto": "4 KiB/THP pages as shmem_enabled allows (huge_pages = \"auto\")",
         "off": "4 KiB pages (huge_pages = \"off\")"}


def human(page_size: int) -> str:
    """2097152 -> "2 MiB", as logs and Status write a page size."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if page_size >= scale:
            return f"{page_size // scale} {unit}"
    return f"{page_size // 1024} KiB"


def config_text(page_size: int) -> str:
    """2097152 -> "2M", as huge_page_size is written."""
    return human(page_size).replace(" ", "")[:-2]


@dataclass(frozen=True)
class NumaPolicy:
    mode: int  # numa.MPOL_INTERLEAVE, MPOL_BIND or MPOL_LOCAL
    nodes: tuple[int, ...]  # () for local
    host_nodes: tuple[int, ...]  # the nodes with memory on this host
    refused: str = ""  # why placement cannot be applied here (the default policy only; a set one is refused, 78)

    @property
    def label(self) -> str:
        """As numa_maps writes it: "interleave:0-1", "bind:0", "local"."""
        if self.mode == numa.MPOL_LOCAL:
            return "local"
        word = "interleave" if self.mode == numa.MPOL_INTERLEAVE else "bind"
        return f"{word}:{numa.format_nodelist(self.nodes)}"

    def describe(self) -> str:
        if self.refused:
            return f"NUMA not placed: {self.refused}"
        if len(self.host_nodes) > 1:
            return f"NUMA {self.label}"
        return f"NUMA {self.label} (one node with memory here: applied, but placement changes nothing)"


@dataclass(frozen=True)
class Placement:
    """One table's settings, resolved (its own keys over the global ones) and checked against the host."""

    mode: str  # huge_pages
    mode_key: str  # where it was set: "huge_pages" or "table[2].huge_pages"
    page_size: int | None  # huge_page_size in bytes; None: the largest offered with room
    numa: NumaPolicy


@dataclass(frozen=True)
class PagePlan:
    """What a table to stage gets: hugetlb pages of ``page_size``, or shmem (``page_size`` 0), and why."""

    mode: str  # the huge_pages that applied
    page_size: int  # bytes of a hugetlb page; 0: shmem (4 KiB pages, or THP where shmem_enabled allows)
    reason: str
    numa: NumaPolicy

    @property
    def hugetlb(self) -> bool:
        return self.page_size > 0

    @property
    def shmem_mode(self) -> str:
        """staging.plan_fill's setting for a shmem region: "off", or "auto" (prefer-hugetlb without room too)."""
        return "off" if self.mode == "off" else "auto"

    def describe(self) -> str:
        """The log line's text after "table NAME: "."""
        return f"{self.reason}; {self.numa.describe()}"


def resolve(config: Config, root: str = "/") -> dict[str, Placement]:
    """Every table's settings, checked against this host; ConfigError (78) naming the file and the key."""
    offered = hugetlb.page_sizes(root)
    with_memory = tuple(numa.nodes_with_memory(root))
    source = config.source
    sizes = {None: _page_size(config.huge_page_size, "huge_page_size", offered, source)}
    policy = _numa(config.numa, "numa", with_memory, source)
    set_at = ["numa"] * (config.numa is not None) + [f"table[{i}].numa" for i, t in enumerate(config.tables)
                                                      if t.numa is not None]
    refused = numa.refused() if root == "/" else ""
    if refused and set_at:
        raise ConfigError(source, f"key {set_at[0]}: NUMA placement is asked for, but {refused}; allow mbind and "
                                  "set_mempolicy (the unit's SystemCallFilter=), or leave numa out")
    policy = replace(policy, refused=refused)
    out = {}
    for i, t in enumerate(config.tables):
        key = f"table[{i}]"
        mode, mode_key = (t.huge_pages, f"{key}.huge_pages") if t.huge_pages else (config.huge_pages, "huge_pages")
        size = (_page_size(t.huge_page_size, f"{key}.huge_page_size", offered, source) if t.huge_page_size
                else sizes[None])
        if mode == "hugetlb" and (why := unusable(size, offered, root)):
            raise ConfigError(source, f"key {mode_key}: \"hugetlb\" for table {t.name}, but {why}; reserve huge "
                                      f"pages ({config_file.DOCS}/operations.md, Huge pages) or use "
                                      "\"prefer-hugetlb\" or \"auto\"")
        out[t.name] = Placement(mode, mode_key, size,
                                policy if t.numa is None else _numa(t.numa, f"{key}.numa", with_memory, source))
    return out


def _page_size(text: str | None, key: str, offered: list[int], source: str) -> int | None:
    if text is None:
        return None
    size = page_size_bytes(text)
    if size not in offered:
        sizes = ", ".join(f'"{config_text(s)}"' for s in offered) or "none (no hugetlb in this kernel)"
        raise ConfigError(source, f"key {key}: \"{text}\" is not a huge page size this kernel offers; it offers "
                                  f"{sizes}")
    return size


def _numa(value, key: str, with_memory: tuple[int, ...], source: str) -> NumaPolicy:
    if value is None or value == "interleave":
        return NumaPolicy(numa.MPOL_INTERLEAVE, with_memory, with_memory)
    if value == "local":
        return NumaPolicy(numa.MPOL_LOCAL, (), with_memory)
    missing = [n for n in value if n not in with_memory]
    if missing:
        raise ConfigError(source, f"key {key}: node {missing[0]} has no memory on this host (nodes with memory: "
                                  f"{numa.format_nodelist(with_memory) or 'none listed'})")
    return NumaPolicy(numa.MPOL_BIND, tuple(sorted(value)), with_memory)


def unusable(page_size: int | None, offered: list[int], root: str = "/") -> str:
    """Why this process cannot have hugetlb memfds of ``page_size`` (None: any offered), or "" where it can. On the
    real host (``root`` "/") an empty one is made and closed: no page is taken, but a kernel or a seccomp filter that
    refuses them says so now, not while staging."""
    if not offered:
        return "this kernel has no huge page pools (no /sys/kernel/mm/hugepages)"
    if root != "/":
        return ""
    try:
        os.close(os.memfd_create("pled-probe", hugetlb.memfd_flags(page_size or offered[-1])))
    except OSError as err:
        return f"this process may not make a hugetlb memfd (memfd_create: {err.strerror})"
    return ""


class _Pools:
    """The pools of every offered size, read once, less what the tables decided so far take."""

    def __init__(self, root: str) -> None:
        self.offered = hugetlb.page_sizes(root)
        self.root = root
        self.left: dict[int, int | None] = {}  # bytes still available; None: the pool cannot be read
        self.pools: dict[int, hugetlb.Pool | None] = {}
        self.taken: dict[int, int] = {}  # bytes the tables decided so far take
        self.unread: dict[int, str] = {}  # why a pool could not be read

    def room(self, page_size: int) -> int | None:
        if page_size not in self.left:
            try:
                pool = self.pools[page_size] = hugetlb.pool(page_size, self.root)
            except HostInfoUnavailable as err:
                self.left[page_size], self.unread[page_size] = None, f"pool cannot be read ({err})"
                return None
            self.left[page_size] = pool.available if pool else 0
        return self.left[page_size]

    def read(self, page_size: int) -> str:
        """How the pool stands for the next table, for the log: "pool has 1,024 free", and what limits it."""
        if page_size in self.unread:
            return self.unread[page_size]
        pool, left = self.pools.get(page_size), self.left.get(page_size) or 0
        text = f"pool has {left // page_size:,} free"
        if page_size in self.taken:
            text += f" after the tables before it ({self.taken[page_size] // page_size:,} taken)"
        binding = pool.cgroup.binding if pool and pool.cgroup else None
        if binding is not None and binding.headroom < (pool.available_pages if pool else 0) * page_size:
            text += f", within hugetlb cgroup {binding.path}'s limit"
        return text

    def take(self, page_size: int, nbytes: int) -> None:
        left = self.left.get(page_size)
        self.taken[page_size] = self.taken.get(page_size, 0) + nbytes
        if left is not None:
            self.left[page_size] = left - nbytes


def decide(placements: dict[str, Placement], sizes: dict[str, int], root: str = "/") -> dict[str, PagePlan]:
    """A PagePlan for each table of ``sizes`` (name -> its region's bytes as planned on 2 MiB boundaries), in that
    order; a hugetlb table's pages are taken from what its pool has left for the next one."""
    pools = _Pools(root)
    plans = {}
    for name, size in sizes.items():
        p = placements[name]
        plans[name] = _decide_one(p, size, pools)
    return plans


def _decide_one(p: Placement, size: int, pools: _Pools) -> PagePlan:
    if p.mode in SHMEM:
        return PagePlan(p.mode, 0, SHMEM[p.mode], p.numa)
    candidates = [p.page_size] if p.page_size else sorted(pools.offered, reverse=True)
    short = []
    for page_size in candidates:
        need, room = align(size, page_size), pools.room(page_size)
        # An unreadable pool: "hugetlb" tries it (a short pool fails at once, never halfway), "prefer" does not.
        if (room is None and p.mode == "hugetlb") or (room is not None and need <= room):
            rounded = f"; {gib(size)} rounded up to {gib(need)}, whole pages" if need > size else ""
            reason = (f"hugetlb {human(page_size)} pages (huge_pages = \"{p.mode}\", {pools.read(page_size)}, "
                      f"needs {need // page_size:,}{rounded})")
            pools.take(page_size, need)
            return PagePlan(p.mode, page_size, reason, p.numa)
        short.append(f"the {human(page_size)} {pools.read(page_size)}, needs {need // page_size:,}")
    why = "; ".join(short) or "this kernel offers no huge pages"
    if p.mode == "prefer-hugetlb":
        return PagePlan(p.mode, 0, f"4 KiB/THP pages as \"auto\": {why} (huge_pages = \"prefer-hugetlb\")", p.numa)
    page_size = p.page_size or max(pools.offered, key=lambda s: (pools.left.get(s) or 0, -s), default=PMD_SIZE)
    return PagePlan(p.mode, page_size, f"hugetlb {human(page_size)} pages (huge_pages = \"hugetlb\"): {why}",
                    p.numa)


def mismatch(p: Placement, page_size: int, size: int, root: str = "/") -> str:
    """Why a region on ``page_size`` pages (0: shmem) is not what ``p`` asks for now ("" where it is): what
    adoption and a reload check before keeping a region. ``size``: its bytes as planned on 2 MiB boundaries."""
    if p.mode in SHMEM:
        return f"it is on hugetlb {human(page_size)} pages, huge_pages = \"{p.mode}\" asks for shared memory" \
            if page_size else ""
    if page_size:
        if p.page_size and p.page_size != page_size:
            return f"it is on {human(page_size)} pages, huge_page_size asks for {human(p.page_size)}"
        return ""
    if p.mode == "hugetlb":
        return "it is on 4 KiB/THP pages, huge_pages = \"hugetlb\" asks for reserved huge pages"
    plan = _decide_one(p, size, _Pools(root))
    return f"it is on 4 KiB/THP pages and the pool has room now: {plan.reason}" if plan.hugetlb else ""


def page_size_of(fd: int) -> int:
    """A region's hugetlb page size, 0 for a shmem one: what ``mismatch`` compares."""
    return pagecache.page_size(fd) if pagecache.is_hugetlb(fd) else 0


def status_fields(fd: int, region_bytes: int, stats, plan: PagePlan | None) -> dict:
    """Status's page keys for a region, read from the memfd (adopted ones too): ``huge_page_bytes``,
    ``page_size``, ``page_size_bytes``, ``huge_page_policy``, ``huge_page_note``, ``numa`` (its ``not_placed``:
    why pled applied no policy, the kernel refusing the calls). ``stats``: the staging's StageStats (None:
    adopted); ``plan``: the PagePlan it was to be staged on (None: adopted)."""
    plan = getattr(stats, "pages", None) or plan  # what it got: a fallback at staging included
    size = page_size_of(fd)
    try:
        seen: numa.Survey | None = numa.survey(fd, region_bytes)
        unseen = ""
    except OSError as err:
        seen, unseen = None, f"not measured ({err.strerror or err})"
    note = plan.reason if plan is not None and plan.mode == "prefer-hugetlb" and not plan.hugetlb else ""
    if size:
        out: dict = {"huge_page_bytes": pagecache.hugetlb_bytes(fd), "page_size_bytes": size,
                     "huge_page_policy": "hugetlb"}
    elif stats is not None:
        out = {"huge_page_bytes": stats.huge_bytes, "page_size_bytes": PMD_SIZE if stats.huge_bytes else 4096,
               "huge_page_policy": stats.fill.policy}
        note = "; ".join(filter(None, (note, stats.fill.note)))
    elif seen is not None:  # adopted shared memory: its huge-page share from the pages surveyed
        out = {"huge_page_bytes": min(region_bytes, align(int(seen.huge_share * region_bytes), PMD_SIZE)),
               "page_size_bytes": PMD_SIZE if seen.huge_share >= 0.9 else 4096, "huge_page_policy": "adopted"}
    else:
        out = {"huge_page_bytes": None, "page_size_bytes": None, "huge_page_policy": "adopted"}
    out["page_size"] = human(out["page_size_bytes"]) if out["page_size_bytes"] else None
    out["huge_page_note"] = note
    not_placed = (plan.numa.refused or None) if plan is not None else None  # why no policy was applied
    if seen is None:
        out["numa"] = {"policy": None, "bytes_per_node": None, "measured": unseen, "not_placed": not_placed}
        return out
    # A hugetlb memfd keeps no policy of its own: its pages were placed by the one pled staged it with.
    policy = (getattr(stats, "numa", "") or None) if size else seen.policy
    out["numa"] = {"policy": policy, "bytes_per_node": {str(n): b for n, b in sorted(seen.bytes_per_node.items())},
                   "measured": "every page" if seen.sampled >= region_bytes else
                   f"estimated from {gib(seen.sampled)} of pages spread over the region", "not_placed": not_placed}
    return out
