"""Table fds sent and not yet received ("in flight"): the kernel counts them against pled's user until the peer
receives them or closes its end, whatever pled does with its own end, and past pled's open-file limit refuses pled
any more (ETOOMANYREFS) unless pled holds CAP_SYS_RESOURCE or CAP_SYS_ADMIN, which pled.service does not give it.
So pled bounds them per connection, per uid and over all peers, counting those on connections it has already closed
(session.Lingering). Members of pled's group (forked children as uids 65534 and 65533, pled's gid supplementary)
try to push pled past the kernel's cap, and root must keep attaching; afterwards pled's fds are back where they were.
pled runs as root with no capability (setpriv), as under its unit, and an open-file limit of 256."""
import os
import signal
import socket

import pytest

from attack import PING, assert_serving, baseline, ping_capacity, settle_fds, unread
from forked import become
from harness import start, unused_gid, wait_until
from pled import client
from pled.daemon.serving import fdlimit
from pled.shared import protocol

pytestmark = [pytest.mark.daemon, pytest.mark.root]

NOFILE = 256
ATTACH = protocol.call(protocol.ATTACH, table="t1")


@pytest.fixture
def pled_group(tmp_path, sidecar, open_dir, pleds):
    """(pled, its group's gid, the sidecar): pled without capabilities, its socket in that group."""
    gid = unused_gid()
    d = sidecar(shards=2, rows=64)
    pled = start(tmp_path, {"t1": d}, socket=os.path.join(open_dir, "pled.sock"), nofile=NOFILE,
                 prefix=["setpriv", f"--regid={gid}", "--clear-groups", "--bounding-set=-all", "--inh-caps=-all"])
    pleds.append(pled)
    return pled, gid, d


class Member:
    """A forked child as ``uid`` in pled's group that leaves ``connections`` connections with 16 Attach replies
    unread each, makes pled drop them (``how``: "shut" its side, or "anchor": its replies stalled behind Pings and
    its own socket sent over itself, then gone), and then waits, holding what it kept, until ``release()``."""

    def __init__(self, pled, gid: int, uid: int, connections: int, how: str = "shut") -> None:
        self._said_r, said_w = os.pipe()
        go_r, self._go_w = os.pipe()
        capacity = ping_capacity(pled.socket) if how == "anchor" else 0
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(self._said_r)
                become(uid, [gid])
                held = []
                for _ in range(connections):
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.connect(pled.socket)
                    if how == "anchor":
                        s.sendall(ATTACH * 16 + PING * (capacity + 40))
                        unread(s)  # the replies stall: pled reads nothing more from it
                        socket.send_fds(s, [b" "], [s.fileno()])  # its own socket, unread in pled's queue
                        s.close()  # only that message holds it now
                        continue
                    s.sendall(ATTACH * 16)
                    unread(s)  # until pled has stopped writing to it
                    s.shutdown(socket.SHUT_WR)  # pled reads its end of file and drops the connection
                    held.append(s)
                os.write(said_w, b"holding\n")
                os.read(go_r, 1)
                for s in held:
                    s.close()
                os.write(said_w, b"closed\n")
                signal.pause()
            finally:
                os._exit(0)
        os.close(said_w)
        os.close(go_r)
        self._said = os.fdopen(self._said_r)
        assert self._said.readline() == "holding\n"

    def release(self) -> None:
        os.write(self._go_w, b"x")
        assert self._said.readline() == "closed\n"

    def end(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self._go_w)
        self._said.close()


def daemon_status(pled) -> dict:
    return client.call(protocol.STATUS, socket=pled.socket)["daemon"]


def root_attaches(pled, times: int = 3) -> None:
    for _ in range(times):
        with client.attach("t1", socket=pled.socket, timeout=10) as t:
            assert t.shards[0].size > 0


def test_fds_unread_on_connections_pled_dropped_still_count_against_their_uid(pled_group):
    """A member leaves 16 Attach replies unread on a connection, shuts its side so that pled drops it, keeps the
    socket, 20 times. pled used to forget a dropped connection's fds: the member held them past its uid's share
    until the kernel refused pled every send, and root could not attach."""
    pled, gid, d = pled_group
    before = baseline(pled, "t1")
    member = Member(pled, gid, 65534, 20)
    try:
        root_attaches(pled)
        share = fdlimit.max_fds_in_flight(NOFILE)
        pled.wait_for("left with 16 table fds unread: they count against uid 65534")
        log = pled.wait_for(f"uid 65534 has {share} table fds unread over its connections, ")
        assert "ETOOMANYREFS" not in log, log[-3000:]
        st = wait_until(lambda: (d := daemon_status(pled))["closed_with_fds_unread"] == share // 16 and d, 10,
                        message=lambda: str(daemon_status(pled)))
        assert st["fds_in_flight"] == share, st
        member.release()
        assert_serving(pled, "t1", d, before)  # pled's ends of the member's sockets closed: its fds as before
    finally:
        member.end()


def test_a_peer_held_only_by_its_own_socket_in_pleds_queue_is_let_go(pled_group):
    """The member stalls its replies (Pings past what the kernel takes), sends its own socket over that same
    connection, closes it and lets pled drop the connection at the call timeout: the socket lived on in pled's
    receive queue, its replies unread forever, and the uid's fds stayed counted for pled's whole life."""
    pled, gid, d = pled_group
    before = baseline(pled, "t1")
    member = Member(pled, gid, 65534, 4, how="anchor")
    try:
        wait_until(lambda: pled.log().count("dropping") >= 1, 30, message=lambda: pled.log()[-3000:])
        assert settle_fds(pled, before[0], timeout=20) <= before[0], pled.log()[-3000:]
        st = client.call(protocol.STATUS, socket=pled.socket)["daemon"]
        assert st["fds_in_flight"] == 0 and st["closed_with_fds_unread"] == 0, st
        again = Member(pled, gid, 65534, 1)  # the same uid attaches again: nothing of it counted
        again.release()
        again.end()
        assert "uid 65534 has" not in pled.log()
    finally:
        member.end()
    assert_serving(pled, "t1", d, before)


def test_a_peer_held_behind_thousands_of_fd_messages_is_let_go_too(pled_group):
    """The same, with 5,000 messages that each carry an fd queued before its own socket (a send buffer that large
    takes root's SO_SNDBUFFORCE here; a member gets it where net.core.wmem_max allows): pled reads everything the
    peer sent, however much, not a fixed number of messages."""
    pled, _, d = pled_group
    before = baseline(pled, "t1")
    capacity = ping_capacity(pled.socket)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_SNDBUFFORCE", 32), 64 << 20)
    s.connect(pled.socket)
    s.sendall(ATTACH * 16 + PING * (capacity + 40))
    unread(s)  # the replies stall: pled reads nothing more from it
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        for _ in range(5000):
            socket.send_fds(s, [b" "], [null])
        socket.send_fds(s, [b" "], [s.fileno()])
    finally:
        os.close(null)
        s.close()
    wait_until(lambda: pled.log().count("dropping") >= 1, 30, message=lambda: pled.log()[-3000:])
    assert settle_fds(pled, before[0], timeout=20) <= before[0], pled.log()[-3000:]
    st = client.call(protocol.STATUS, socket=pled.socket)["daemon"]
    assert st["fds_in_flight"] == 0 and st["closed_with_fds_unread"] == 0, st
    assert_serving(pled, "t1", d, before)


def test_many_uids_together_cannot_take_what_is_kept_for_root(pled_group):
    """Each uid stays within its own share, but two together would pass half of pled's limit: the second is
    stopped at the bound over all peers, short of the root's reserve, and root attaches."""
    pled, gid, d = pled_group
    budget = fdlimit.fd_budget(NOFILE)
    first = Member(pled, gid, 65534, budget.per_uid // 16)
    second = Member(pled, gid, 65533, budget.per_uid // 16)
    try:
        cap = budget.total - budget.reserve
        assert budget.per_uid * 2 > cap  # the premise: two full shares pass the bound over all peers
        pled.wait_for(f"all peers together have {cap} table fds unread (at most {cap} for uid 65533)")
        assert daemon_status(pled)["fds_in_flight"] == cap
        root_attaches(pled)
        first.release()
        second.release()
        assert_serving(pled, "t1", d)
    finally:
        first.end()
        second.end()
