"""From a config to planned regions: open every table's files, refuse one staged twice, plan, preflight.

Used by ``pled serve`` at start, by a reload (in a worker thread, never the loop's: reading headers can be
slow) and by ``pled preflight``, which imports this and not the daemon. Everything here reads headers
only, and raises a PledError that names the file, the table or the config key.

Each table is planned on 2 MiB boundaries first (``plan_tables``); the pages it will be staged on (pageplan.py:
shared memory, or reserved huge pages of some size) are decided for the tables left to stage, and a hugetlb
table's plan is then rounded up to whole pages (``Manifest.paged``), the size the preflight counts.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pled.daemon import config as config_mod
from pled.daemon.config import Config
from pled.daemon.health import journal
from pled.daemon.memory import pageplan, preflight
from pled.daemon.memory.pageplan import PagePlan
from pled.daemon.sources.checkpoint import Source, open_checkpoint
from pled.daemon.sources.sidecar import open_table
from pled.shared import region
from pled.shared.boundary import clip
from pled.shared.errors import ConfigError, PledError, SidecarError

log = logging.getLogger(__name__)


def open_tables(config: Config) -> dict[str, Source]:
    if not config.tables:
        raise ConfigError(config.source, "no [[table]] configured; add one with a name and a path")
    sidecars: dict[str, Source] = {}
    for t in config.tables:
        try:
            sidecars[t.name] = open_table(t.path) if t.path is not None else open_checkpoint(str(t.checkpoint))
        except PledError as e:  # its file and problem, and which table (of several a reload may change) it is
            e.args = (f"table {clip(t.name)}: {e}",)
            e.table = t.name
            raise
    check_distinct(config, sidecars)
    return sidecars


def check_distinct(config: Config, sidecars: dict[str, Source]) -> None:
    """Refuse two tables that hold the same file (``dir``, ``dir/``, a glob of it, a symlink to it), whole or its
    PLE tensors (a ``checkpoint`` table).

    Refused rather than served as one region under both names: each name has its own generations, its own
    entry in systemd's fd store and its own reload, which one shared region cannot keep apart. Serving one
    copy is what pled is for; name it once, and point every client at that name."""
    owner: dict[tuple[int, int], tuple[str, str]] = {}
    for name, sidecar in sidecars.items():
        for shard in sidecar.shards:
            key = (shard.dev, shard.ino)
            if key in owner and owner[key][0] != name:
                other, path = owner[key]
                how = ("its PLE tables would be in memory twice; serve the checkpoint's other files with a "
                       "narrower path, or keep one table" if sidecar.arrays or sidecars[other].arrays
                       else "it would be staged twice, in twice the memory; keep one of them")
                raise ConfigError(config.source, f"tables {other} and {name} both hold {path} (as {shard.path}): "
                                                 + how)
            owner.setdefault(key, (name, shard.path))


def plan_tables(sidecars: dict[str, Source]) -> dict[str, region.Manifest]:
    return {name: plan_table(name, s) for name, s in sidecars.items()}


def plan_table(name: str, source: Source) -> region.Manifest:
    """The table's region as ``region.plan`` places it, refused (78) where its manifest is larger than a client
    reads (region.MAX_MANIFEST): every client would refuse the region pled staged."""
    manifest = region.plan(name, source)
    try:  # what every client checks before it maps the region (arrays or tensors over each other...): never staged
        region.check(manifest)
    except ValueError as err:
        raise SidecarError(source.source, f"table {clip(name)}: its region's plan {err}, which every client "
                                          f"refuses; check the table's files with `pled inspect`") from None
    length = len(manifest.to_json())
    if length > region.MAX_MANIFEST:
        raise SidecarError(source.source, f"table {clip(name)}: its {len(manifest.tensors):,} tensors take a "
                                          f"manifest of {length:,} bytes, and a client reads one of at most "
                                          f"{region.MAX_MANIFEST:,}: serve fewer files in one table")
    return manifest


def plan_pages(config: Config, manifests: dict[str, region.Manifest], proc_root: str = "/",
               log_as: str | None = None, placements: dict[str, pageplan.Placement] | None = None
               ) -> dict[str, PagePlan]:
    """The pages each of these tables (planned on 2 MiB boundaries) is to be staged on, each choice logged with its
    reason when ``log_as`` is given ("" at start, "reload: " in a reload). ConfigError for a setting this host
    refuses (pageplan.resolve)."""
    placements = pageplan.resolve(config, proc_root) if placements is None else placements
    pages = pageplan.decide(placements, {n: m.region_bytes for n, m in manifests.items()}, proc_root)
    for name, plan in pages.items() if log_as is not None else ():
        log.info("%stable %s: %s", log_as, name, plan.describe(), extra=journal.fields(table=name))
    return pages


def run_preflight(config: Config, manifests: dict[str, region.Manifest], proc_root: str = "/",
                  pages: dict[str, PagePlan] | None = None) -> preflight.Verdict:
    """Will these planned regions (on 2 MiB boundaries) fit on the pages decided for them (decided here when
    ``pages`` is None, as for `pled preflight`)? Their exact sizes against what this process can have: a hugetlb
    table's rounded up to whole pages, against its pool."""
    if pages is None:
        pages = plan_pages(config, manifests, proc_root)
    return preflight.check({name: m.paged(pages[name].page_size).region_bytes for name, m in manifests.items()},
                           config.headroom_margin, proc_root,
                           huge={n: (p.page_size, manifests[n].region_bytes) for n, p in pages.items() if p.hugetlb})


@dataclass(frozen=True)
class ReloadPlan:
    config: Config
    fresh: dict[str, tuple[Source, region.Manifest]]  # new or changed tables, to stage
    unchanged: list[str]
    removed: list[str]
    verdict: preflight.Verdict | None
    pages: dict[str, PagePlan] = field(default_factory=dict)  # the pages each fresh table is to be staged on


def plan_reload(source: str, served: dict[str, region.Manifest], proc_root: str = "/",
                served_pages: dict[str, int] | None = None,
                served_writable: frozenset[str] = frozenset()) -> ReloadPlan:
    """Re-read the config at ``source`` and compare its tables with ``served`` (name -> identity of the served
    manifest; ``served_pages``: name -> its region's hugetlb page size, 0 on shared memory; ``served_writable``: the
    tables served writable). A table is kept when its files, its pages and its gpu_access are what the config asks
    for now. Runs off the loop thread; raises PledError when the
    reload must change nothing."""
    config = config_mod.load(source)
    placements = pageplan.resolve(config, proc_root)
    sidecars = open_tables(config)
    fresh, unchanged = {}, []
    for name, sidecar in sidecars.items():
        planned = plan_table(name, sidecar)
        page_size = (served_pages or {}).get(name, 0)
        if name in served and served[name] == planned.paged(page_size).identity():
            why = pageplan.mismatch(placements[name], page_size, planned.region_bytes, proc_root)
            cfg = config.table(name)
            if not why and cfg is not None and cfg.writable != (name in served_writable):
                why = f"gpu_access is now \"{cfg.gpu_access}\""
            if not why:
                unchanged.append(name)
                continue
            log.info("reload: table %s is staged anew: %s", name, why, extra=journal.fields(table=name))
        fresh[name] = (sidecar, planned)
    verdict, pages = None, {}
    if fresh:
        manifests = {n: m for n, (_, m) in fresh.items()}
        pages = plan_pages(config, manifests, proc_root, log_as="reload: ", placements=placements)
        verdict = run_preflight(config, manifests, proc_root, pages)
        verdict.raise_if_refused()
        fresh = {n: (s, m.paged(pages[n].page_size)) for n, (s, m) in fresh.items()}
    return ReloadPlan(config, fresh, unchanged, [n for n in served if n not in sidecars], verdict, pages)


