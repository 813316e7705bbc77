"""The daemon's worker threads: staging tables, and the slow part of a reload (reading headers, planning).

Nothing here touches the loop's state but a table's ``CopyProgress``, which the thread copying that table
alone writes. Each result goes to the loop as an event (events.py) through a queue and a pipe the loop
watches: ``Staged`` with the sealed Region, ``StagingFailed`` with the error, ``StagingCancelled`` with the
reason, each naming the owner that asked for the staging; a job's own event (a reload's ``Planned``), or
the event its ``on_error`` makes of the exception that ended it. Every exception ends as an event (a bug
included, logged with its traceback), never as a dead thread the loop would wait for. ``close()`` is safe
to repeat.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator

from pled.daemon import events
from pled.daemon.config import Config
from pled.daemon.health import journal
from pled.daemon.regions import staging
from pled.daemon.serving.loop import drain
from pled.daemon.tables import TableState
from pled.shared.errors import PledError
from pled.shared.sizes import gib, rate

log = logging.getLogger(__name__)

JOIN_SECONDS = 3.0  # at stop, how long to wait for the worker threads, all together (a read can hang for ever)


class Stager:
    def __init__(self, stop: threading.Event, sys_root: str = "/") -> None:
        self._stop = stop
        self._sys_root = sys_root  # where the kernel's huge-page settings are read (tests use a fixture tree)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.event_fd, self._event_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._staging: list[threading.Thread] = []
        self._jobs: list[threading.Thread] = []
        self._lock = threading.Lock()  # a job that outlives stop() must not write to a closed (reused) fd
        self._closed = False
        self._reading: dict[threading.Thread, tuple] = {}  # staging thread -> (table, when its current shard began)

    # -- posting (worker threads) ------------------------------------------------------------

    def _post(self, event: events.Event) -> None:
        self._events.put(event)
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._event_w, b"!")
            except BlockingIOError:
                pass  # the pipe is full of wakeups already: the loop will drain the queue

    # -- staging -----------------------------------------------------------------------------

    def stage(self, tables: list[TableState], owner: events.StagingOwner, config: Config) -> None:
        """Stage ``tables`` one after another in a thread of their own, each from the plan and on the pages it holds
        (``TableState.pages``), at ``config``'s bandwidth; each end goes to ``owner`` (through the registry)."""
        if not tables:
            return
        writable = frozenset(t.name for t in config.tables if t.writable)  # gpu_access = "writable": not write-sealed
        for cfg in config.tables:
            if cfg.writable and any(t.name == cfg.name for t in tables):  # never silent: who may write, how it is seen
                log.warning("table %s is writable (gpu_access = \"writable\"): %s receive(s) a read-write fd and may "
                            "change what every client of it reads; every other client gets a read-only fd; pled "
                            "verifies its bytes every %g s", cfg.name, ", ".join(
                                w if isinstance(w, str) else f"uid {w}" for w in cfg.writers), cfg.verify_seconds,
                            extra=journal.fields(table=cfg.name))
        worker = threading.Thread(target=self._stage_list, args=(tables, owner, config.staging_bandwidth, writable),
                                  name="pled-staging", daemon=True)
        self._staging = [w for w in self._staging if w.is_alive()] + [worker]
        worker.start()

    def _stage_list(self, *args) -> None:
        try:
            self._stage_tables(*args)
        finally:
            self._reading.pop(threading.current_thread(), None)

    def _stage_tables(self, tables: list[TableState], owner: events.StagingOwner, bandwidth: int | None,
                      writable: frozenset[str] = frozenset()) -> None:
        """One table after another; each result goes to the loop as an event."""
        for t in tables:
            if self._stop.is_set():
                break
            t.copy.begun = True
            n = len(t.manifest.shards)
            me = threading.current_thread()
            self._reading[me] = (t, time.monotonic())

            def on_shard(shard, nbytes, seconds, t=t, n=n, me=me):
                t.copy.shard_copied(nbytes)
                self._reading[me] = (t, time.monotonic())
                log.info("table %s: %s %d/%d %s %s in %.0f ms (%s)", t.name,
                         "file" if t.manifest.arrays else "shard", shard.index + 1, n, shard.name, gib(nbytes),
                         seconds * 1000, rate(nbytes, seconds),
                         extra=journal.fields(table=t.name, generation=t.generation))

            try:
                r = staging.stage(t.name, t.sidecar, planned=t.manifest, pages=t.pages,
                                  sys_root=self._sys_root, on_shard=on_shard, should_stop=self._stop.is_set,
                                  bandwidth=bandwidth, writable=t.name in writable)
            except staging.StagingCancelled as err:
                self._post(events.StagingCancelled(t, str(err), owner))
                return
            except (PledError, OSError) as err:
                self._post(events.StagingFailed(t, err, owner))
                return
            except Exception as err:  # the thread's boundary: a bug must fail the table, not hang the daemon
                log.exception("staging table %s hit an unexpected error", t.name)
                self._post(events.StagingFailed(t, err, owner))
                return
            self._post(events.Staged(t, r, owner))

    # -- other work off the loop -------------------------------------------------------------

    def run(self, name: str, job: Callable[[], events.Event],
            on_error: Callable[[BaseException], events.Event]) -> None:
        """Run ``job`` in a thread and post the event it returns, or ``on_error`` of the exception it raised."""
        def work():
            try:
                event = job()
            except PledError as err:
                event = on_error(err)
            except Exception as err:  # a bug: logged here with its traceback, reported as a failure
                log.exception("%s failed unexpectedly", name)
                event = on_error(err)
            self._post(event)

        worker = threading.Thread(target=work, name=f"pled-{name}", daemon=True)
        self._jobs = [w for w in self._jobs if w.is_alive()] + [worker]
        worker.start()

    # -- the loop's side ---------------------------------------------------------------------

    def posted(self) -> Iterator[events.Event]:
        """Every event posted so far (call when event_fd is readable, and at stop)."""
        drain(self.event_fd)
        while True:
            try:
                yield self._events.get_nowait()
            except queue.Empty:
                return

    def join(self, timeout: float = JOIN_SECONDS) -> None:
        """At stop: staging threads see the stop flag between chunks, planning cannot be interrupted; both get
        ``timeout`` seconds in all. A thread still in a read after that (a file system that hangs) is left: it
        is a daemon thread, the memfd it fills is its own, and the process's exit frees it."""
        deadline = time.monotonic() + timeout
        for worker in self._staging + self._jobs:
            worker.join(max(0.0, deadline - time.monotonic()))
        for worker in self._staging:
            if worker.is_alive():
                log.warning("%s", self._abandoned(worker))
        if any(worker.is_alive() for worker in self._jobs):
            log.warning("a reload's planning is still reading files; stopping without waiting for it")

    def _abandoned(self, worker: threading.Thread) -> str:
        t, since = self._reading.get(worker, (None, time.monotonic()))
        if t is None:
            return "stopping without waiting for a staging thread that has not begun its first table"
        n, done = len(t.manifest.shards), t.copy.shards_done
        where = (f"reading shard {done + 1}/{n} ({os.path.basename(t.manifest.shards[done].path)})"
                 if done < n else "checking the digests of its shards")
        return (f"stopping without waiting for table {t.name}'s staging: it has been {where} for "
                f"{time.monotonic() - since:.0f} s; its partial copy is discarded")

    def close(self) -> None:
        """Close the event pipe, under the lock the workers write it with; safe to repeat."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self.event_fd, self._event_w):
                os.close(fd)
