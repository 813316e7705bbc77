"""``pled serve``: the daemon's life cycle, in one place.

    start:  raise the open-file limit, install the signal handlers (they only record the signal), open
            and plan every table once, adopt what systemd's fd store holds, preflight the rest
            (startup.py), listen (server.py), stage the rest in a worker thread (stager.py)
    serve:  the loop (loop.py) over the signal pipe, the stager's event pipe and the clients; the calls
            are answered by handlers.py, a reload runs through reload.py, every staging's end goes through
            the registry (registry.py), which alone changes the tables, their generations and the config;
            each tick feeds systemd (STATUS=, EXTEND_TIMEOUT_USEC= while staging makes progress,
            WATCHDOG=1) and checks residency
    stop:   on SIGTERM, SIGINT or SIGQUIT, or when the first staging fails: close the listener (a client
            connecting now is refused, not kept waiting), close the clients, wait a few seconds at most for
            the worker threads (a read of a hung file system never returns: that staging is abandoned, named
            in the log, and the process's exit frees its memfd), release the tables (systemd's fd store keeps
            them for the next start)

The Daemon builds the parts and wires them with explicit callbacks; none of them holds the Daemon.

Signals: the handlers only record the signal; the loop dispatches it by name, as gunicorn's arbiter does
(SIGHUP -> ``handle_hup``). Every asynchronous signal that would otherwise end pled without a word:

    SIGTERM, SIGINT, SIGQUIT   stop as above, exit 0 ("SIGQUIT: stopping"); no core dump for SIGQUIT
    SIGHUP                     reload the config (reload.py), as `pled reload` does
    SIGUSR1                    log one status line: what is served or staged, how many clients
    SIGUSR2, SIGALRM           logged and ignored ("SIGUSR2: ignored (pled gives it no meaning)")
    SIGPIPE                    ignored by Python itself: a write to a peer that left is EPIPE, that connection's end

The synchronous fault signals (SIGBUS, SIGSEGV, SIGFPE, SIGILL) and job control (SIGTSTP, SIGCONT, ...)
keep their default actions.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from functools import partial

from pled import __version__
from pled.daemon import handlers, startup, tables as tables_mod
from pled.daemon.config import Config
from pled.daemon.events import Event, Planned, PlanningFailed, Verified
from pled.daemon.handlers import Handlers
from pled.daemon.health import journal
from pled.daemon.health.counters import Counters
from pled.daemon.health.metrics_file import MetricsFile
from pled.daemon.memory import hostmem
from pled.daemon.registry import Registry
from pled.daemon.reload import Reloader
from pled.daemon.scheduled_verify import ScheduledVerify
from pled.daemon.serving import fdlimit
from pled.daemon.serving.access import Policy
from pled.daemon.serving.loop import Loop, drain
from pled.daemon.serving.server import Server
from pled.daemon.serving.session import Reply, Session
from pled.daemon.stager import Stager
from pled.daemon.systemd import fdstore, notify
from pled.daemon.tables import State
from pled.shared.sizes import gib

log = logging.getLogger(__name__)

EXTEND_BY = 30.0  # seconds of TimeoutStartSec granted each time staging shows progress
EXTEND_EVERY = 5.0
RESIDENCY_EVERY = 60.0
SIGNALS = ("SIGTERM", "SIGINT", "SIGQUIT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM")


class Daemon(ScheduledVerify):
    def __init__(self, config: Config, *, proc_root: str = "/", sys_root: str = "/", env: dict | None = None) -> None:
        self.proc_root = proc_root
        self.env = os.environ if env is None else env
        self.started = time.monotonic()
        self.ready = False
        self.stopping = threading.Event()
        self.server: Server | None = None
        self.notifier = notify.Notifier(self.env)
        self.fdstore = fdstore.FdStore(self.notifier, self.env, config.fdstore_max)
        self.counters = Counters()  # attaches, refusals, drops, reloads: counted by the parts it is handed to
        self.registry = Registry(config, self.fdstore, holders=self._holders)
        self.stager = Stager(self.stopping, sys_root)
        self.reloader = Reloader(self.registry, self.stager, self.notifier, proc_root=proc_root, stopping=self.stopping,
                                 answer=self._answer_later, announce=self.announce_ready,
                                 config_changed=self._config_changed, counters=self.counters)
        self.handlers = Handlers(self.registry, self.reloader, answer=self._answer_later, connections=self._connections,
                                 clients_changed=self._clients_changed, started=self.started, counters=self.counters,
                                 fdstore=self.fdstore, lingering=self._lingering,
                                 metrics_error=lambda: self.metrics.error)
        self.metrics = MetricsFile(config.metrics_file, config.metrics_interval, counters=self.counters,
                                   snapshot=partial(self.handlers.status_dict, sources=False))
        self.first_staging = startup.FirstStaging(self.registry, self.handlers, self.notifier, self.stopping,
                                                  all_ready=self._on_all_ready)
        self._signals: list[int] = []
        self._next_watchdog = 0.0
        self._next_residency = 0.0
        self._extended = (0.0, -1)  # (when, bytes_done) at the last EXTEND_TIMEOUT_USEC
        self._status_sent = ""

    # -- life cycle --------------------------------------------------------------------------

    def run(self) -> int:
        nofile = fdlimit.raise_nofile()
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        old = {name: signal.signal(getattr(signal, name), self._record) for name in SIGNALS}
        loop = Loop()
        try:
            config = self.registry.config
            log.info("pled %s (pid %d) starting with %s: %d table(s)", __version__, os.getpid(), config.source,
                     len(config.tables))
            to_stage = startup.prepare(self.registry, self.fdstore, self.notifier, fdstore.listen_fds(self.env),
                                       self.proc_root)
            self.server = Server(config.socket, Policy.for_this_process(config.allow_uids, config.allow_gids),
                                 self.handlers, self.handlers.on_close, loop,
                                 max_connections=fdlimit.max_connections(nofile),
                                 fd_budget=fdlimit.fd_budget(nofile), counters=self.counters)
            log.info("listening on %s", config.socket)
            self.stager.stage(to_stage, self.first_staging, config)
            del to_stage, config  # the registry holds what is served: a reload's releases are not kept alive here
            if self.registry.all_ready():
                self._on_all_ready()
            loop.watch(wake_r, lambda _events: self._dispatch_signals(wake_r))
            loop.watch(self.stager.event_fd, lambda _events: self._drain_events())
            loop.run(self.stopping, min(1.0, self.notifier.watchdog_interval or 1.0), self._tick)
            return self.first_staging.exit_status
        finally:
            self._shut_down()
            loop.close()
            for name, handler in old.items():
                signal.signal(getattr(signal, name), handler)
            signal.set_wakeup_fd(old_wakeup)
            for fd in (wake_r, wake_w):
                os.close(fd)

    def _shut_down(self) -> None:
        self.stopping.set()
        if self.server is not None:  # first: no client waits on a daemon that is going
            self.server.close()
        self.stager.join()  # bounded: a staging stuck in a read is abandoned, and named
        self._drain_events()
        if self.reloader.current is not None:
            self.reloader.fail("pled is stopping")
        self.metrics.close()  # the last figures (a failed table too), in 1 s at most: a hung write is left, named
        held = self.registry.release_all()
        if held:
            stored = " (systemd's fd store keeps them for the next start)" if self.notifier.enabled else ""
            log.info("stopped: released %d table(s), %s%s", len(held),
                     gib(sum(r.manifest.region_bytes for r in held)), stored)
        self.notifier.close()
        self.stager.close()

    # -- signals: the handler records, the loop dispatches by name ----------------------------

    def _record(self, signum: int, frame) -> None:
        self._signals.append(signum)

    def _dispatch_signals(self, wake_r: int) -> None:
        drain(wake_r)
        while self._signals:
            name = signal.Signals(self._signals.pop(0)).name
            getattr(self, f"handle_{name[3:].lower()}")()

    def handle_term(self) -> None:
        self._stop("SIGTERM")

    def handle_int(self) -> None:
        self._stop("SIGINT")

    def handle_quit(self) -> None:
        self._stop("SIGQUIT")

    def _stop(self, signal_name: str) -> None:
        log.info("%s: stopping", signal_name)
        if self.server is not None:
            self.server.stop_listening()  # new clients are refused at once; the loop ends after this turn
        self.notifier.stopping()
        self.stopping.set()

    def handle_usr1(self) -> None:
        line = self.serving_line() if self.ready else self._status_sent or "starting"
        busy = "; a reload is under way" if self.reloader.current is not None else ""
        log.info("SIGUSR1: status: %s%s (pid %d, up %.0f s)", line, busy, os.getpid(), time.monotonic() - self.started)

    def handle_usr2(self) -> None:
        log.info("SIGUSR2: ignored (pled gives it no meaning)")

    def handle_alrm(self) -> None:
        log.info("SIGALRM: ignored (pled gives it no meaning)")

    def handle_hup(self) -> None:
        log.info("SIGHUP: reloading %s", self.registry.config.source)
        self.reloader.begin(None)

    # -- what the worker threads report -------------------------------------------------------

    def _drain_events(self) -> None:
        for event in self.stager.posted():
            try:
                self._handle(event)
            except Exception as err:  # one event's trouble: a reload fails, the loop goes on
                t = getattr(event, "table", None)
                log.exception("handling the %s event of %s failed", type(event).__name__, t.name if t else "a reload")
                if self.reloader.current is not None and (t is None or self.reloader.owns(t)):
                    self.reloader.fail(f"{type(err).__name__}: {err}")

    def _handle(self, event: Event) -> None:
        self.metrics.changed()  # a table staged or failed, a reload planned, a verify ended
        if isinstance(event, Verified):
            self._verified(event)
        elif isinstance(event, (Planned, PlanningFailed)):
            self.reloader.planned(event)
        else:
            self.registry.staging_ended(event)  # the first staging's tables and a reload's alike

    def _on_all_ready(self) -> None:
        if self.stopping.is_set() or self.ready:
            return
        self.ready = True
        tables = list(self.registry.tables.values())
        total = sum(t.manifest.region_bytes for t in tables)
        copied = sum(t.bytes_done for t in tables)
        seconds = time.monotonic() - self.started
        rss = hostmem.own_rss()
        for t in tables:
            t.measure()
        log.info("ready: %d table(s), %s in sealed memfds (%d adopted, %s copied) in %.1f s; pled's own memory %s RSS; "
                 "serving on %s", len(tables), gib(total), sum(t.origin == "adopted" for t in tables), gib(copied),
                 seconds, gib(rss), self.registry.config.socket,
                 extra=journal.fields("ready", table=[t.name for t in tables]))
        self._next_residency = time.monotonic() + RESIDENCY_EVERY
        self.announce_ready()
        self.reloader.serving()  # reloads may run now, and one asked for meanwhile does

    def announce_ready(self) -> None:
        """READY=1 with what is served (never after STOPPING=1)."""
        if self.stopping.is_set():
            return
        self._status_sent = self.serving_line()
        self.notifier.ready(self._status_sent)

    # -- what the parts are given: the server's connections, a later reply, the config in force --

    def _connections(self) -> list[Session]:
        return list(self.server.connections.values()) if self.server is not None else []

    def _lingering(self) -> list[Session]:
        return list(self.server.lingering.sessions) if self.server is not None else []

    def _holders(self, name: str, generation: int) -> int:
        return handlers.holders(self._connections(), name, generation)

    def _answer_later(self, conn: Session, reply: Reply) -> None:
        if self.server is not None:
            self.server.answer(conn, reply)

    def _clients_changed(self) -> None:
        self.metrics.changed()
        if self.ready and not self.stopping.is_set():
            self.set_status(self.serving_line())

    def _config_changed(self, config: Config) -> None:
        self.metrics.configure(config.metrics_file, config.metrics_interval)
        if self.server is not None:
            self.server.policy = Policy.for_this_process(config.allow_uids, config.allow_gids)

    # -- each turn of the loop: systemd and residency -----------------------------------------

    def _tick(self, now: float) -> None:
        """Once per loop turn: expire stuck clients, feed the watchdog, report progress, check residency."""
        if self.server is not None:
            self.server.expire(now)
        if self.notifier.watchdog_interval and now >= self._next_watchdog and self._healthy():
            self.notifier.watchdog()
            self._next_watchdog = now + self.notifier.watchdog_interval
        self.metrics.tick(now)  # a snapshot for the metrics file's writer, if one is due
        if self.ready and not self.stopping.is_set():
            self._verify_due(now)
        tables = list(self.registry.tables.values())
        staging_now = [t for t in tables + list(self.registry.next.values()) if t.state is State.STAGING]
        if staging_now:  # a reload's stagings extend its timeout too
            t = staging_now[0]
            when, done = self._extended
            if t.bytes_done != done and now - when >= EXTEND_EVERY:
                # Only while bytes keep arriving: a disk that hangs still trips TimeoutStartSec.
                self.notifier.extend_timeout(EXTEND_BY)
                self._extended = (now, t.bytes_done)
            self.set_status(f"staging {t.name} from {t.sidecar.source}: "
                            f"shard {t.shards_done}/{len(t.manifest.shards)}, "
                            f"{gib(t.bytes_done)} of {gib(t.manifest.source_bytes)}")
        elif self.ready and now >= self._next_residency:
            self._next_residency = now + RESIDENCY_EVERY
            tables_mod.check_residency(tables)
            self.set_status(self.serving_line())

    def _healthy(self) -> bool:
        return not any(t.state is State.FAILED for t in self.registry.tables.values())

    def serving_line(self) -> str:
        return tables_mod.serving_line(list(self.registry.tables.values()), self.handlers.attached_count())

    def set_status(self, text: str) -> None:
        if text != self._status_sent:
            self.notifier.status(text)
            self._status_sent = text
