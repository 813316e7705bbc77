"""The scheduled verify of writable tables (gpu_access = "writable"): the Daemon's part that starts one verify at a
time off the loop (regions/integrity.py does the reading, throttled) and reports a difference: a crit journal line
naming the range and the attached writers' pids, the table marked modified in Status and the metrics."""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from pled.daemon.config import DEFAULT_VERIFY_INTERVAL
from pled.daemon.events import Verified
from pled.daemon.health import journal
from pled.daemon.regions import integrity
from pled.daemon.tables import State, TableState

if TYPE_CHECKING:
    from pled.daemon.registry import Registry
    from pled.daemon.serving.session import Session
    from pled.daemon.stager import Stager

log = logging.getLogger("pled.daemon.lifecycle")  # the records the journal and tests know by this logger


class ScheduledVerify:
    """Mixed into the Daemon: uses its registry, stager, stopping event, connections and _clients_changed."""

    registry: Registry
    stager: Stager
    stopping: threading.Event

    def _connections(self) -> list[Session]:
        raise NotImplementedError

    def _clients_changed(self) -> None:
        raise NotImplementedError

    def _interval(self, t: TableState) -> float:
        cfg = self.registry.config.table(t.name)
        return (cfg.verify_seconds if cfg is not None else None) or DEFAULT_VERIFY_INTERVAL

    def _verify_due(self, now: float) -> None:
        """Start the verify of the writable table most overdue, one at a time, in a worker thread of its own; the job
        owns a duplicate of the region's fd (a reload may close the table's own meanwhile)."""
        tables = [t for t in self.registry.tables.values() if t.state is State.READY and t.header is not None
                  and t.writable]
        for t in tables:
            if not t.verify_due:
                t.verify_due = now + self._interval(t)
        if any(t.verifying for t in tables):
            return
        due = [t for t in tables if now >= t.verify_due]
        if not due:
            return
        t = min(due, key=lambda t: t.verify_due)
        r, header, config = t.region, t.header, self.registry.config
        assert r is not None and header is not None  # READY with a header: its region is there
        fd = os.dup(r.fd)
        t.verifying = True
        throttle = integrity.Throttle(config.verify_cpu_share, config.verify_bandwidth, self.stopping.is_set)

        def job() -> Verified:
            try:
                return Verified(t, r, integrity.verify(fd, r.manifest, header, throttle))
            finally:
                os.close(fd)

        self.stager.run("verify", job, on_error=lambda err: Verified(t, r, None, err))

    def _verified(self, event: Verified) -> None:
        t, now = event.table, time.monotonic()
        t.verifying = False
        t.verify_due = now + self._interval(t)
        if event.error is not None:
            if not isinstance(event.error, integrity.Stopped):
                log.error("the scheduled verify of table %s failed: %s; it is tried again in %.0f s", t.name,
                          event.error, self._interval(t), extra=journal.fields(table=t.name, generation=t.generation))
            return
        out = event.outcome
        assert isinstance(out, integrity.Outcome)
        t.verifies += 1
        t.last_verify = {"seconds": round(out.seconds, 3), "cpu_seconds": round(out.cpu_seconds, 3),
                         "bytes": out.bytes_read, "at": now}
        if not out.differences or t.region is not event.region or t.modified is not None:
            return  # identical, or a generation no longer served, or a change already reported
        first, last = out.differences[0], out.differences[-1]
        writers = sorted(c.peer.pid for c in self._connections()
                         if t.name in c.writes and c.attached.get(t.name) == t.generation)
        t.modified = {"start": first.start, "end": last.end, "what": ", ".join(d.what for d in out.differences[:8]),
                      "ranges": [[d.start, d.end] for d in out.differences[:64]], "writers": writers}
        t.modified_at = now
        log.critical("table %s generation %d was MODIFIED: bytes [%d, %d) (%s) differ from what pled staged; writers "
                     "attached: %s; every process attached to it reads the changed bytes; `pled verify --repair` "
                     "stages a clean generation for new attaches", t.name, t.generation, first.start, last.end,
                     t.modified["what"], ", ".join(f"pid {p}" for p in writers) or "none",
                     extra=journal.fields("table_modified", table=t.name, generation=t.generation))
        self._clients_changed()
