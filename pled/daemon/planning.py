"""From a config to planned regions: open every table's files, refuse one staged twice, plan, preflight.

Used by ``pled serve`` at start, by a reload (in a worker thread, never the loop's: reading headers can be
slow) and by ``pled preflight``, which imports this and not the daemon. Everything here reads headers
only, and raises a PledError that names the file, the table or the config key.
"""
from __future__ import annotations

from dataclasses import dataclass

from pled.daemon import config as config_mod, preflight
from pled.daemon.config import Config
from pled.daemon.sidecar import Sidecar, open_table
from pled.shared import region
from pled.shared.boundary import clip
from pled.shared.errors import ConfigError, PledError


def open_tables(config: Config) -> dict[str, Sidecar]:
    if not config.tables:
        raise ConfigError(config.source, "no [[table]] configured; add one with a name and a path")
    sidecars = {}
    for t in config.tables:
        try:
            sidecars[t.name] = open_table(t.path)
        except PledError as e:  # its file and problem, and which table (of several a reload may change) it is
            e.args = (f"table {clip(t.name)}: {e}",)
            raise
    check_distinct(config, sidecars)
    return sidecars


def check_distinct(config: Config, sidecars: dict[str, Sidecar]) -> None:
    """Refuse two tables that hold the same file (``dir``, ``dir/``, a glob of it, a symlink to it).

    Refused rather than served as one region under both names: each name has its own generations, its own
    entry in systemd's fd store and its own reload, which one shared region cannot keep apart. Serving one
    copy is what pled is for; name it once, and point every client at that name."""
    owner: dict[tuple[int, int], tuple[str, str]] = {}
    for name, sidecar in sidecars.items():
        for shard in sidecar.shards:
            key = (shard.dev, shard.ino)
            if key in owner and owner[key][0] != name:
                other, path = owner[key]
                raise ConfigError(config.source, f"tables {other} and {name} both hold {path} (as {shard.path}): "
                                                 "it would be staged twice, in twice the memory; keep one of them")
            owner.setdefault(key, (name, shard.path))


def plan_tables(sidecars: dict[str, Sidecar]) -> dict[str, region.Manifest]:
    return {name: region.plan(name, s) for name, s in sidecars.items()}


def run_preflight(config: Config, manifests: dict[str, region.Manifest], proc_root: str = "/") -> preflight.Verdict:
    """Will these planned regions fit? Their exact sizes against what this process can have."""
    return preflight.check({name: m.region_bytes for name, m in manifests.items()}, config.headroom_margin, proc_root)


@dataclass(frozen=True)
class ReloadPlan:
    config: Config
    fresh: dict[str, tuple[Sidecar, region.Manifest]]  # new or changed tables, to stage
    unchanged: list[str]
    removed: list[str]
    verdict: preflight.Verdict | None


def plan_reload(source: str, served: dict[str, region.Manifest], proc_root: str = "/") -> ReloadPlan:
    """Re-read the config at ``source`` and compare its tables with ``served`` (name -> identity of the served
    manifest). Runs off the loop thread; raises PledError when the reload must change nothing."""
    config = config_mod.load(source)
    sidecars = open_tables(config)
    fresh, unchanged = {}, []
    for name, sidecar in sidecars.items():
        planned = region.plan(name, sidecar)
        if name in served and served[name] == planned.identity():
            unchanged.append(name)
        else:
            fresh[name] = (sidecar, planned)
    verdict = None
    if fresh:
        verdict = run_preflight(config, {n: m for n, (_, m) in fresh.items()}, proc_root)
        verdict.raise_if_refused()
    return ReloadPlan(config, fresh, unchanged, [n for n in served if n not in sidecars], verdict)


