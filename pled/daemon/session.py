"""One client's session (its connection, server side): who it is, the calls it sent, the replies it has not read, the fds in flight to it.

Replies are written as the peer reads them. While a reply waits, pled reads no further calls from that
peer (the kernel's socket buffers hold them, and the peer's writes block), so one connection holds at most
one reply in pled's memory; one that leaves a reply unread for CALL_TIMEOUT is dropped. Region fds sent
with Attach replies stay "in flight" (counted against pled's user by the kernel, which refuses more with
ETOOMANYREFS past pled's open-file limit) until the peer receives them, so they are bounded per
connection and per peer uid by the server.
"""
from __future__ import annotations

import fcntl
import socket
import struct
import termios
import time
from collections import deque
from dataclasses import dataclass, field

from pled.shared import protocol
from pled.daemon.access import Peer

CALL_TIMEOUT = 5.0  # seconds a half-sent call, or an unread reply, may wait
MAX_UNREAD = 4 * 1024 * 1024  # bytes of replies queued for one connection (one Status of thousands of clients)
MAX_UNREAD_PER_UID = 32 * 1024 * 1024
MAX_FDS_PER_CONNECTION = 16  # a client attaches a few tables, one call at a time


def unsent_in_kernel(sock: socket.socket) -> int:
    """SIOCOUTQ: what the kernel still holds of what was sent on ``sock`` (0: the peer has read it all)."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0


@dataclass(eq=False)
class Session:
    sock: socket.socket
    peer: Peer
    allowed: bool
    since: float = field(default_factory=time.monotonic)
    framer: protocol.Framer = field(default_factory=lambda: protocol.Framer(protocol.MAX_CALL))
    inbox: deque = field(default_factory=deque)  # calls received, not yet handled (one reply waits)
    out: deque = field(default_factory=deque)  # [bytearray, fds] chunks not yet sent
    out_bytes: int = 0
    fds_sent: int = 0  # fds handed to the kernel since its queue to the peer was last seen empty
    stalled_since: float | None = None  # when a partial call or an unsent reply began to wait
    last_active: float = field(default_factory=time.monotonic)  # last call received or reply sent
    pending: int = 0  # calls whose reply comes later (Attach with wait, Reload)
    closing: bool = False
    attached: dict = field(default_factory=dict)  # table -> generation

    @property
    def fd(self) -> int:
        return self.sock.fileno()

    def queue(self, data: bytes, fds: tuple[int, ...]) -> None:
        self.out.append([bytearray(data), fds])
        self.out_bytes += len(data)

    def sent(self, nbytes: int, had_fds: int) -> None:
        chunk = self.out[0]
        del chunk[0][:nbytes]
        chunk[1] = ()  # the fds went with the first byte
        self.out_bytes -= nbytes
        self.fds_sent += had_fds
        self.last_active = time.monotonic()
        if not chunk[0]:
            self.out.popleft()

    def fds_in_flight(self) -> int:
        """Region fds queued for this peer or sent and not yet received (an upper bound)."""
        if self.fds_sent and unsent_in_kernel(self.sock) == 0:
            self.fds_sent = 0  # the peer has read everything: every fd arrived
        return self.fds_sent + sum(len(fds) for _, fds in self.out)

    @property
    def idle(self) -> bool:
        """Holds no table and waits for nothing: a connection that may be closed to admit another."""
        return not (self.attached or self.pending or self.inbox or self.out or self.framer.pending or self.closing)
