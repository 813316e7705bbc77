"""Reloading: new generations staged beside the served ones, then one switch, or nothing changed at all.

The states, each handled in the loop thread:

    idle --begin--> planning --Planned--> staging --every table ready--> (commit) --> idle
                        |                    |
                        +--PlanningFailed----+--a staging failed/cancelled--> (fail: nothing changed) --> idle

Planning (re-reading the config, opening every table's files, reading their headers, the preflight) runs in
a worker thread (stager.Stager.run), so a slow or hostile sidecar never delays an Attach or a Status. Any
exception there, or while committing, fails the reload and is logged once; the served tables stay as they
were. The registry holds the tables and makes the switch; the Reloader holds who asked and when, and is the
``StagingOwner`` of the next generations. A reload asked for while one is under way is answered with that
one's result (io.pled.Reload); one asked for by SIGHUP while a reload or the first staging is under way runs
once it is done.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pled.daemon.config import Config
from pled.daemon.events import Planned, PlanningFailed
from pled.daemon.health import journal
from pled.daemon.health.counters import Counters
from pled.daemon.regions import parsing
from pled.daemon.regions.planning import ReloadPlan
from pled.daemon.registry import Registry
from pled.daemon.serving.server import PENDING
from pled.daemon.serving.session import Reply, Session
from pled.daemon.stager import Stager
from pled.daemon.systemd.notify import Notifier
from pled.daemon.tables import State, TableState
from pled.shared import protocol
from pled.shared.boundary import clip
from pled.shared.errors import PledError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Reload:
    """A reload under way: who asked, since when, and its plan once it is made."""

    callers: list[Session]
    plan: ReloadPlan | None = None  # None while planning
    started: float = field(default_factory=time.monotonic)


# The settings a reload puts in force (socket and fdstore_max are read only at start; tables are reported by name).
RELOADED_SETTINGS = ("huge_pages", "huge_page_size", "numa", "headroom_margin", "staging_bandwidth", "allow_uids",
                     "allow_groups", "metrics_file", "metrics_interval")


def summary(plan: ReloadPlan, fresh: dict[str, TableState], served: dict[str, TableState], old: Config) -> dict:
    """The io.pled.Reload reply: what changed, was added, removed or left alone, the new generations, and the
    settings whose values changed (``old``: the config served until now)."""
    return {
        "changed": sorted(n for n in fresh if n in served), "added": sorted(n for n in fresh if n not in served),
        "removed": sorted(plan.removed), "unchanged": sorted(plan.unchanged),
        "settings": [k for k in RELOADED_SETTINGS if getattr(plan.config, k) != getattr(old, k)],
        "generations": {n: t.generation for n, t in fresh.items()},
    }


def journal_fields(reply: dict) -> dict:
    """A reload's journal fields: a PLED_TABLE for each table it changed, added or removed, and PLED_GENERATION
    where that is one table with a new generation."""
    names = reply["changed"] + reply["added"] + reply["removed"]
    one = names[0] if len(names) == 1 else None
    return journal.fields("reload_done", table=names, generation=reply["generations"].get(one))


class Reloader:
    def __init__(self, registry: Registry, stager: Stager, notifier: Notifier, *, proc_root: str,
                 stopping: threading.Event, answer: Callable[[Session, Reply], None], announce: Callable[[], None],
                 config_changed: Callable[[Config], None], counters: Counters) -> None:
        """``answer(conn, reply)`` sends a caller's later reply; ``announce()`` sends READY=1 and what is served
        once a reload has ended; ``config_changed(config)`` is told of the config a reload put in force;
        ``counters`` counts the reloads done and failed."""
        self.registry = registry
        self.counters = counters
        self.stager = stager
        self.notifier = notifier
        self.proc_root = proc_root
        self.stopping = stopping
        self.answer = answer
        self.announce = announce
        self.config_changed = config_changed
        self.current: Reload | None = None
        self._serving = False  # the first staging is done: reloads may run
        self._again = False  # a SIGHUP came while a reload or the first staging was under way

    def begin(self, caller: Session | None, restage: frozenset[str] = frozenset()):
        """Start a reload; returns PENDING (the caller is answered later), an error Reply, or None (SIGHUP).
        ``restage``: served tables to stage anew whatever their files say (`pled verify --repair` names the writable
        tables whose bytes it found changed before the scheduled verify did); a caller that joins a reload under way
        gets that one's result."""
        if self.current is not None or not self._serving:
            if caller is None:
                self._again = True
                log.info("a reload or the first staging is under way; reloading again once it is done")
                return None
            if self.current is not None:
                self.current.callers.append(caller)  # it will answer this caller too
                return PENDING
            return Reply(protocol.error(protocol.RELOAD_FAILED,
                                        reason="the first staging is still under way; try again"))
        source = self.registry.config.source
        self.notifier.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}",
                           f"STATUS=reloading {source}")
        self.current = Reload(callers=[caller] if caller else [])
        served, served_pages = self.registry.identities(), self.registry.page_sizes()
        served = {name: identity for name, identity in served.items() if name not in restage}
        writable = self.registry.writable()
        self.stager.run("planned", lambda: Planned(parsing.plan_reload(source, served, self.proc_root, served_pages,
                                                                       writable)),
                        on_error=PlanningFailed)
        return PENDING if caller else None

    def serving(self) -> None:
        """The first staging is done and READY=1 sent: reloads may run, and one asked for meanwhile runs now."""
        self._serving = True
        self._run_deferred()

    def _run_deferred(self) -> None:
        if self._again and self.current is None and not self.stopping.is_set():
            self._again = False
            self.begin(None)

    # -- what the worker threads report -------------------------------------------------------

    def planned(self, event: Planned | PlanningFailed) -> None:
        if self.current is None:
            return  # stopped meanwhile
        if isinstance(event, PlanningFailed):
            err = event.error
            self.fail(str(err) if isinstance(err, PledError) else f"{type(err).__name__}: {clip(err)}",
                      getattr(err, "table", None))
            return
        plan = self.current.plan = event.plan
        if plan.verdict is not None:
            log.info("reload %s", plan.verdict.message)
        fresh = self.registry.stage_next(plan.fresh, plan.pages)
        if fresh:
            self.stager.stage(fresh, self, plan.config)  # copied as the re-read config says (its huge_pages, bandwidth)
        else:
            self.commit()

    def owns(self, t: TableState) -> bool:
        return self.current is not None and self.registry.next.get(t.name) is t

    def table_ready(self, t: TableState) -> None:
        if all(x.state is State.READY for x in self.registry.next.values()):
            self.commit()

    def table_failed(self, t: TableState, error: BaseException) -> None:
        self.fail(f"staging table {t.name} failed: {error}")

    def table_cancelled(self, t: TableState, reason: str) -> None:
        self.fail(reason)

    # -- the end of a reload -----------------------------------------------------------------

    def commit(self) -> None:
        """The switch: new attaches get the new generations; the old regions are let go."""
        r, self.current = self.current, None
        reply = summary(r.plan, dict(self.registry.next), dict(self.registry.tables), self.registry.config)
        self.registry.switch(r.plan)
        self.config_changed(self.registry.config)
        self.counters.reload_ended("done")
        log.info("reload done in %.1f s: %s", time.monotonic() - r.started,
                 ", ".join(f"{k} {', '.join(v)}" for k, v in reply.items() if v and k != "generations")
                 or "nothing changed", extra=journal_fields(reply))
        self._after(r.callers, Reply(protocol.reply(**reply)))

    def fail(self, why: str, table: str | None = None) -> None:
        """Nothing changes: the new generations staged so far are let go, the callers told why. ``table``: the one
        whose files were refused, if that was why."""
        r, self.current = self.current, None
        tables = [table] if table else list(self.registry.next)  # what the reload was about: the journal's PLED_TABLE
        self.registry.drop_next()
        self.counters.reload_ended("failed")
        log.error("reload failed, nothing changed: %s", clip(why, 2000), extra=journal.fields("reload_failed",
                                                                                          table=tables))
        self._after(r.callers if r else [], Reply(protocol.error(protocol.RELOAD_FAILED, reason=clip(why, 2000))))

    def _after(self, callers: list[Session], reply: Reply) -> None:
        for conn in callers:
            self.answer(conn, reply)
        if self.stopping.is_set():  # never READY=1 after STOPPING=1
            return
        self.announce()  # READY=1 again
        self._run_deferred()  # and a reload that was asked for meanwhile

    def forget(self, conn: Session) -> None:
        if self.current is not None and conn in self.current.callers:
            self.current.callers.remove(conn)

    def progress(self) -> dict | None:
        r = self.current
        if r is None:
            return None
        return {"state": "planning" if r.plan is None else "staging",
                "tables": [t.progress() | {"generation": t.generation} for t in self.registry.next.values()],
                "removed": r.plan.removed if r.plan else [], "seconds": round(time.monotonic() - r.started, 1),
                "callers": len(r.callers), "again": self._again}
