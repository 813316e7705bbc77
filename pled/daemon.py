"""``pled serve``: preflight, adopt or stage every table, serve the regions until SIGTERM.

The main thread runs one loop over the listening socket, the clients, the
signal wakeup pipe and the staging thread's event pipe, and on each tick feeds
systemd (STATUS=, EXTEND_TIMEOUT_USEC= while staging makes progress, WATCHDOG=1)
and checks residency. Signal handlers only record the signal (as gunicorn's
arbiter does). Staging runs in one worker thread (sendfile and read release the
GIL), so clients are answered while a table is still being copied: they get
io.pled.NotReady with the progress, or wait for the table if they asked to.
"""
from __future__ import annotations

import logging
import os
import queue
import selectors
import signal
import threading
import time
from dataclasses import dataclass

import psutil

from . import __version__, fdstore, notify, preflight, protocol, region, staging
from .access import Policy
from . import config as config_mod
from .config import Config
from .errors import ConfigError, PledError
from .pagecache import cached_bytes_fd
from .region import Region
from .server import PENDING, Connection, Reply, Server
from .sidecar import Sidecar, open_table
from .sizes import gib, rate

log = logging.getLogger(__name__)

EXTEND_BY = 30.0  # seconds of TimeoutStartSec granted each time staging shows progress
EXTEND_EVERY = 5.0
RESIDENCY_EVERY = 60.0


def open_tables(config: Config) -> dict[str, Sidecar]:
    if not config.tables:
        raise ConfigError(config.source, "no [[table]] configured; add one with a name and a path")
    return {t.name: open_table(t.path) for t in config.tables}


def plan_tables(sidecars: dict[str, Sidecar]) -> dict[str, region.Manifest]:
    return {name: region.plan(name, s) for name, s in sidecars.items()}


def run_preflight(config: Config, manifests: dict[str, region.Manifest], proc_root: str = "/") -> preflight.Verdict:
    """Will these planned regions fit? Their exact sizes against what this process can have."""
    return preflight.check({name: m.region_bytes for name, m in manifests.items()}, config.headroom_margin, proc_root)


@dataclass(eq=False)
class TableState:
    name: str
    sidecar: Sidecar
    manifest: region.Manifest
    generation: int = 1
    state: str = "waiting"  # waiting -> staging -> ready, or failed
    origin: str = "staged"  # or "adopted" from systemd's fd store
    shards_done: int = 0
    bytes_done: int = 0  # bytes copied from the sources by this process
    region: Region | None = None
    error: str = ""
    resident_share: float | None = None  # at the last check

    def progress(self) -> dict:
        return {
            "table": self.name, "state": self.state, "shards_done": self.shards_done, "shards": len(self.manifest.shards),
            "bytes_done": self.bytes_done, "bytes": self.manifest.source_bytes,
        }

    def measure(self) -> int:
        """Bytes of the region in memory now (cachestat on the memfd); keeps the share for STATUS=."""
        resident = cached_bytes_fd(self.region.fd)
        self.resident_share = resident / self.manifest.region_bytes
        return resident

    def staged(self, r: Region) -> None:
        self.region, self.state, self.manifest = r, "ready", r.manifest  # with its digests
        log.info("%s", staging.describe_ready(r))

    def sources(self) -> str:
        """Whether the files this generation was staged from are still there as they were."""
        missing, changed = [], []
        for s in self.manifest.shards:
            try:
                st = os.stat(s.path)
            except FileNotFoundError:
                missing.append(os.path.basename(s.path))
                continue
            if (st.st_size, st.st_mtime_ns) != (s.size, s.mtime_ns):
                changed.append(os.path.basename(s.path))
        parts = ([f"missing: {', '.join(missing)}"] if missing else []) + ([f"changed: {', '.join(changed)}"] if changed else [])
        return "; ".join(parts) or "unchanged"

    def status(self) -> dict:
        out = {
            **self.progress(), "origin": self.origin, "layout": self.manifest.layout, "rows": self.manifest.rows,
            "row_width": self.manifest.row_width, "region_bytes": self.manifest.region_bytes,
            "generation": self.generation, "fingerprint": self.manifest.fingerprint,
            "content_digest": self.manifest.content_digest or None, "sources": self.sources(), "error": self.error or None,
        }
        r = self.region
        if r is not None and not r.closed:
            stats = r.stats
            out.update(
                resident_bytes=self.measure(),
                huge_page_bytes=stats.huge_bytes if stats else None,
                page_size=("2 MiB" if stats.huge_bytes else "4 KiB") if stats else None,
                huge_page_policy=stats.fill.policy if stats else None,
                huge_page_note=stats.fill.note if stats else "",
                sealed=region.is_sealed(r.fd),
                staging_seconds=round(stats.seconds, 3) if stats else None,
            )
            out["resident_share"] = self.resident_share
        return out


@dataclass(eq=False)
class Reload:
    """A reload under way: the tables being staged as new generations next to the ones being served."""

    config: Config
    tables: dict[str, TableState]  # new or changed tables, staging
    unchanged: list[str]
    removed: list[str]
    callers: list[Connection]
    started: float

    def summary(self, old: dict[str, TableState]) -> dict:
        return {
            "changed": sorted(n for n in self.tables if n in old), "added": sorted(n for n in self.tables if n not in old),
            "removed": sorted(self.removed), "unchanged": sorted(self.unchanged),
            "generations": {n: t.generation for n, t in self.tables.items()},
        }


class Daemon:
    def __init__(self, config: Config, *, proc_root: str = "/", sys_root: str = "/", env: dict | None = None) -> None:
        self.config = config
        self.proc_root = proc_root
        self.sys_root = sys_root
        self.env = os.environ if env is None else env
        self.tables: dict[str, TableState] = {}
        self.server: Server | None = None
        self.notifier = notify.Notifier(self.env)
        self._signals: list[int] = []
        self._stop = threading.Event()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._waiters: dict[str, list[Connection]] = {}
        self._started = time.monotonic()
        self._ready = False
        self._exit = 0
        self._event_w = -1
        self._next_watchdog = 0.0
        self._next_residency = 0.0
        self._extended = (0.0, -1)  # (when, bytes_done) at the last EXTEND_TIMEOUT_USEC
        self._status_sent = ""
        self._reload: Reload | None = None
        self._reload_again = False
        self._workers: list[threading.Thread] = []

    # Signal handlers record; the loop acts.
    def _on_signal(self, signum: int, frame) -> None:
        self._signals.append(signum)

    @property
    def regions(self) -> dict[str, Region]:
        return {n: t.region for n, t in self.tables.items() if t.region is not None}

    def run(self) -> int:
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        event_r, self._event_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            log.info("pled %s (pid %d) starting with %s: %d table(s)", __version__, os.getpid(), self.config.source,
                     len(self.config.tables))
            self._prepare(notify.listen_fds(self.env))
            self.server = Server(self.config.socket, Policy.for_this_process(self.config.allow_uids, self.config.allow_gids),
                                 self._handle, self._on_close)
            log.info("listening on %s", self.config.socket)
            self._start_staging([t for t in self.tables.values() if t.state != "ready"])
            if all(t.state == "ready" for t in self.tables.values()):
                self._on_all_ready()
            self._loop(wake_r, event_r)
            return self._exit
        finally:
            self._stop.set()
            for worker in self._workers:
                worker.join()
            self._drain_events()
            if self._reload is not None:
                self._abort_reload("pled is stopping")
            if self.server is not None:
                self.server.close()
            held = self.regions
            if held:
                stored = " (systemd's fd store keeps them for the next start)" if self.notifier.enabled else ""
                log.info("stopped: released %d table(s), %s%s", len(held),
                         gib(sum(r.manifest.region_bytes for r in held.values())), stored)
            for r in held.values():
                r.close()
            self.notifier.close()
            for s, handler in old.items():
                signal.signal(s, handler)
            signal.set_wakeup_fd(old_wakeup)
            for fd in (wake_r, wake_w, event_r, self._event_w):
                os.close(fd)

    def _prepare(self, stored: list[notify.StoredFd]) -> None:
        try:
            sidecars = open_tables(self.config)
        except PledError:
            for item in stored:  # keep systemd's copies: a fixed config may adopt them next time
                os.close(item.fd)
            raise
        planned = plan_tables(sidecars)
        sorted_fds = fdstore.sort_stored(stored, planned, self.notifier)
        for name, sidecar in sidecars.items():
            t = TableState(name, sidecar, planned[name], generation=sorted_fds.generations.get(name, 1))
            if name in sorted_fds.adopted:
                t.region, t.generation = sorted_fds.adopted[name]
                t.manifest = t.region.manifest  # with the content digests computed when it was staged
                t.state, t.origin, t.shards_done = "ready", "adopted", len(t.manifest.shards)
                log.info("table %s adopted from systemd's fd store: generation %d, %s, 0 bytes copied, sources unchanged",
                         name, t.generation, gib(t.manifest.region_bytes))
            self.tables[name] = t
        to_stage = {n: t.manifest for n, t in self.tables.items() if t.state != "ready"}
        if not to_stage:
            return
        verdict = run_preflight(self.config, to_stage, self.proc_root)
        for problem in verdict.problems:
            log.warning("preflight could not read %s", problem)
        (log.info if verdict.ok else log.error)("%s", verdict.message)
        if not verdict.ok:
            self.notifier.status(verdict.message)
        verdict.raise_if_refused()

    # -- staging (worker thread) -------------------------------------------------------------

    def _start_staging(self, states: list[TableState]) -> None:
        if not states:
            return
        worker = threading.Thread(target=self._stage_list, args=(states,), name="pled-staging", daemon=True)
        self._workers = [w for w in self._workers if w.is_alive()] + [worker]
        worker.start()

    def _stage_list(self, states: list[TableState]) -> None:
        """The staging thread: one table after another; each result goes to the loop as an event."""
        for t in states:
            if self._stop.is_set():
                break
            t.state = "staging"
            n = len(t.manifest.shards)

            def on_shard(shard, offset, seconds, t=t, n=n):
                t.shards_done += 1
                t.bytes_done += shard.size
                log.info("table %s: shard %d/%d %s %s in %.0f ms (%s)", t.name, shard.index + 1, n, shard.name,
                         gib(shard.size), seconds * 1000, rate(shard.size, seconds))

            try:
                r = staging.stage(t.name, t.sidecar, huge_pages=self.config.huge_pages, sys_root=self.sys_root,
                                  on_shard=on_shard, should_stop=self._stop.is_set,
                                  bandwidth=self.config.staging_bandwidth)
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

    def _post(self, event) -> None:
        self._events.put(event)
        os.write(self._event_w, b"!")

    # -- the loop (main thread) --------------------------------------------------------------

    def _loop(self, wake_r: int, event_r: int) -> None:
        tick = min(1.0, self.notifier.watchdog_interval or 1.0)
        with selectors.DefaultSelector() as sel:
            sel.register(wake_r, selectors.EVENT_READ, lambda mask: self._on_wakeup(wake_r))
            sel.register(event_r, selectors.EVENT_READ, lambda mask: (self._empty(event_r), self._drain_events()))
            self.server.register(sel)
            try:
                while not self._stop.is_set():
                    for key, mask in sel.select(timeout=tick):
                        key.data(mask)
                        if self._stop.is_set():
                            break
                    self.server.expire()
                    self._tick(time.monotonic())
            finally:
                self.server.unregister()

    def _tick(self, now: float) -> None:
        """Once per loop turn: feed the watchdog, report progress, check residency."""
        if self.notifier.watchdog_interval and now >= self._next_watchdog and self._healthy():
            self.notifier.watchdog()
            self._next_watchdog = now + self.notifier.watchdog_interval
        pending = list(self.tables.values()) + (list(self._reload.tables.values()) if self._reload else [])
        staging_now = [t for t in pending if t.state == "staging"]  # a reload's stagings extend its timeout too
        if staging_now:
            t = staging_now[0]
            when, done = self._extended
            if t.bytes_done != done and now - when >= EXTEND_EVERY:
                # Only while bytes keep arriving: a disk that hangs still trips TimeoutStartSec.
                self.notifier.extend_timeout(EXTEND_BY)
                self._extended = (now, t.bytes_done)
            self._set_status(f"staging {t.name} from {t.sidecar.source}: shard {t.shards_done}/{len(t.manifest.shards)}, "
                             f"{gib(t.bytes_done)} of {gib(t.manifest.source_bytes)}")
        elif self._ready and now >= self._next_residency:
            self._next_residency = now + RESIDENCY_EVERY
            self._check_residency()

    def _healthy(self) -> bool:
        return not any(t.state == "failed" for t in self.tables.values())

    def _check_residency(self) -> None:
        for t in self.tables.values():
            if t.region is None:
                continue
            t.measure()
            share = t.resident_share
            if share < 0.9995:
                log.warning("table %s is only %.1f%% resident (%s of %s); its pages were swapped out: set "
                            "MemorySwapMax=0 for pled.service or turn swap off", t.name, share * 100,
                            gib(share * t.manifest.region_bytes), gib(t.manifest.region_bytes))
        self._set_status(self._serving_status())

    def _serving_status(self) -> str:
        tables = list(self.tables.values())
        total = sum(t.manifest.region_bytes for t in tables)
        shares = [t.resident_share for t in tables if t.resident_share is not None]
        resident = f", {min(shares):.0%} resident" if shares else ""
        clients = sum(1 for c in self.server.connections.values() if c.attached) if self.server else 0
        return f"serving {len(tables)} table(s), {gib(total)}{resident}; {clients} client(s)"

    def _set_status(self, text: str) -> None:
        if text != self._status_sent:
            self.notifier.status(text)
            self._status_sent = text

    @staticmethod
    def _empty(fd: int) -> None:
        try:
            while os.read(fd, 4096):
                pass
        except BlockingIOError:
            pass

    def _on_wakeup(self, wake_r: int) -> None:
        self._empty(wake_r)
        while self._signals:
            signum = self._signals.pop(0)
            if signum in (signal.SIGTERM, signal.SIGINT):
                log.info("%s: stopping", signal.Signals(signum).name)
                self.notifier.stopping()
                self._stop.set()
            elif signum == signal.SIGHUP:
                log.info("SIGHUP: reloading %s", self.config.source)
                self._begin_reload(None)

    def _drain_events(self) -> None:
        while True:
            try:
                kind, t, payload = self._events.get_nowait()
            except queue.Empty:
                return
            if self._reload is not None and t in self._reload.tables.values():
                self._reload_event(kind, t, payload)
                continue
            if kind == "ready":
                t.staged(payload)
                if self.notifier.store_fd(payload.fd, notify.fd_name(t.name, t.generation)):
                    log.info("table %s generation %d handed to systemd's fd store", t.name, t.generation)
                if self.server is not None:
                    for conn in self._waiters.pop(t.name, []):
                        self.server.send(conn, self._attach(conn, t))
                if all(x.state == "ready" for x in self.tables.values()):
                    self._on_all_ready()
            elif kind == "failed":
                t.state, t.error = "failed", str(payload)
                log.error("staging table %s failed: %s", t.name, payload)
                self.notifier.status(f"failed: table {t.name}: {payload}")
                self._exit = getattr(payload, "exit_status", 1) or 1
                self._stop.set()
            else:
                t.state = "waiting"
                log.info("%s", payload)

    # -- reload: new generations next to the old, then a switch --------------------------------

    def _begin_reload(self, caller: Connection | None):
        """Re-read the config; stage new and changed tables beside the served ones. Returns PENDING or an error."""
        if self._reload is not None or not self._ready:
            if caller is None:
                self._reload_again = True
                log.info("a reload or the first staging is under way; reloading again once it is done")
                return None
            if self._reload is not None:
                self._reload.callers.append(caller)  # it will answer this caller too
                return PENDING
            return Reply(protocol.error(protocol.RELOAD_FAILED, reason="the first staging is still under way; try again"))
        self.notifier.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}",
                           f"STATUS=reloading {self.config.source}")
        try:
            config = config_mod.load(self.config.source)
            sidecars = open_tables(config)
            fresh, unchanged = {}, []
            for name, sidecar in sidecars.items():
                planned = region.plan(name, sidecar)
                cur = self.tables.get(name)
                if cur is not None and cur.manifest.identity() == planned.identity():
                    unchanged.append(name)
                    continue
                fresh[name] = TableState(name, sidecar, planned, generation=(cur.generation + 1) if cur else 1)
            removed = [n for n in self.tables if n not in sidecars]
            if fresh:
                verdict = run_preflight(config, {n: t.manifest for n, t in fresh.items()}, self.proc_root)
                (log.info if verdict.ok else log.error)("reload %s", verdict.message)
                verdict.raise_if_refused()
        except PledError as err:
            return self._reload_failed(str(err), [])  # the caller gets the returned reply
        self._reload = Reload(config, fresh, unchanged, removed, [caller] if caller else [], time.monotonic())
        for t in fresh.values():
            old = self.tables.get(t.name)
            log.info("reload: staging table %s as generation %d%s", t.name, t.generation,
                     f" next to generation {old.generation}" if old else " (new table)")
        if fresh:
            self._start_staging(list(fresh.values()))
        else:
            self._commit_reload()
        return PENDING if caller else None

    def _reload_event(self, kind: str, t: TableState, payload) -> None:
        if kind == "ready":
            t.staged(payload)
            if all(x.state == "ready" for x in self._reload.tables.values()):
                self._commit_reload()
        elif kind == "failed":
            t.state, t.error = "failed", str(payload)
            self._abort_reload(f"staging table {t.name} failed: {payload}")
        else:
            self._abort_reload(str(payload))

    def _commit_reload(self) -> None:
        """The switch: new attaches get the new generations; the old regions are let go."""
        r, self._reload = self._reload, None
        summary = r.summary(self.tables)
        for name, new in r.tables.items():
            old = self.tables.get(name)
            self.tables[name] = new
            self.notifier.store_fd(new.region.fd, notify.fd_name(name, new.generation))
            if old is not None:
                self._release(old, f"generation {new.generation} now served")
        for name in r.removed:
            self._release(self.tables.pop(name), "removed from the config: no longer offered")
        if r.config.socket != self.config.socket:
            log.warning("the socket moved to %s in the config; pled keeps serving on %s until it restarts",
                        r.config.socket, self.config.socket)
            r.config = r.config.model_copy(update={"socket": self.config.socket})
            r.config._source = self.config.source
        self.config = r.config
        if self.server is not None:
            self.server.policy = Policy.for_this_process(r.config.allow_uids, r.config.allow_gids)
        log.info("reload done in %.1f s: %s", time.monotonic() - r.started,
                 ", ".join(f"{k} {', '.join(v)}" for k, v in summary.items() if v and k != "generations") or "nothing changed")
        self._after_reload(r.callers, Reply(protocol.reply(**summary)))

    def _release(self, old: TableState, why: str) -> None:
        holders = sum(1 for c in (self.server.connections.values() if self.server else ()) if c.attached.get(old.name) == old.generation)
        self.notifier.remove_fd(notify.fd_name(old.name, old.generation))
        old.region.close()
        log.info("table %s generation %d released (%s); %d client(s) still map it, and its memory is freed when the "
                 "last of them unmaps", old.name, old.generation, why, holders)

    def _abort_reload(self, why: str) -> None:
        r, self._reload = self._reload, None
        for t in r.tables.values():
            if t.region is not None:
                t.region.close()
        self._reload_failed(why, r.callers)

    def _reload_failed(self, why: str, callers: list[Connection]) -> Reply:
        """Log it, tell systemd we serve as before, answer ``callers``; the reply is also returned."""
        log.error("reload failed, nothing changed: %s", why)
        reply = Reply(protocol.error(protocol.RELOAD_FAILED, reason=why))
        self._after_reload(callers, reply)
        return reply

    def _after_reload(self, callers: list[Connection], reply: Reply) -> None:
        for conn in callers:
            if self.server is not None:
                self.server.send(conn, reply)
        self._announce_ready()

    def _announce_ready(self) -> None:
        """READY=1 with what is served; then a reload asked for (SIGHUP) while this was not possible."""
        if self._stop.is_set():  # never READY=1 after STOPPING=1
            return
        self._status_sent = self._serving_status()
        self.notifier.ready(self._status_sent)
        if self._reload_again and self._reload is None:
            self._reload_again = False
            self._begin_reload(None)

    def _on_all_ready(self) -> None:
        if self._stop.is_set() or self._ready:
            return
        self._ready = True
        tables = list(self.tables.values())
        total = sum(t.manifest.region_bytes for t in tables)
        copied = sum(t.bytes_done for t in tables)
        seconds = time.monotonic() - self._started
        rss = psutil.Process().memory_info().rss
        for t in tables:
            t.measure()
        log.info("ready: %d table(s), %s in sealed memfds (%d adopted, %s copied) in %.1f s; pled's own memory %s RSS; "
                 "serving on %s", len(tables), gib(total), sum(t.origin == "adopted" for t in tables), gib(copied),
                 seconds, gib(rss), self.config.socket)
        self._next_residency = time.monotonic() + RESIDENCY_EVERY
        self._announce_ready()

    # -- calls -------------------------------------------------------------------------------

    def _handle(self, conn: Connection, method: str, params: dict):
        if method == protocol.PING:
            return Reply(protocol.reply())
        if method == protocol.STATUS:
            return Reply(protocol.reply(**self.status()))
        if method == protocol.RELOAD:
            if conn.peer.uid not in (0, os.geteuid()):
                log.warning("refused io.pled.Reload from %s: only root and pled's own user may reload", conn.peer.describe())
                return Reply(protocol.error(protocol.PERMISSION_DENIED, uid=conn.peer.uid))
            return self._begin_reload(conn)
        if method == protocol.ATTACH:
            name = params.get("table")
            if not isinstance(name, str):
                return Reply(protocol.error(protocol.INVALID_PARAMETER, parameter="table"))
            t = self.tables.get(name)
            if t is None:
                return Reply(protocol.error(protocol.NO_SUCH_TABLE, table=name, tables=sorted(self.tables)))
            if t.state != "ready":
                if params.get("wait") is True and t.state != "failed":
                    self._waiters.setdefault(name, []).append(conn)
                    return PENDING
                return Reply(protocol.error(protocol.NOT_READY, **t.progress()))
            return self._attach(conn, t)
        return Reply(protocol.error(protocol.METHOD_NOT_FOUND, method=method))

    def _attach(self, conn: Connection, t: TableState) -> Reply:
        first = t.name not in conn.attached
        conn.attached[t.name] = t.generation
        if first:
            log.info("client attached: table %s generation %d to %s; %d client(s) attached",
                     t.name, t.generation, conn.peer.describe(), self._attached_count())
            if self._ready:
                self._set_status(self._serving_status())
        # The manifest itself travels in the region's header; the reply names what the client must find there.
        return Reply(protocol.reply(table=t.name, generation=t.generation, fingerprint=t.manifest.fingerprint,
                                    region_bytes=t.manifest.region_bytes), fds=(t.region.fd,))

    def _attached_count(self) -> int:
        return sum(1 for c in self.server.connections.values() if c.attached)

    def _on_close(self, conn: Connection) -> None:
        for waiting in self._waiters.values():
            if conn in waiting:
                waiting.remove(conn)
        if conn.attached:
            log.info("client detached: %s (table %s); %d client(s) attached", conn.peer.describe(),
                     ", ".join(conn.attached), self._attached_count())
            if self._ready and not self._stop.is_set():
                self._set_status(self._serving_status())

    def status(self) -> dict:
        clients = [
            {"pid": c.peer.pid, "uid": c.peer.uid, "command": c.peer.command, "tables": sorted(c.attached),
             "generations": dict(c.attached),
             "connected_seconds": round(time.monotonic() - c.since, 1)}
            for c in (self.server.connections.values() if self.server else ()) if c.attached
        ]
        reload = None
        if self._reload is not None:
            reload = {"tables": [t.progress() | {"generation": t.generation} for t in self._reload.tables.values()],
                      "removed": self._reload.removed, "seconds": round(time.monotonic() - self._reload.started, 1)}
        return {
            "version": __version__, "pid": os.getpid(), "uptime_seconds": round(time.monotonic() - self._started, 1),
            "socket": self.config.socket, "tables": [t.status() for t in self.tables.values()], "clients": clients,
            "reload": reload,
        }
