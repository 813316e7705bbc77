"""The socket clients attach through: non-blocking, single-threaded, hard to upset.

Every connection is checked with SO_PEERCRED when accepted. Calls are bounded in size and nesting; a connection
with half a message, or an unread reply, older than CALL_TIMEOUT is dropped, and so is one past its bound on unread
replies or fds in flight (session.py; fds unread count until the peer has them: Lingering). Connections are capped
below the open-file limit, per uid too (fdlimit.py): at the cap an idle one (no table, no call) makes room, and
while accept() finds no fd the listener rests. Whatever goes wrong with one connection, a bug included, ends in its
error reply or its drop, logged, never in the loop. A client stays connected while it holds a table: its close is
the detach. The listener and the connections are watched through the daemon's Loop (loop.py), from the server's
start until it stops listening or closes.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from functools import partial

from pled.daemon.health import journal
from pled.daemon.health.counters import Counters
from pled.daemon.health.throttle import Budget, Throttle
from pled.daemon.serving import fdlimit, session
from pled.daemon.serving.access import Policy
from pled.daemon.serving.admission import Admission
from pled.daemon.serving.listener import bind
from pled.daemon.serving.loop import READ, WRITE, Loop
from pled.daemon.serving.session import CALL_TIMEOUT, Outgoing, Reply, Session
from pled.shared import protocol
from pled.shared.boundary import clip

__all__ = ["CALL_TIMEOUT", "Session", "PENDING", "Reply", "Server"]

log = logging.getLogger(__name__)

CALLS_PER_TURN = 1  # calls of one connection handled in one turn of the loop (each other ready fd gets its turn)

MAX_HELD = 64  # calls a client may send behind one still waiting for its answer
PENDING = object()  # a handler's answer when the reply comes later (Attach with wait, Reload): see answer()


Handler = Callable[[Session, str, dict], "Reply | object"]


class Server(Admission):
    def __init__(self, path: str, policy: Policy, handler: Handler, on_close: Callable[[Session], None], loop: Loop,
                 *, max_connections: int, fd_budget: fdlimit.FdBudget, counters: Counters) -> None:
        self.path = path
        self.counters = counters
        self.policy = policy
        self.handler = handler
        self.on_close = on_close
        self.max_connections = max_connections
        self.fd_budget = fd_budget
        self.listener = bind(path)
        self.connections: dict[int, Session] = {}
        self.lingering = session.Lingering()  # dropped connections whose peers have table fds unread
        self._paused_until: float | None = None  # the listener rests while no fd is free
        self._throttle = Throttle()
        self._refusals = Budget()  # lines for peers refused by the access policy, per uid: one cannot flood the log
        self._loop: Loop | None = loop  # None once the server has left the loop: nothing more is read or sent
        loop.watch(self.listener, self._accept)

    def _leave_loop(self) -> None:
        """Stop watching every socket; they stay open until close()."""
        if self._loop is not None:
            for conn in self.connections.values():
                self._loop.unwatch(conn.sock)
            if self._paused_until is None:
                self._loop.unwatch(self.listener)
            self._loop = None

    def stop_listening(self) -> None:
        """pled is stopping: from now on a client is refused (ECONNREFUSED), not kept waiting; close() does the rest."""
        self._leave_loop()
        self.listener.close()

    def close(self) -> None:
        self._leave_loop()
        for conn in list(self.connections.values()):
            self._drop(conn, None)
        self.lingering.close()
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)

    # -- accepting ---------------------------------------------------------------------------

    # -- reading and dispatching -------------------------------------------------------------

    def _ready(self, conn: Session, mask: int) -> None:
        try:
            if mask & WRITE:
                self._flush(conn)
            if mask & READ and self._live(conn) and not (conn.inbox and not conn.pending):
                self._read(conn)  # (calls still to handle: none read meanwhile; MAX_HELD bounds those behind one)
            else:
                self._pump(conn)  # the reply went: the calls that waited behind it
        except Exception as err:  # a bug handling one connection ends that connection, never the loop
            self._throttle.log(("bug", type(err).__name__), log.exception, "dropping %s: handling it failed: %s",
                               conn.peer.describe(), clip(err), extra=journal.fields("client_dropped", peer=conn.peer))
            self._drop(conn, None, "internal_error")

    def _live(self, conn: Session) -> bool:
        return self.connections.get(conn.fd) is conn and not conn.closing

    def _read(self, conn: Session) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn, None)
            return
        if not data:
            self._drop(conn, None)
            return
        try:
            messages = conn.framer.feed(data)
        except protocol.MessageTooLong as err:
            self._fail(conn, protocol.INVALID_MESSAGE, str(err))
            return
        conn.inbox.extend(messages)
        if conn.pending and len(conn.inbox) > MAX_HELD:  # (no reply to read holds this peer back: bound it here)
            self._fail(conn, protocol.INVALID_MESSAGE, f"over {MAX_HELD} calls sent behind one still waiting")
            return
        if not conn.framer.pending:
            conn.stalled_since = None
        elif messages or conn.stalled_since is None:  # a new call began: its own CALL_TIMEOUT
            conn.stalled_since = time.monotonic()
        self._pump(conn)

    def answer(self, conn: Session, reply: Reply) -> None:
        """The later reply to a call that got PENDING; then the calls received behind it (replies keep call order)."""
        conn.pending = max(0, conn.pending - 1)
        self.send(conn, reply)
        self._ready(conn, 0)

    def _pump(self, conn: Session) -> None:
        """Handle a received call (CALLS_PER_TURN) if no reply waits to be read and no call waits for its answer
        (replies go out in call order: docs/protocol.md), then watch for what comes next. Calls left over are the
        loop's work for its next turn (``Loop.soon``), after the fds ready then: a peer that packs thousands of calls
        into one write delays nobody else's."""
        for _ in range(CALLS_PER_TURN):
            if not self._may_handle(conn):
                break
            conn.last_active = time.monotonic()
            self._dispatch(conn, conn.inbox.popleft())
        if self._loop is not None and not conn.scheduled and self._may_handle(conn):
            conn.scheduled = True
            self._loop.soon(partial(self._next_call, conn))
        self._watch(conn)

    def _may_handle(self, conn: Session) -> bool:
        """A received call may be handled now: no reply waits to be read, no call waits for its answer."""
        return bool(conn.inbox) and not conn.out and not conn.pending and self._live(conn)

    def _next_call(self, conn: Session) -> None:
        conn.scheduled = False
        if self.connections.get(conn.fd) is conn:
            self._ready(conn, 0)

    def _watch(self, conn: Session) -> None:
        """Write while a reply waits, else read: a peer that leaves replies unread gets no more (its calls wait)."""
        if self._loop is not None and self.connections.get(conn.fd) is conn:
            self._loop.want(conn.sock, WRITE if conn.out else READ)

    def _dispatch(self, conn: Session, raw: bytes) -> None:
        if not conn.allowed:
            self.counters.refuse("access")
            self._refusals.log(conn.peer.uid, log.warning, "refused %s: not root, not pled's user or group, not in "
                               "allow_uids or allow_groups", conn.peer.describe(),
                               extra=journal.fields("client_refused", peer=conn.peer))
            self.send(conn, Reply(protocol.error(protocol.PERMISSION_DENIED, uid=conn.peer.uid), close_after=True))
            return
        try:
            method, parameters = protocol.parse_call(raw)
        except ValueError as err:
            self._fail(conn, protocol.INVALID_MESSAGE, str(err))
            return
        try:
            result = self.handler(conn, method, parameters)
        except Exception as err:  # a bug in a handler is this call's error, not the daemon's end
            self._throttle.log(("handler", clip(method, 64), type(err).__name__), log.exception,
                               "%s from %s failed: %s", clip(method, 64), conn.peer.describe(), clip(err))
            result = Reply(protocol.error(protocol.INTERNAL_ERROR, method=clip(method, 64),
                                          reason=f"{type(err).__name__}: {clip(err)}"))
        if result is PENDING:
            conn.pending += 1  # answer() sends its reply
        else:
            self.send(conn, result)

    def _fail(self, conn: Session, name: str, reason: str) -> None:
        self.counters.drop("invalid_message")  # the connection closes once its error reply is written
        self._throttle.log(("fail", conn.peer.uid), log.warning, "dropping %s: %s", conn.peer.describe(), clip(reason),
                           extra=journal.fields("client_dropped", peer=conn.peer))
        self.send(conn, Reply(protocol.error(name, reason=clip(reason)), close_after=True))

    # -- replies -----------------------------------------------------------------------------

    def send(self, conn: Session, reply: Reply) -> None:
        if self._loop is None or not self._live(conn):
            return  # shutting down, or the peer is gone
        try:
            if reply.regions and not self._room_for_fds(conn, len(reply.regions)):
                return
            data = protocol.encode(reply.message)
            for victim, why in session.unread_drops(conn, list(self.connections.values()), len(data)):
                self._drop(victim, why, "unread_replies")
            if not self._live(conn):
                return
            conn.queue(self._outgoing(conn, data, reply))
            conn.closing = reply.close_after
            self._flush(conn)
        except Exception as err:
            self._throttle.log(("send", type(err).__name__), log.exception, "dropping %s: sending a reply failed: %s",
                               conn.peer.describe(), clip(err), extra=journal.fields("client_dropped", peer=conn.peer))
            self._drop(conn, None, "internal_error")

    def _outgoing(self, conn: Session, data: bytes, reply: Reply) -> Outgoing:
        """The reply with fds of its own for its regions; without a free fd, the caller's error instead."""
        try:
            return Outgoing.of(data, reply)
        except OSError as err:
            self._throttle.log("nofd", log.warning, "cannot send a table to %s: %s (%d connections open; raise "
                               "LimitNOFILE=)", conn.peer.describe(), err.strerror, len(self.connections))
            reason = f"no fd free ({err.strerror})"
            return Outgoing(protocol.encode(protocol.error(protocol.INTERNAL_ERROR, reason=reason)), [])

    def _room_for_fds(self, conn: Session, n: int) -> bool:
        """Bound the table fds sent, not yet received, per connection, uid and in all (session.fd_budget_drops)."""
        for victim, why in session.fd_budget_drops(conn, list(self.connections.values()), n, self.fd_budget,
                                                   self.lingering, (0, self.policy.own_uid)):
            self._drop(victim, why, "fds_in_flight")
        return self._live(conn)

    def _flush(self, conn: Session) -> None:
        while conn.out:
            reply = conn.out[0]
            try:
                if reply.fds:
                    sent = socket.send_fds(conn.sock, [reply.data], reply.fds)
                else:
                    sent = conn.sock.send(reply.data)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as err:
                if err.errno == errno.ETOOMANYREFS and self._too_many_refs(conn):
                    break  # the reply (with its own fds) waits; the stall clock runs for it as for any other
                if err.errno != errno.ETOOMANYREFS:  # the peer went away mid-reply
                    self._drop(conn, None)
                return
            on_sent = conn.sent(sent)
            if on_sent is not None:
                on_sent()  # the kernel took the fds: now the peer holds them
        if conn.out:
            conn.stalled_since = conn.stalled_since or time.monotonic()
        else:
            conn.stalled_since = time.monotonic() if conn.framer.pending else None
            if conn.closing:
                self._drop(conn, None)
                return
        self._watch(conn)

    def _too_many_refs(self, conn: Session) -> bool:
        """The kernel refuses more fds in flight for pled's user: the connection holding most of them goes.
        True if that was another one, so ``conn``'s reply waits (holding its own fds) and is tried again."""
        greedy = session.greediest(conn, self.connections.values())
        self._drop(greedy, f"the kernel refuses to send more table fds (ETOOMANYREFS); this connection holds "
                           f"{greedy.fds_in_flight()} unread", "fds_in_flight")
        return greedy is not conn and self._live(conn)

    def _drop(self, conn: Session, why: str | None, reason: str = "") -> None:
        if self.connections.get(conn.fd) is not conn:
            return
        del self.connections[conn.fd]
        self.counters.drop(reason)  # counters.DROPPED; "" (the peer's own close, a stop) counts nothing
        conn.discard()  # the fds of replies it will never read
        if why:
            self._throttle.log(("drop", conn.peer.pid), log.warning, "dropping %s: %s", conn.peer.describe(), why,
                               extra=journal.fields("client_dropped", peer=conn.peer))
        if self._loop is not None:
            self._loop.unwatch(conn.sock)
        self.lingering.close_or_keep(conn, quiet=self._loop is None)
        conn.closing = True
        self._resume()  # an fd is free again
        try:
            self.on_close(conn)
        except Exception as err:
            self._throttle.log(("on_close", type(err).__name__), log.exception, "cleaning up after %s failed: %s",
                               conn.peer.describe(), clip(err))

    def expire(self, now: float | None = None) -> None:
        """Drop connections stuck past CALL_TIMEOUT (half a call, an unread reply); end the listener's pause if due."""
        now = time.monotonic() if now is None else now
        self.lingering.reap()
        if self._paused_until is not None and now >= self._paused_until:
            self._resume()
        for conn in list(self.connections.values()):
            if conn.stalled_since is not None and now - conn.stalled_since > CALL_TIMEOUT:
                what = "an unread reply" if conn.out else "half a message"
                self._drop(conn, f"{what} for over {CALL_TIMEOUT:.0f} s", "timeout")
