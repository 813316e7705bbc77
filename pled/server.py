"""The socket clients attach through: non-blocking, single-threaded, hard to upset.

Every connection is checked with SO_PEERCRED when it is accepted. Calls are
bounded in size; a connection with half a message older than CALL_TIMEOUT, or
with replies it has not read for as long, is dropped. Nothing a peer sends can
stop, block or crash the daemon, and every socket has one owner that closes it.
A client stays connected while it holds a table: that is how pled knows who is
attached, and logs the detach when the connection goes.
"""
from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import stat
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from . import protocol
from .access import Peer, Policy, peer_of
from .errors import PledError

log = logging.getLogger(__name__)

CALL_TIMEOUT = 5.0  # seconds a half-sent call, or an unread reply, may wait
MAX_CONNECTIONS = 4096
PENDING = object()  # a handler's answer when the reply comes later (Attach with wait)


class SocketInUse(PledError):
    exit_status = 78


@dataclass
class Reply:
    message: dict
    fds: tuple[int, ...] = ()
    close_after: bool = False


@dataclass(eq=False)
class Connection:
    sock: socket.socket
    peer: Peer
    allowed: bool
    since: float = field(default_factory=time.monotonic)
    framer: protocol.Framer = field(default_factory=lambda: protocol.Framer(protocol.MAX_CALL))
    out: deque = field(default_factory=deque)  # [bytearray, fds] chunks not yet sent
    stalled_since: float | None = None  # when a partial call or an unsent reply began to wait
    closing: bool = False
    attached: dict = field(default_factory=dict)  # table -> generation

    @property
    def fd(self) -> int:
        return self.sock.fileno()


Handler = Callable[[Connection, str, dict], "Reply | object"]


def bind(path: str) -> socket.socket:
    """Listen at ``path``: parent created 0750, socket 0660, a stale socket replaced, a live one refused."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        try:
            os.makedirs(parent, exist_ok=True)
            os.chmod(parent, 0o750)
        except OSError as err:
            raise PledError(f"cannot create the socket's directory {parent}: {err.strerror}; create it, or set "
                            "socket in the config to a path under a writable directory (pled.service uses /run/pled)") from err
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise SocketInUse(f"{path} exists and is not a socket; remove it or set another socket in the config")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale socket %s left by a daemon that is gone", path)
            os.unlink(path)
        except OSError as err:
            raise SocketInUse(f"{path} exists and cannot be probed ({err}); remove it if no pled is running") from err
        else:
            who = peer_of(probe)
            raise SocketInUse(f"another pled is serving at {path} (pid {who.pid}); stop it first or set another socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
    old = os.umask(0o117)  # 0660 from the start: no window in which anyone else could connect
    try:
        sock.bind(path)
    except OSError as err:
        sock.close()
        hint = "free space (or inodes) there" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "check the directory's permissions"
        raise PledError(f"cannot create socket {path}: {err.strerror or err}; {hint}, or set socket elsewhere in the config") from err
    finally:
        os.umask(old)
    sock.listen(socket.SOMAXCONN)
    return sock


class Server:
    def __init__(self, path: str, policy: Policy, handler: Handler, on_close: Callable[[Connection], None]) -> None:
        self.path = path
        self.policy = policy
        self.handler = handler
        self.on_close = on_close
        self.listener = bind(path)
        self.connections: dict[int, Connection] = {}
        self._sel: selectors.BaseSelector | None = None

    def register(self, sel: selectors.BaseSelector) -> None:
        self._sel = sel
        sel.register(self.listener, selectors.EVENT_READ, self._accept)

    def unregister(self) -> None:
        """Leave the selector (before it closes); the sockets stay open until close()."""
        if self._sel is not None:
            for conn in self.connections.values():
                self._sel.unregister(conn.sock)
            self._sel.unregister(self.listener)
            self._sel = None

    def close(self) -> None:
        self.unregister()
        for conn in list(self.connections.values()):
            self._drop(conn, None)
        self.listener.close()
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    # -- events ------------------------------------------------------------------------------

    def _accept(self, _mask: int) -> None:
        for _ in range(64):  # a burst of clients: take several, then let the loop breathe
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("cannot accept a client: %s", err.strerror)
                    return
                raise
            sock.setblocking(False)
            if len(self.connections) >= MAX_CONNECTIONS:
                log.warning("refusing a client: %d connections open already", len(self.connections))
                sock.close()
                continue
            try:
                peer = peer_of(sock)
            except OSError:
                sock.close()
                continue
            conn = Connection(sock, peer, self.policy.allows(peer))
            self.connections[conn.fd] = conn
            self._sel.register(sock, selectors.EVENT_READ, lambda mask, c=conn: self._ready(c, mask))
            log.debug("client connected: %s", peer.describe())

    def _ready(self, conn: Connection, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and conn.fd in self.connections and not conn.closing:
            self._read(conn)

    def _read(self, conn: Connection) -> None:
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
        conn.stalled_since = time.monotonic() if conn.framer.pending else None
        for raw in messages:
            if conn.closing:
                return
            self._dispatch(conn, raw)

    def _dispatch(self, conn: Connection, raw: bytes) -> None:
        if not conn.allowed:
            log.warning("refused %s: not root, not pled's user or group, not in allow_uids or allow_groups", conn.peer.describe())
            self.send(conn, Reply(protocol.error(protocol.PERMISSION_DENIED, uid=conn.peer.uid), close_after=True))
            return
        try:
            method, parameters = protocol.parse_call(raw)
        except ValueError as err:
            self._fail(conn, protocol.INVALID_MESSAGE, str(err))
            return
        result = self.handler(conn, method, parameters)
        if result is not PENDING:
            self.send(conn, result)

    def _fail(self, conn: Connection, name: str, reason: str) -> None:
        log.warning("dropping %s: %s", conn.peer.describe(), reason)
        self.send(conn, Reply(protocol.error(name, reason=reason), close_after=True))

    # -- replies -----------------------------------------------------------------------------

    def send(self, conn: Connection, reply: Reply) -> None:
        if self._sel is None or conn.fd not in self.connections or conn.closing:
            return  # shutting down, or the peer is gone
        conn.out.append([bytearray(protocol.encode(reply.message)), reply.fds])
        conn.closing = reply.close_after
        self._flush(conn)

    def _flush(self, conn: Connection) -> None:
        while conn.out:
            chunk, fds = conn.out[0]
            try:
                if fds:
                    sent = socket.send_fds(conn.sock, [chunk], list(fds))
                else:
                    sent = conn.sock.send(chunk)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # the peer went away mid-reply
                self._drop(conn, None)
                return
            del chunk[:sent]
            conn.out[0][1] = ()  # the fds went with the first byte
            if not chunk:
                conn.out.popleft()
        if conn.out:
            conn.stalled_since = conn.stalled_since or time.monotonic()
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, self._sel.get_key(conn.sock).data)
            return
        conn.stalled_since = time.monotonic() if conn.framer.pending else None
        if conn.closing:
            self._drop(conn, None)
            return
        key = self._sel.get_key(conn.sock)
        if key.events != selectors.EVENT_READ:
            self._sel.modify(conn.sock, selectors.EVENT_READ, key.data)

    def _drop(self, conn: Connection, why: str | None) -> None:
        if self.connections.pop(conn.fd, None) is None:
            return
        if why:
            log.warning("dropping %s: %s", conn.peer.describe(), why)
        if self._sel is not None:
            self._sel.unregister(conn.sock)
        conn.sock.close()
        self.on_close(conn)

    def expire(self, now: float | None = None) -> None:
        """Drop connections stuck with half a call or an unread reply for longer than CALL_TIMEOUT."""
        now = time.monotonic() if now is None else now
        for conn in list(self.connections.values()):
            if conn.stalled_since is not None and now - conn.stalled_since > CALL_TIMEOUT:
                what = "an unread reply" if conn.out else "half a message"
                self._drop(conn, f"{what} for over {CALL_TIMEOUT:.0f} s")
