"""The calls pled answers (io.pled.Ping, Status, Reload, Attach), and who is attached to what.

The server calls a ``Handlers`` with each parsed call; a handler returns a Reply, or PENDING when the
answer comes later (an Attach that waits for its table, a Reload). An exception a handler raises becomes
that caller's io.pled.InternalError in the server; it never reaches the loop.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from pled.shared import protocol
from pled.daemon import tables
from pled.shared.boundary import clip
from pled.daemon.session import Reply, Session
from pled.daemon.server import PENDING

if TYPE_CHECKING:
    from pled.daemon.lifecycle import Daemon
    from pled.daemon.tables import TableState

log = logging.getLogger(__name__)


class Handlers:
    def __init__(self, daemon: "Daemon") -> None:
        self.d = daemon
        self.waiters: dict[str, list[Session]] = {}  # table -> connections waiting for it to be ready
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
            log.warning("refused io.pled.Reload from %s: only root and pled's own user may reload", conn.peer.describe())
            return Reply(protocol.error(protocol.PERMISSION_DENIED, uid=conn.peer.uid))
        result = self.d.reloader.begin(conn)
        if result is PENDING:
            conn.pending += 1
        return result

    def attach(self, conn: Session, params: dict):
        name = params.get("table")
        if not isinstance(name, str):
            return Reply(protocol.error(protocol.INVALID_PARAMETER, parameter="table"))
        t = self.d.tables.get(name)
        if t is None:
            return Reply(protocol.error(protocol.NO_SUCH_TABLE, table=clip(name, 200), tables=sorted(self.d.tables)))
        if t.state != "ready":
            if params.get("wait") is True and t.state != "failed":
                self.waiters.setdefault(name, []).append(conn)
                conn.pending += 1
                return PENDING
            return Reply(protocol.error(protocol.NOT_READY, **t.progress()))
        return self.attach_reply(conn, t)

    # -- bookkeeping -------------------------------------------------------------------------

    def answer(self, conn: Session, reply: Reply) -> None:
        """The later reply to a call that got PENDING."""
        conn.pending = max(0, conn.pending - 1)
        if self.d.server is not None:
            self.d.server.send(conn, reply)
            self.d.server.resume(conn)

    def table_ready(self, t: "TableState") -> None:
        for conn in self.waiters.pop(t.name, []):
            self.answer(conn, self.attach_reply(conn, t))

    def attach_reply(self, conn: Session, t: "TableState") -> Reply:
        """The reply carries the region (a read-only fd of its own, opened when it is queued); the client counts
        as attached once the kernel has accepted the message that carries it, not before."""
        # The manifest itself travels in the region's header; the reply names what the client must find there.
        return Reply(protocol.reply(table=t.name, generation=t.generation, fingerprint=t.manifest.fingerprint,
                                    region_bytes=t.manifest.region_bytes), regions=(t.region,),
                     on_sent=lambda: self._attached(conn, t.name, t.generation))

    def _attached(self, conn: Session, name: str, generation: int) -> None:
        first = name not in conn.attached
        conn.attached[name] = generation
        if first:
            log.info("client attached: table %s generation %d to %s; %d client(s) attached",
                     name, generation, conn.peer.describe(), self.attached_count())
            if self.d.ready:
                self.d.set_status(self.d.serving_line())

    def attached_count(self) -> int:
        server = self.d.server
        return sum(1 for c in server.connections.values() if c.attached) if server else 0

    def holders(self, name: str, generation: int) -> int:
        server = self.d.server
        return sum(1 for c in (server.connections.values() if server else ()) if c.attached.get(name) == generation)

    def on_close(self, conn: Session) -> None:
        for waiting in self.waiters.values():
            if conn in waiting:
                waiting.remove(conn)
        self.d.reloader.forget(conn)
        if conn.attached:
            log.info("client detached: %s (table %s); %d client(s) attached", conn.peer.describe(),
                     ", ".join(conn.attached), self.attached_count())
            if self.d.ready and not self.d.stopping.is_set():
                self.d.set_status(self.d.serving_line())

    def status_dict(self) -> dict:
        server = self.d.server
        return tables.status_reply(started=self.d.started, socket=self.d.config.socket,
                                   tables=list(self.d.tables.values()),
                                   connections=server.connections.values() if server else (),
                                   reload=self.d.reloader.progress())
