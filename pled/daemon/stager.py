"""The daemon's worker threads: staging tables, and the slow part of a reload (reading headers, planning).

Nothing here touches the loop's state. Each result goes to the loop as an event, ``(kind, table, payload)``,
through a queue and a pipe the loop watches: "ready" with the staged Region, "failed" with the error,
"cancelled" with the reason; "planned" with a reload's plan or the exception that refused it. Every
exception ends as an event (a bug included, logged with its traceback), never as a dead thread the loop
would wait for.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Callable, Iterator

from pled.daemon import staging
from pled.daemon.loop import drain
from pled.shared.errors import PledError
from pled.shared.sizes import gib, rate

log = logging.getLogger(__name__)

JOIN_SECONDS = 3.0  # at stop, how long to wait for the worker threads, all together (a read can hang for ever)


class Stager:
    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.event_fd, self._event_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._staging: list[threading.Thread] = []
        self._jobs: list[threading.Thread] = []
        self._lock = threading.Lock()  # a job that outlives stop() must not write to a closed (reused) fd
        self._closed = False
        self._reading: dict[threading.Thread, tuple] = {}  # staging thread -> (table, when its current shard began)

    # -- posting (worker threads) ------------------------------------------------------------

    def _post(self, event) -> None:
        self._events.put(event)
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._event_w, b"!")
            except BlockingIOError:
                pass  # the pipe is full of wakeups already: the loop will drain the queue

    # -- staging -----------------------------------------------------------------------------

    def stage(self, states: list, *, huge_pages: str, sys_root: str, bandwidth: int | None) -> None:
        if not states:
            return
        worker = threading.Thread(target=self._stage_list, args=(states, huge_pages, sys_root, bandwidth),
                                  name="pled-staging", daemon=True)
        self._staging = [w for w in self._staging if w.is_alive()] + [worker]
        worker.start()

    def _stage_list(self, *args) -> None:
        try:
            self._stage_tables(*args)
        finally:
            self._reading.pop(threading.current_thread(), None)

    def _stage_tables(self, states: list, huge_pages: str, sys_root: str, bandwidth: int | None) -> None:
        """One table after another; each result goes to the loop as an event."""
        for t in states:
            if self._stop.is_set():
                break
            t.state = "staging"
            n = len(t.manifest.shards)
            me = threading.current_thread()
            self._reading[me] = (t, time.monotonic())

            def on_shard(shard, offset, seconds, t=t, n=n):
                t.shards_done += 1
                t.bytes_done += shard.size
                self._reading[me] = (t, time.monotonic())
                log.info("table %s: shard %d/%d %s %s in %.0f ms (%s)", t.name, shard.index + 1, n, shard.name,
                         gib(shard.size), seconds * 1000, rate(shard.size, seconds))

            try:
                r = staging.stage(t.name, t.sidecar, huge_pages=huge_pages, sys_root=sys_root, on_shard=on_shard,
                                  should_stop=self._stop.is_set, bandwidth=bandwidth)
            except staging.StagingCancelled as err:
                self._post(("cancelled", t, str(err)))
                return
            except (PledError, OSError) as err:
                self._post(("failed", t, err))
                return
            except Exception as err:  # the thread's boundary: a bug must fail the table, not hang the daemon
                log.exception("staging table %s hit an unexpected error", t.name)
                self._post(("failed", t, err))
                return
            self._post(("ready", t, r))

    # -- other work off the loop -------------------------------------------------------------

    def run(self, kind: str, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` in a thread; its result, or the exception it raised, comes back as (kind, None, x)."""
        def job():
            try:
                result = fn(*args)
            except PledError as err:
                result = err
            except Exception as err:  # a bug: logged here with its traceback, reported as a failure
                log.exception("%s failed unexpectedly", kind)
                result = err
            self._post((kind, None, result))

        worker = threading.Thread(target=job, name=f"pled-{kind}", daemon=True)
        self._jobs = [w for w in self._jobs if w.is_alive()] + [worker]
        worker.start()

    # -- the loop's side ---------------------------------------------------------------------

    def events(self) -> Iterator[tuple]:
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
        n = len(t.manifest.shards)
        where = (f"reading shard {t.shards_done + 1}/{n} ({os.path.basename(t.manifest.shards[t.shards_done].path)})"
                 if t.shards_done < n else "checking the digests of its shards")
        return (f"stopping without waiting for table {t.name}'s staging: it has been {where} for "
                f"{time.monotonic() - since:.0f} s; its partial copy is discarded")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for fd in (self.event_fd, self._event_w):
                os.close(fd)
