"""pled's start, between installing the signal handlers and listening, and the first staging's owner.

``prepare``: the page and NUMA settings checked against the host (pageplan.resolve); every configured table
opened and planned, once (planning.py); the regions systemd's fd store kept adopted where they match that plan
and are on the pages the config asks for, the rest removed from the store (fdstore.py); the pages of each table
left to stage decided and logged with the reason (pageplan.decide), and those tables preflighted against the
memory, or the huge-page pool, this process may have. A refusal of the config, a sidecar or the
preflight raises a PledError (exit 78) before pled listens.

``FirstStaging`` is the StagingOwner of the tables staged at start: a table that becomes ready answers the
clients waiting for it, the last one makes pled ready (READY=1), and one that fails stops pled with that
failure's exit status.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pled.daemon.config import Config
from pled.daemon.handlers import Handlers
from pled.daemon.health import journal
from pled.daemon.memory import pageplan
from pled.daemon.memory.pageplan import PagePlan
from pled.daemon.regions import planning
from pled.daemon.registry import Registry
from pled.daemon.systemd import fdstore
from pled.daemon.systemd.fdstore import FdStore, StoredFd
from pled.daemon.systemd.notify import Notifier
from pled.daemon.tables import TableState
from pled.shared.errors import EX_CONFIG, PledError
from pled.shared.region import Manifest

log = logging.getLogger(__name__)


def prepare(registry: Registry, store: FdStore, notifier: Notifier, stored: list[StoredFd],
            proc_root: str = "/") -> list[TableState]:
    """Open, plan, adopt, preflight what is left; returns the tables to stage. ``stored`` (what systemd passed)
    is adopted or closed here, whatever happens."""
    config = registry.config
    try:
        placements = pageplan.resolve(config, proc_root)
        sidecars = planning.open_tables(config)
    except PledError:
        fdstore.close_stored(stored)  # systemd keeps its copies: a fixed config may adopt them next time
        raise
    planned = planning.plan_tables(sidecars)  # on 2 MiB boundaries; a hugetlb table's is rounded up below

    def mismatch(table: str, page_size: int) -> str:
        return pageplan.mismatch(placements[table], page_size, planned[table].region_bytes, proc_root)

    adopted = fdstore.adopt_stored(stored, planned, store, mismatch,
                                   writable=frozenset(t.name for t in config.tables if t.writable))
    left = {name: m for name, m in planned.items() if name not in adopted.adopted}
    pages = planning.plan_pages(config, left, proc_root, log_as="", placements=placements) if left else {}
    to_stage = registry.open(sidecars, {n: m.paged(pages[n].page_size) if n in pages else m
                                        for n, m in planned.items()}, adopted, pages)
    store.announce([t.name for t in to_stage])
    if adopted.adopted:
        log.info("tables adopted, preflight not rerun for them: %s (their memory was allocated when they were staged "
                 "and systemd's fd store held it since; nothing is allocated for them now)%s",
                 ", ".join(sorted(adopted.adopted)),
                 f"; the preflight checks the {len(to_stage)} table(s) left to stage" if to_stage else "")
    if to_stage:
        preflight(config, {t.name: left[t.name] for t in to_stage}, notifier, proc_root, pages)
    return to_stage


def preflight(config: Config, manifests: dict[str, Manifest], notifier: Notifier, proc_root: str,
              pages: dict[str, PagePlan] | None = None) -> None:
    """Will the regions to stage (planned on 2 MiB boundaries, staged on ``pages``) fit? A refusal is pled's
    STATUS= and raises (pled.cli logs it, once, as the journal's "refused" entry); a fit is logged here."""
    verdict = planning.run_preflight(config, manifests, proc_root, pages)
    for problem in verdict.problems:
        log.warning("preflight could not read %s", problem)
    if verdict.ok:
        log.info("%s", verdict.message)
    else:
        notifier.status(verdict.message)
    verdict.raise_if_refused()


class FirstStaging:
    def __init__(self, registry: Registry, handlers: Handlers, notifier: Notifier, stopping: threading.Event, *,
                 all_ready: Callable[[], None]) -> None:
        """``all_ready()`` is called once every served table is ready."""
        self.registry = registry
        self.handlers = handlers
        self.notifier = notifier
        self.stopping = stopping
        self.all_ready = all_ready
        self.exit_status = 0  # pled's, once a table failed

    def table_ready(self, t: TableState) -> None:
        self.handlers.table_ready(t)  # the clients that wait for it
        if self.registry.all_ready():
            self.all_ready()

    def table_failed(self, t: TableState, error: BaseException) -> None:
        self.exit_status = getattr(error, "exit_status", 1) or 1
        # exit 78: a sidecar refused while copied (a shipped digest that does not match), a refusal like any other
        log.error("staging table %s failed: %s", t.name, error,
                  extra=journal.fields("refused" if self.exit_status == EX_CONFIG else None, table=t.name))
        self.notifier.status(f"failed: table {t.name}: {error}")
        self.stopping.set()

    def table_cancelled(self, t: TableState, reason: str) -> None:
        log.info("%s", reason)
