"""The calls pled answers (io.pled.Ping, Status, Reload, Attach), and who is attached to what.

The server calls a ``Handlers`` with each parsed call; a handler returns a Reply, or PENDING when the
answer comes later (an Attach that waits for its table, a Reload): ``answer`` sends it then. An exception a
handler raises becomes that caller's io.pled.InternalError in the server; it never reaches the loop. The
handlers read the tables and the config from the registry and change neither.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection

from pled.daemon import tables
from pled.daemon.health import journal
from pled.daemon.health.counters import Counters
from pled.daemon.health.throttle import Budget
from pled.daemon.memory import hostmem
from pled.daemon.registry import Registry
from pled.daemon.reload import Reloader
from pled.daemon.serving import fdlimit
from pled.daemon.serving.server import PENDING
from pled.daemon.serving.session import Reply, Session
from pled.daemon.systemd.fdstore import FdStore
from pled.daemon.tables import State, TableState
from pled.shared import protocol, region
from pled.shared.boundary import clip

log = logging.getLogger(__name__)


def attached_count(connections: Collection[Session]) -> int:
    return sum(1 for c in connections if c.attached)


def holders(connections: Collection[Session], name: str, generation: int) -> int:
    """How many of ``connections`` are attached to that generation of table ``name``."""
    return sum(1 for c in connections if c.attached.get(name) == generation)


class Handlers:
    def __init__(self, registry: Registry, reloader: Reloader, *, answer: Callable[[Session, Reply], None],
                 connections: Callable[[], Collection[Session]], clients_changed: Callable[[], None],
                 started: float, counters: Counters, fdstore: FdStore,
                 lingering: Callable[[], Collection[Session]] = tuple,
                 metrics_error: Callable[[], str | None] = lambda: None) -> None:
        """``answer(conn, reply)`` sends the later reply to a call that got PENDING; ``connections()`` are the
        server's open connections; ``clients_changed()`` is told when a client attaches or leaves; ``counters``
        counts attaches and refusals, and goes out in Status with the fd store's figures."""
        self.registry = registry
        self.counters = counters
        self.fdstore = fdstore
        self.reloader = reloader
        self.answer = answer
        self.connections = connections
        self.lingering = lingering  # connections dropped whose peers have table fds unread (session.Lingering)
        self.metrics_error = metrics_error  # why the metrics file cannot be written (metrics_file.MetricsFile.error)
        self.clients_changed = clients_changed
        self.started = started
        self.waiters: dict[str, list[Session]] = {}  # table -> connections waiting for it to be ready
        self._lines = Budget()  # attach, detach and refused-reload lines, per peer uid: no uid floods the log
        self._methods = {protocol.PING: self.ping, protocol.STATUS: self.status, protocol.RELOAD: self.reload,
                         protocol.ATTACH: self.attach}

    def __call__(self, conn: Session, method: str, params: dict):
        handler = self._methods.get(method)
        if handler is None:
            return Reply(protocol.error(protocol.METHOD_NOT_FOUND, method=clip(method, 200)))
        return handler(conn, params)

    # -- the methods -------------------------------------------------------------------------

    def ping(self, conn: Session, params: dict) -> Reply:
        return Reply(protocol.reply())

    def status(self, conn: Session, params: dict) -> Reply:
        return Reply(protocol.reply(**self.status_dict()))

    def reload(self, conn: Session, params: dict):
        if conn.peer.uid not in (0, os.geteuid()):
            self.counters.refuse("reload_access")
            self._lines.log(("reload", conn.peer.uid), log.warning, "refused io.pled.Reload from %s: only root and "
                            "pled's own user may reload", conn.peer.describe(), extra=journal.fields(peer=conn.peer))
            return Reply(protocol.error(protocol.PERMISSION_DENIED, uid=conn.peer.uid))
        restage = params.get("restage", [])  # `pled verify --repair`: writable tables it found changed
        if not isinstance(restage, list) or len(restage) > 1024 or not all(isinstance(n, str) for n in restage):
            return Reply(protocol.error(protocol.INVALID_PARAMETER, parameter="restage"))
        return self.reloader.begin(conn, frozenset(restage))

    def attach(self, conn: Session, params: dict):
        name = params.get("table")
        if not isinstance(name, str):
            return Reply(protocol.error(protocol.INVALID_PARAMETER, parameter="table"))
        served = self.registry.tables
        t = served.get(name)
        if t is None:
            self.counters.refuse("no_such_table")
            return Reply(protocol.error(protocol.NO_SUCH_TABLE, table=clip(name, 200), tables=sorted(served)))
        if t.state is not State.READY:
            if params.get("wait") is True and t.state is not State.FAILED:
                self.waiters.setdefault(name, []).append(conn)
                return PENDING
            self.counters.refuse("not_ready")
            return Reply(protocol.error(protocol.NOT_READY, **t.progress()))
        return self.attach_reply(conn, t)

    # -- bookkeeping -------------------------------------------------------------------------

    def table_ready(self, t: TableState) -> None:
        for conn in self.waiters.pop(t.name, []):
            self.answer(conn, self.attach_reply(conn, t))

    def attach_reply(self, conn: Session, t: TableState) -> Reply:
        """The reply carries the region (a read-only fd of its own, opened when it is queued); the client counts
        as attached once the kernel has accepted the message that carries it, not before."""
        # The manifest itself travels in the region's header; the reply names what the client must find there.
        # What the client is told of the GPU side, and whether it gets the read-write fd, follows the region itself
        # (a writable one is not write-sealed) and the config in force now (its writers).
        cfg = self.registry.config.table(t.name)
        writable = t.writable
        writer = writable and cfg is not None and conn.peer.uid in cfg.writer_uids
        routes = list(cfg.gpu_routes) if cfg is not None else ["read-only", "pageable"]
        # A writable region's header is in reach of its writers: the client checks it against the one pled staged.
        staged = {"manifest_sha256": region.staged_manifest_sha256(t.header)} if writable and t.header else {}
        return Reply(protocol.reply(table=t.name, generation=t.generation, fingerprint=t.manifest.fingerprint,
                                    region_bytes=t.manifest.region_bytes,
                                    gpu_access="writable" if writable else "read-only", gpu_routes=routes,
                                    writer=writer, **staged),
                     regions=(t.region,), writable=writer,
                     on_sent=lambda: self._attached(conn, t.name, t.generation, writer))

    def _attached(self, conn: Session, name: str, generation: int, writer: bool = False) -> None:
        first = name not in conn.attached
        conn.attached[name] = generation
        if writer:
            conn.writes.add(name)
        self.counters.attached()
        if first:
            self._lines.log(conn.peer.uid, log.info, "client attached: table %s generation %d to %s%s; %d client(s) "
                            "attached", name, generation, conn.peer.describe(),
                            " with a read-write fd (a writer: gpu_access = \"writable\")" if writer else "",
                            self.attached_count(),
                            extra=journal.fields("client_attached", table=name, generation=generation, peer=conn.peer))
            self.clients_changed()

    def attached_count(self) -> int:
        return attached_count(self.connections())

    def on_close(self, conn: Session) -> None:
        for waiting in self.waiters.values():
            if conn in waiting:
                waiting.remove(conn)
        self.reloader.forget(conn)
        if conn.attached:
            self._lines.log(conn.peer.uid, log.info, "client detached: %s (table %s); %d client(s) attached",
                            conn.peer.describe(), ", ".join(conn.attached), self.attached_count(),
                            extra=journal.fields("client_detached", table=list(conn.attached), peer=conn.peer))
            self.clients_changed()

    def status_dict(self, sources: bool = True) -> dict:
        """The Status reply; ``sources=False`` leaves out the stat of the source files (a hung file system can hold
        it): the metrics' snapshot, made in the loop thread."""
        connections = self.connections()
        return tables.status_reply(started=self.started, socket=self.registry.config.socket,
                                   tables=list(self.registry.tables.values()), connections=connections,
                                   reload=self.reloader.progress(), daemon=self.daemon_dict(connections),
                                   sources=sources)

    def daemon_dict(self, connections: Collection[Session]) -> dict:
        """Status's ``daemon``: the counts since pled started, connections, fds, the fd store, pled's memory."""
        store = self.fdstore
        closed = self.lingering()
        return self.counters.snapshot() | {
            "connections": len(connections), "clients": attached_count(connections),
            "fds_in_flight": sum(c.fds_in_flight() for c in [*connections, *closed]),
            "closed_with_fds_unread": len(closed),
            "open_fds": fdlimit.open_fds(), "max_fds": fdlimit.soft_limit(),
            "fdstore": {"entries": len(store.names), "max_entries": store.limit if store.enabled else 0},
            "resident_memory_bytes": hostmem.own_rss(), "metrics_file_error": self.metrics_error(),
        }
