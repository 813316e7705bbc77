"""One client's session (its connection, server side): who it is, the calls it sent, the replies it has not
read, the fds in flight to it.

Replies are written as the peer reads them. While a reply waits, pled reads no further calls from that
peer (the kernel's socket buffers hold them, and the peer's writes block), so one connection holds at most
one reply in pled's memory; one that leaves a reply unread for CALL_TIMEOUT is dropped. Region fds sent
with Attach replies stay "in flight" (counted against pled's user by the kernel, which refuses more with
ETOOMANYREFS past pled's open-file limit) until the peer receives them, so they are bounded per
connection and per peer uid by the server.

A reply waiting to be written owns the fds it will carry (``Outgoing``): duplicates opened when it was
queued, read-only where /proc lets pled reopen the memfd, closed as soon as the kernel has taken them or
when the reply is dropped. A queued reply never holds an fd *number* someone else may close: a reload that
releases a table while a reply waits changes nothing about what that reply sends.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import struct
import termios
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pled.daemon.health.throttle import Throttle
from pled.daemon.serving.access import Peer
from pled.daemon.serving.fdlimit import FdBudget
from pled.shared import protocol
from pled.shared.region import Region

CALL_TIMEOUT = 5.0  # seconds a half-sent call, or an unread reply, may wait
MAX_UNREAD = 4 * 1024 * 1024  # bytes of replies queued for one connection (one Status of thousands of clients)
MAX_UNREAD_PER_UID = 32 * 1024 * 1024
MAX_FDS_PER_CONNECTION = 16  # a client attaches a few tables, one call at a time

log = logging.getLogger(__name__)


def unsent_in_kernel(sock: socket.socket) -> int:
    """SIOCOUTQ: what the kernel still holds of what was sent on ``sock`` (0: the peer has read it all)."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0


_NO_PROC = Throttle(every=float("inf"))  # said once: where /proc is missing it is missing for good


def readonly_duplicate(fd: int) -> int:
    """A new fd for the file behind ``fd``, owned by the caller: a read-only reopening of it through /proc
    (a client then holds no writable file description at all), or, where /proc is not there, a duplicate of a
    write-sealed region's fd. A region that is not write-sealed (gpu_access = "writable") is never duplicated for
    a client this way: without /proc the OSError goes to the caller (the client is refused, not given write)."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        if err.errno in (errno.EMFILE, errno.ENFILE) or not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE:
            raise
        _NO_PROC.log("no-proc", log.warning, "cannot reopen a table's memfd read-only through /proc (%s): clients "
                     "get a duplicate of pled's read-write fd, whose seals refuse every write all the same; mount "
                     "/proc for pled", err.strerror)
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0)


@dataclass
class Reply:
    """A handler's answer. ``regions`` go with it as fds: each is opened anew (read-only) when the reply is
    queued and owned by it until the kernel takes it; ``on_sent`` runs once the kernel has accepted them.
    ``writable``: the peer is a writer the config names for these regions (gpu_access = "writable"): each goes as a
    duplicate of pled's own read-write fd instead."""
    message: dict
    regions: tuple[Region, ...] = ()
    writable: bool = False
    close_after: bool = False
    on_sent: Callable[[], None] | None = None


class Outgoing:
    """One reply waiting to be written: its bytes, the fds that go with its first byte (owned by this reply),
    and what to do once the kernel has taken them (``on_sent``: record the attach)."""

    __slots__ = ("data", "fds", "on_sent")

    def __init__(self, data: bytes, fds: list[int], on_sent: Callable[[], None] | None = None) -> None:
        self.data = bytearray(data)
        self.fds = fds
        self.on_sent = on_sent

    @classmethod
    def of(cls, data: bytes, reply: Reply) -> Outgoing:
        """``data`` with new fds for the reply's regions (OSError, with none left open, where no fd is free)."""
        fds: list[int] = []
        try:
            for r in reply.regions:
                if reply.writable:  # a writer its config names: a duplicate of pled's own read-write open file
                    fds.append(fcntl.fcntl(r.fd, fcntl.F_DUPFD_CLOEXEC, 0))
                    continue
                fds.append(readonly_duplicate(r.fd))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return cls(data, fds, reply.on_sent)

    def close_fds(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


@dataclass(eq=False)
class Session:
    sock: socket.socket
    peer: Peer
    allowed: bool
    since: float = field(default_factory=time.monotonic)
    framer: protocol.Framer = field(default_factory=lambda: protocol.Framer(protocol.MAX_CALL))
    inbox: deque = field(default_factory=deque)  # calls received, not yet handled (one reply waits)
    scheduled: bool = False  # its next call is the loop's work for its next turn (Server._pump)
    out: deque[Outgoing] = field(default_factory=deque)  # replies not yet (fully) written
    out_bytes: int = 0
    fds_sent: int = 0  # fds handed to the kernel since its queue to the peer was last seen empty
    stalled_since: float | None = None  # when a partial call or an unsent reply began to wait
    last_active: float = field(default_factory=time.monotonic)  # last call received or reply sent
    pending: int = 0  # calls whose reply comes later (Attach with wait, Reload)
    closing: bool = False
    attached: dict = field(default_factory=dict)  # table -> generation
    writes: set = field(default_factory=set)  # tables it received a read-write fd of (gpu_access = "writable")

    @property
    def fd(self) -> int:
        return self.sock.fileno()

    def queue(self, reply: Outgoing) -> None:
        self.out.append(reply)
        self.out_bytes += len(reply.data)

    def sent(self, nbytes: int) -> Callable[[], None] | None:
        """``nbytes`` of the first queued reply went; its fds went with its first byte, so they are closed
        here (the kernel holds its own references until the peer receives them). Returns the reply's
        ``on_sent`` when that happened in this call."""
        reply = self.out[0]
        done = None
        if reply.fds:
            self.fds_sent += len(reply.fds)
            reply.close_fds()
            done, reply.on_sent = reply.on_sent, None
        del reply.data[:nbytes]
        self.out_bytes -= nbytes
        self.last_active = time.monotonic()
        if not reply.data:
            self.out.popleft()
        return done

    def discard(self) -> None:
        """The connection is gone: close the fds of every reply that will never be written."""
        while self.out:
            self.out.popleft().close_fds()
        self.out_bytes = 0

    def fds_in_flight(self) -> int:
        """Region fds queued for this peer or sent and not yet received (an upper bound)."""
        if self.fds_sent and unsent_in_kernel(self.sock) == 0:
            self.fds_sent = 0  # the peer has read everything: every fd arrived
        return self.fds_sent + self.fds_queued()

    def fds_queued(self) -> int:
        """Region fds of replies not yet written: what dropping the connection takes back. Those the kernel has
        taken stay in flight until the peer reads them or closes its end, whatever pled does with its own."""
        return sum(len(r.fds) for r in self.out)

    @property
    def idle(self) -> bool:
        """Holds no table and waits for nothing: a connection that may be closed to admit another."""
        return not (self.attached or self.pending or self.inbox or self.out or self.framer.pending or self.closing)


def _uid_share_drops(conn: Session, connections: list[Session], load: Callable[[Session], int], limit: int,
                     extra: int = 0) -> list[tuple[Session, int]]:
    """(connection, its uid's total then): the connections of ``conn``'s uid to drop, the greediest by ``load``
    first, until their loads and ``extra`` fit under ``limit``; ``conn`` last (once it goes, nothing is sent)."""
    same = [c for c in connections if c.peer.uid == conn.peer.uid and (load(c) or c is conn)]
    drops = []
    while same and (total := sum(map(load, same)) + extra) > limit:
        greedy = max(same, key=load)
        drops.append((greedy, total))
        same.remove(greedy)
        if greedy is conn:
            break
    return drops


def unread_drops(conn: Session, connections: list[Session], nbytes: int) -> list[tuple[Session, str]]:
    """The connections to drop, and why, before a reply of ``nbytes`` is queued for ``conn``: ``conn`` itself past
    its own bound; past its uid's bound, the connections of that uid holding the most unread bytes until the rest
    fit (``conn`` last), so that a well-behaved connection of the same uid keeps being answered."""
    def unread(c: Session) -> int:
        return c.out_bytes + (nbytes if c is conn else 0)

    if unread(conn) > MAX_UNREAD:
        return [(conn, f"{unread(conn)} bytes of replies it does not read (at most {MAX_UNREAD} a connection)")]
    return [(c, f"{unread(c)} bytes of replies it does not read; uid {conn.peer.uid} has {total} unread over its "
                f"connections (at most {MAX_UNREAD_PER_UID})")
            for c, total in _uid_share_drops(conn, connections, unread, MAX_UNREAD_PER_UID)]


def fd_budget_drops(conn: Session, connections: list[Session], n: int, budget: FdBudget, lingering: Lingering,
                    operators: tuple[int, ...]) -> list[tuple[Session, str]]:
    """The connections to drop, and why, before ``n`` more region fds go to ``conn``: ``conn`` itself past its own
    bound or past the bound over all peers (``operators`` may use its reserve); past its uid's bound, the connections
    of that uid with the most fds still queued in pled until the rest fit (``conn`` last). The fds still unread on
    connections pled has dropped (``lingering``) count too, and stay, as do those already sent on the connections
    it would drop: dropping a connection frees only what it has not sent (else a uid that let pled drop its
    connections one by one held one fd past its share for each)."""
    mine = conn.fds_in_flight()
    if mine + n > MAX_FDS_PER_CONNECTION:
        return [(conn, f"{mine} table fds sent to it are unread (at most {MAX_FDS_PER_CONNECTION} per connection)")]
    total = sum(c.fds_in_flight() for c in connections) + lingering.fds()
    cap = budget.total - (0 if conn.peer.uid in operators else budget.reserve)
    if total + n > cap:
        return [(conn, f"all peers together have {total} table fds unread (at most {cap} for uid {conn.peer.uid})")]
    closed = lingering.fds(conn.peer.uid)
    sent = sum(c.fds_in_flight() - c.fds_queued() for c in connections if c.peer.uid == conn.peer.uid)
    also = f", {closed} of them on connections pled has closed" if closed else ""
    return [(c, f"uid {conn.peer.uid} has {budget.per_uid} table fds unread over its connections{also}; this one "
                f"holds {c.fds_in_flight()}")
            for c, _ in _uid_share_drops(conn, connections, Session.fds_queued, budget.per_uid,
                                         extra=n + closed + sent)]


def greediest(conn: Session, connections: Iterable[Session]) -> Session:
    """The connection, other than ``conn``, with the most fds in flight; ``conn`` where no other has any."""
    greedy = max((c for c in connections if c is not conn), key=Session.fds_in_flight, default=None)
    return conn if greedy is None or greedy.fds_in_flight() == 0 else greedy


def _drain(sock: socket.socket) -> None:
    """Read and throw away whatever the peer sent that pled has not read, fds included (received with no room for
    them, the kernel closes them). A peer that sent its own socket over itself is held only by that message: once
    it is gone, so is the peer, and the table fds in its queue with it."""
    while True:  # to the end: after the shutdown nothing more can come, and any cap is a queue left behind
        try:
            if not sock.recv(65536, socket.MSG_DONTWAIT):
                return
        except InterruptedError:
            continue
        except (BlockingIOError, ConnectionResetError):
            return


class Lingering:
    """Dropped connections whose peer has not received every table fd sent to it. The kernel counts those fds
    against pled's user until the peer reads or closes its end, whatever pled does with its own end; so pled keeps
    that end (shut down both ways, watched by nothing), counts the fds against the peer's uid and the socket in its
    uid's connections, and closes it once the kernel says the peer has them (SIOCOUTQ 0), or at stop. Without
    this, a peer that made pled drop connection after connection, keeping each, held fds in flight past any bound
    until the kernel refused pled every send (ETOOMANYREFS) and no client could attach."""

    def __init__(self) -> None:
        self.sessions: list[Session] = []
        self._throttle = Throttle()

    def close_or_keep(self, conn: Session, quiet: bool = False) -> None:
        """Close ``conn``'s socket (its replies already discarded), or keep it while its peer has fds unread."""
        n = conn.fds_in_flight()
        try:
            if n:
                conn.sock.shutdown(socket.SHUT_RDWR)  # the peer reads what is queued, then its end of file
                _drain(conn.sock)
                n = conn.fds_in_flight()  # the peer may have been held only by what it had sent pled
        except OSError:
            n = 0  # the peer is gone already: nothing of it stays in flight
        if not n:
            conn.sock.close()
            return
        self.sessions.append(conn)
        if not quiet:
            self._throttle.log(("linger", conn.peer.uid), log.warning, "%s left with %d table fds unread: they count "
                               "against uid %d until it reads or closes them", conn.peer.describe(), n, conn.peer.uid)

    def fds(self, uid: int | None = None) -> int:
        """The fds still unread on them: ``uid``'s, or everyone's."""
        return sum(c.fds_in_flight() for c in self.sessions if uid is None or c.peer.uid == uid)

    def uids(self) -> list[int]:
        return [c.peer.uid for c in self.sessions]

    def reap(self) -> None:
        """Close those whose peer has received everything (or closed its end, which frees what it held)."""
        for c in [c for c in self.sessions if c.fds_in_flight() == 0]:
            self.sessions.remove(c)
            c.sock.close()

    def close(self) -> None:
        sessions, self.sessions = self.sessions, []
        for c in sessions:
            c.sock.close()
