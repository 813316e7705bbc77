"""Admitting connections: the server's side of accept().

A new connection is admitted within its uid's share and the cap below the open-file limit (fdlimit.py); at the cap,
the connection idle longest (no table, no call) makes room; while accept() finds no fd free the listener rests
for ACCEPT_PAUSE instead of spinning on it. A mixin of Server (server.py), whose state it uses: its connections, the
connections it keeps after dropping them (lingering), its policy, counters, log budgets and loop.
"""
from __future__ import annotations

import errno
import logging
import socket
import time

from pled.daemon.health import journal
from pled.daemon.health.counters import Counters
from pled.daemon.health.throttle import Throttle
from pled.daemon.serving import fdlimit
from pled.daemon.serving.access import Policy, peer_of
from pled.daemon.serving.loop import Loop
from pled.daemon.serving.session import Lingering, Session

log = logging.getLogger("pled.daemon.serving.server")  # its lines are the server's

ACCEPT_PAUSE = 0.5  # seconds the listener rests after accept() found no fd free


class Admission:
    # Server's, set in its __init__
    listener: socket.socket
    policy: Policy
    counters: Counters
    max_connections: int
    connections: dict[int, Session]
    lingering: Lingering
    _loop: Loop | None
    _throttle: Throttle
    _paused_until: float | None

    def _ready(self, conn: Session, mask: int) -> None:  # Server's
        raise NotImplementedError

    def _drop(self, conn: Session, why: str | None, reason: str = "") -> None:  # Server's
        raise NotImplementedError

    def _accept(self, _mask: int) -> None:
        for _ in range(64):  # a burst of clients: take several, then let the loop breathe
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause(err)
                    return
                self._throttle.log("accept", log.warning, "accept() failed: %s", err)
                return
            sock.setblocking(False)
            try:
                peer = peer_of(sock)
            except OSError:
                peer = None  # the peer is gone already
            if peer is None or not self._admit(peer):
                sock.close()
                continue
            conn = Session(sock, peer, self.policy.allows(peer))
            self.connections[conn.fd] = conn
            self._loop.watch(sock, lambda mask, c=conn: self._ready(c, mask))
            log.debug("client connected: %s", peer.describe())

    def _admit(self, peer) -> bool:
        """Room for ``peer``: within its uid's share (fdlimit.over_share) and the cap, where an idle one may go."""
        uids = [c.peer.uid for c in self.connections.values()] + self.lingering.uids()
        why = fdlimit.over_share(peer.uid, (0, self.policy.own_uid), uids.count(peer.uid), len(uids),
                                 self.max_connections)
        reason = "uid_share"  # counted as the log line says: by the share (or the reserve), or by the cap
        if why is None and len(uids) >= self.max_connections and not self._make_room():
            why = f"all {len(uids)} connections are attached or busy (the cap, from the open-file limit)"
            reason = "connection_cap"
        if why is not None:
            self.counters.refuse(reason)
            self._throttle.log(("refuse", peer.uid), log.warning, "refusing %s: %s", peer.describe(), why,
                               extra=journal.fields("client_refused", peer=peer))
        return why is None

    def _make_room(self) -> bool:
        """At the cap: close the connection idle longest that holds no table and waits for nothing."""
        idle = [c for c in self.connections.values() if c.idle]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.last_active)
        self._throttle.log("evict", log.warning, "at the cap of %d connections: closing idle connections (no table, no "
                           "call) to admit new clients, first %s", self.max_connections, victim.peer.describe())
        self._drop(victim, None, "idle_evicted")
        return True

    def _pause(self, err: OSError) -> None:
        """No fd for a new client: stop watching the listener for a moment instead of spinning on it."""
        if self._paused_until is None and self._loop is not None:
            self._loop.unwatch(self.listener)
        self._paused_until = time.monotonic() + ACCEPT_PAUSE
        self._throttle.log("pause", log.warning, "cannot accept clients: %s with %d connections open; accepting again "
                           "once an fd is free (raise LimitNOFILE= if it lasts)", err.strerror, len(self.connections))

    def _resume(self) -> None:
        if self._paused_until is not None and self._loop is not None:
            self._paused_until = None
            self._loop.watch(self.listener, self._accept)
