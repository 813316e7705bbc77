"""The registry: the one owner of the tables pled serves, their generations and the config in force.

Only this module assigns them (tests/test_state_ownership.py checks the source); everything else reads them
through the registry, in the loop thread:

    open            at start: a TableState per configured table, adopted from systemd's fd store (ready) or
                    planned (to be staged); the generation each one gets
    staging_ended   every staging's end, the first one's or a reload's, along one path: the table's outcome
                    here (ready with its region, or failed), a served table that became ready handed to the
                    fd store, then the StagingOwner that asked for it decides what follows
    stage_next      a reload's new or changed tables, as the next generations of their names, staged beside
                    the served ones
    switch          a reload's commit: the next generations served, the old ones and the removed tables
                    released, the new config in force (but for its socket, bound until pled restarts)
    drop_next       a reload that failed: its next generations let go, nothing served changes
    release_all     at stop

A released generation's region is closed here; clients that hold its fd or map it keep it until they let go.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType

from pled.daemon.config import Config
from pled.daemon.events import Staged, StagingCancelled, StagingEnded, StagingFailed
from pled.daemon.health import journal
from pled.daemon.memory import pageplan
from pled.daemon.memory.pageplan import PagePlan
from pled.daemon.regions import staging
from pled.daemon.regions.planning import ReloadPlan
from pled.daemon.sources.checkpoint import Source
from pled.daemon.systemd.fdstore import Adopted, FdStore
from pled.daemon.tables import CopyProgress, State, TableState
from pled.shared.region import Manifest, Region
from pled.shared.sizes import gib

log = logging.getLogger(__name__)


class Registry:
    def __init__(self, config: Config, fdstore: FdStore, holders: Callable[[str, int], int]) -> None:
        """``holders(table, generation)``: how many connected clients are attached to that generation (logged
        when it is released)."""
        self._config = config
        self._fdstore = fdstore
        self._holders = holders
        self._served: dict[str, TableState] = {}
        self._next: dict[str, TableState] = {}  # a reload's new generations, staging beside the served ones

    @property
    def config(self) -> Config:
        return self._config

    @property
    def tables(self) -> Mapping[str, TableState]:
        """The served tables by name, in config order (a read-only view)."""
        return MappingProxyType(self._served)

    @property
    def next(self) -> Mapping[str, TableState]:
        """The next generations a reload is staging (a read-only view; empty when no reload stages)."""
        return MappingProxyType(self._next)

    def all_ready(self) -> bool:
        return all(t.state is State.READY for t in self._served.values())

    def identities(self) -> dict[str, Manifest]:
        """What each served table was planned from (its manifest without digests), for a reload to compare. A table
        the scheduled verify found modified (gpu_access = "writable") is left out: a reload stages it anew."""
        return {name: t.manifest.identity() for name, t in self._served.items() if t.modified is None}

    def writable(self) -> frozenset[str]:
        """The served tables whose regions are writable (not write-sealed), for a reload to compare with its config."""
        return frozenset(name for name, t in self._served.items() if t.writable)

    def page_sizes(self) -> dict[str, int]:
        """Each served table's hugetlb page size, 0 on shared memory (read from its memfd), for a reload to compare."""
        return {name: pageplan.page_size_of(t.region.fd) for name, t in self._served.items()
                if t.region is not None and not t.region.closed}

    # -- at start ----------------------------------------------------------------------------

    def open(self, sidecars: dict[str, Source], planned: dict[str, Manifest], stored: Adopted,
             pages: Mapping[str, PagePlan] = MappingProxyType({})) -> list[TableState]:
        """A table for each of ``sidecars``: adopted where systemd kept its region, else planned as the generation
        after any stored one, to be staged on its ``pages``. Returns the tables to stage, in config order."""
        for name, sidecar in sidecars.items():
            if name in stored.adopted:
                self._served[name] = self._adopted(name, sidecar, *stored.adopted[name])
            else:
                self._served[name] = TableState(name, sidecar, planned[name], stored.generations.get(name, 1),
                                                pages=pages.get(name))
        return [t for t in self._served.values() if t.state is not State.READY]

    @staticmethod
    def _adopted(name: str, sidecar: Source, region: Region, generation: int) -> TableState:
        manifest = region.manifest  # with the content digests computed when it was staged
        log.info("table %s adopted from systemd's fd store: generation %d, %s, 0 bytes copied, sources unchanged",
                 name, generation, gib(manifest.region_bytes), extra=journal.fields(table=name, generation=generation))
        return TableState(name, sidecar, manifest, generation, origin="adopted", region=region, outcome=State.READY,
                          copy=CopyProgress(shards_done=len(manifest.shards)))

    # -- every staging's end -----------------------------------------------------------------

    def staging_ended(self, event: StagingEnded) -> None:
        """Record how the table's staging ended, then tell the owner that asked for it."""
        t = event.table
        if self._served.get(t.name) is not t and self._next.get(t.name) is not t:
            self._orphaned(event)
            return
        match event:
            case Staged(region=region):
                t.region, t.manifest, t.outcome = region, region.manifest, State.READY  # the manifest with digests
                if t.writable:  # its header as staged, for the scheduled verify: kept before any writer maps it
                    t.header = os.pread(region.fd, region.manifest.data_offset, 0)
                log.info("%s", staging.describe_ready(region),
                         extra=journal.fields(table=t.name, generation=t.generation))
                if self._served.get(t.name) is t:  # a reload's generation is stored once it is served (switch)
                    self._fdstore.store(t.name, t.generation, region)
                event.owner.table_ready(t)
            case StagingFailed(error=error):
                t.outcome, t.error = State.FAILED, str(error)
                event.owner.table_failed(t, error)
            case StagingCancelled(reason=reason):
                event.owner.table_cancelled(t, reason)

    @staticmethod
    def _orphaned(event: StagingEnded) -> None:
        """A staging of a reload that failed meanwhile: nobody serves what it made."""
        if isinstance(event, Staged):
            event.region.close()
        t = event.table
        log.info("table %s generation %d: its reload failed before its staging ended; let go", t.name, t.generation,
                 extra=journal.fields(table=t.name, generation=t.generation))

    # -- a reload ----------------------------------------------------------------------------

    def stage_next(self, fresh: dict[str, tuple[Source, Manifest]],
                   pages: Mapping[str, PagePlan] = MappingProxyType({})) -> list[TableState]:
        """The next generation of each new or changed table, planned, to be staged beside the served ones on its
        ``pages``."""
        for name, (sidecar, manifest) in fresh.items():
            old = self._served.get(name)
            t = self._next[name] = TableState(name, sidecar, manifest, generation=(old.generation + 1) if old else 1,
                                              pages=pages.get(name))
            log.info("reload: staging table %s as generation %d%s", name, t.generation,
                     f" next to generation {old.generation}" if old else " (new table)",
                     extra=journal.fields(table=name, generation=t.generation))
        return list(self._next.values())

    def switch(self, plan: ReloadPlan) -> None:
        """New attaches get the next generations; the old ones and the removed tables are released (removed
        first, so that their fd-store slots are free for the new generations); the new config is in force."""
        incoming, self._next = self._next, {}
        for name in plan.removed:
            self._release(self._served.pop(name), "removed from the config: no longer offered")
        for name, new in incoming.items():
            old = self._served.get(name)
            self._served[name] = new
            if old is not None:
                self._release(old, f"generation {new.generation} now served")
            self._fdstore.store(name, new.generation, new.region)
        config = plan.config
        if config.socket != self._config.socket:
            log.warning("the socket moved to %s in the config; pled keeps serving on %s until it restarts",
                        config.socket, self._config.socket)
            config = config.with_socket(self._config.socket)
        self._config = config

    def drop_next(self) -> None:
        """A reload failed: the next generations staged so far are let go; nothing served changes."""
        dropped, self._next = self._next, {}
        for t in dropped.values():
            if t.region is not None:
                t.region.close()

    def _release(self, old: TableState, why: str) -> None:
        holders = self._holders(old.name, old.generation)
        self._fdstore.remove(old.name, old.generation)
        old.region.close()
        log.info("table %s generation %d released (%s); %d connected client(s) attached to it; its memory is "
                 "freed when the last process that maps it or holds its fd lets it go", old.name, old.generation, why,
                 holders, extra=journal.fields(table=old.name, generation=old.generation))

    # -- at stop -----------------------------------------------------------------------------

    def release_all(self) -> list[Region]:
        """Close every served region (systemd's fd store keeps its own copies); returns those it closed."""
        held = [t.region for t in self._served.values() if t.region is not None]
        for r in held:
            r.close()
        return held
