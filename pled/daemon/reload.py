"""Reloading: new generations staged beside the served ones, then one switch, or nothing changed at all.

The states, each handled in the loop thread:

    idle --begin--> planning --planned--> staging --every table ready--> (commit) --> idle
                        |                    |
                        +--refused/bug-------+--a staging failed/stopped--> (fail: nothing changed) --> idle

Planning (re-reading the config, opening every table's files, reading their headers, the preflight) runs in
a worker thread (stager.Stager.run), so a slow or hostile sidecar never delays an Attach or a Status. Any
exception there, or while committing, fails the reload and is logged once; the served tables stay as they
were. A reload asked for while one is under way is answered with that one's result (io.pled.Reload), or
runs once it is done (SIGHUP).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pled.daemon import notify, planning
from pled.shared import protocol
from pled.daemon.access import Policy
from pled.shared.boundary import clip
from pled.daemon.config import Config
from pled.daemon.session import Reply, Session
from pled.shared.errors import PledError
from pled.daemon.server import PENDING
from pled.daemon.tables import TableState

if TYPE_CHECKING:
    from pled.daemon.lifecycle import Daemon

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Reload:
    """A reload under way: the tables being staged as new generations next to the ones being served."""

    config: Config | None  # None while planning
    tables: dict[str, TableState] = field(default_factory=dict)  # new or changed tables, staging
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    callers: list[Session] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def summary(self, old: dict[str, TableState]) -> dict:
        return {
            "changed": sorted(n for n in self.tables if n in old), "added": sorted(n for n in self.tables if n not in old),
            "removed": sorted(self.removed), "unchanged": sorted(self.unchanged),
            "generations": {n: t.generation for n, t in self.tables.items()},
        }


class Reloader:
    def __init__(self, daemon: "Daemon") -> None:
        self.d = daemon
        self.current: Reload | None = None
        self.again = False  # a SIGHUP came while a reload or the first staging was under way

    def begin(self, caller: Session | None):
        """Start a reload; returns PENDING (the caller is answered later), an error Reply, or None (SIGHUP)."""
        d = self.d
        if self.current is not None or not d.ready:
            if caller is None:
                self.again = True
                log.info("a reload or the first staging is under way; reloading again once it is done")
                return None
            if self.current is not None:
                self.current.callers.append(caller)  # it will answer this caller too
                return PENDING
            return Reply(protocol.error(protocol.RELOAD_FAILED, reason="the first staging is still under way; try again"))
        d.notifier.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}",
                        f"STATUS=reloading {d.config.source}")
        self.current = Reload(None, callers=[caller] if caller else [])
        served = {n: t.manifest.identity() for n, t in d.tables.items()}
        d.stager.run("planned", planning.plan_reload, d.config.source, served, d.proc_root)
        return PENDING if caller else None

    def on_planned(self, result) -> None:
        r = self.current
        if r is None:
            return  # stopped meanwhile
        if isinstance(result, BaseException):
            self.fail(str(result) if isinstance(result, PledError) else f"{type(result).__name__}: {clip(result)}")
            return
        d = self.d
        if result.verdict is not None:
            log.info("reload %s", result.verdict.message)
        r.config, r.unchanged, r.removed = result.config, result.unchanged, result.removed
        for name, (sidecar, manifest) in result.fresh.items():
            old = d.tables.get(name)
            r.tables[name] = TableState(name, sidecar, manifest, generation=(old.generation + 1) if old else 1)
            log.info("reload: staging table %s as generation %d%s", name, r.tables[name].generation,
                     f" next to generation {old.generation}" if old else " (new table)")
        if r.tables:
            d.stage(list(r.tables.values()))
        else:
            self.commit()

    def owns(self, t: TableState) -> bool:
        return self.current is not None and t in self.current.tables.values()

    def on_event(self, kind: str, t: TableState, payload) -> None:
        if kind == "ready":
            t.staged(payload)
            if all(x.state == "ready" for x in self.current.tables.values()):
                self.commit()
        elif kind == "failed":
            t.state, t.error = "failed", str(payload)
            self.fail(f"staging table {t.name} failed: {payload}")
        else:
            self.fail(str(payload))

    def commit(self) -> None:
        """The switch: new attaches get the new generations; the old regions are let go."""
        d, r = self.d, self.current
        self.current = None
        summary = r.summary(d.tables)
        for name in r.removed:  # first, so that their fd-store slots are free for the new generations
            self._release(d.tables.pop(name), "removed from the config: no longer offered")
        for name, new in r.tables.items():
            old = d.tables.get(name)
            d.tables[name] = new
            if old is not None:
                self._release(old, f"generation {new.generation} now served")
            d.fdstore.store(name, new.generation, new.region)
        config = r.config
        if config.socket != d.config.socket:
            log.warning("the socket moved to %s in the config; pled keeps serving on %s until it restarts",
                        config.socket, d.config.socket)
            source = d.config.source
            config = config.model_copy(update={"socket": d.config.socket})
            config._source = source
        d.config = config
        if d.server is not None:
            d.server.policy = Policy.for_this_process(config.allow_uids, config.allow_gids)
        log.info("reload done in %.1f s: %s", time.monotonic() - r.started,
                 ", ".join(f"{k} {', '.join(v)}" for k, v in summary.items() if v and k != "generations") or "nothing changed")
        self._after(r.callers, Reply(protocol.reply(**summary)))

    def _release(self, old: TableState, why: str) -> None:
        holders = self.d.handlers.holders(old.name, old.generation)
        self.d.fdstore.remove(notify.fd_name(old.name, old.generation))
        old.region.close()
        log.info("table %s generation %d released (%s); %d connected client(s) attached to it; its memory is freed "
                 "when the last process that maps it or holds its fd lets it go", old.name, old.generation, why, holders)

    def fail(self, why: str) -> None:
        """Nothing changes: the new generations staged so far are let go, the callers told why."""
        r, self.current = self.current, None
        callers = []
        if r is not None:
            callers = r.callers
            for t in r.tables.values():
                if t.region is not None:
                    t.region.close()
        log.error("reload failed, nothing changed: %s", why)
        self._after(callers, Reply(protocol.error(protocol.RELOAD_FAILED, reason=clip(why, 2000))))

    def _after(self, callers: list[Session], reply: Reply) -> None:
        for conn in callers:
            self.d.handlers.answer(conn, reply)
        self.d.announce_ready()  # READY=1 again, and a reload that was asked for meanwhile

    def forget(self, conn: Session) -> None:
        if self.current is not None and conn in self.current.callers:
            self.current.callers.remove(conn)

    def staging(self) -> list[TableState]:
        return list(self.current.tables.values()) if self.current else []

    def progress(self) -> dict | None:
        r = self.current
        if r is None:
            return None
        return {"state": "planning" if r.config is None else "staging",
                "tables": [t.progress() | {"generation": t.generation} for t in r.tables.values()],
                "removed": r.removed, "seconds": round(time.monotonic() - r.started, 1)}
