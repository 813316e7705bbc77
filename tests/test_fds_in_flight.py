"""Table fds sent and not yet received ("in flight"): the kernel counts them against pled's user until the peer
receives them or closes its end, whatever pled does with its own end, and past pled's open-file limit refuses pled
any more (ETOOMANYREFS) unless pled holds CAP_SYS_RESOURCE or CAP_SYS_ADMIN, which pled.service does not give it.
So pled bounds them per connection, per uid and over all peers, counting those on connections it has already closed
(session.Lingering), and counts those connections in their uid's share of the connections too. Members of pled's
group (forked children as uids 65534 and 65533, pled's gid supplementary) try to push pled past the kernel's cap,
and root must keep attaching; afterwards pled's fds are back where they were. pled runs as root with no capability
(setpriv), as under its unit, and an open-file limit of 256.

Each step waits for what pled has done (its replies on the member's socket, its own figures in Status), never for
a quiet moment: the machine may be busy."""
import os
import signal
import socket
import traceback

import pytest

from attack import PING, RSS_BOUND, assert_serving, pings_past_any_capacity, queued, reply_size, rss
from forked import become
from harness import start, unused_gid, wait_until
from pled import client
from pled.daemon.serving import fdlimit
from pled.shared import protocol

pytestmark = [pytest.mark.daemon, pytest.mark.root]

NOFILE = 256
ATTACH = protocol.call(protocol.ATTACH, table="t1")
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)


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
    """A forked child as ``uid`` in pled's group that leaves ``connections`` connections with ``attaches`` Attach
    replies unread each, and then waits, holding what it kept, until ``release()``. ``how``: "shut" its side once pled
    has answered them (or closed the connection), so that pled drops it; "keep" it open as it is; or "anchor": send,
    behind the Attaches, more Pings than pled can answer to a peer that reads nothing, then its own socket over
    itself, and close it: only that message, which pled never gets to read, holds it, until pled drops it at the
    call timeout. ``answered``: the Attach replies pled sent it (not "anchor")."""

    def __init__(self, pled, gid: int, uid: int, connections: int, how: str = "shut", attaches: int = 16) -> None:
        self._said_r, said_w = os.pipe()
        go_r, self._go_w = os.pipe()
        size = reply_size(pled.socket, ATTACH)  # root's Attach: each reply to the member's is as long
        pings = pings_past_any_capacity()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(self._said_r)
                socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(connections)]
                if how == "anchor":  # room for every call pled leaves unread (root's SO_SNDBUFFORCE, before the uid)
                    for s in socks:
                        s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 4 << 20)
                become(uid, [gid])
                held, answered = [], 0
                for s in socks:
                    s.connect(pled.socket)
                    if how == "anchor":
                        s.sendall(ATTACH * attaches + PING * pings)
                        socket.send_fds(s, [b" "], [s.fileno()])  # its own socket, unread in pled's queue
                        s.close()  # only that message holds it now
                        continue
                    try:
                        s.sendall(ATTACH * attaches)
                    except (BrokenPipeError, ConnectionResetError):  # pled refused the connection: closed it
                        continue
                    answered += queued(s, attaches * size) // size  # pled answered them all, or closed it
                    if how == "shut":
                        s.shutdown(socket.SHUT_WR)  # pled reads its end of file and drops the connection
                    held.append(s)
                os.write(said_w, f"holding {answered}\n".encode())
                os.read(go_r, 1)
                for s in held:
                    s.close()
                os.write(said_w, b"closed\n")
                signal.pause()
            except BaseException:
                traceback.print_exc()  # the test sees only that "holding" never came
                raise
            finally:
                os._exit(0)
        os.close(said_w)
        os.close(go_r)
        self._said = os.fdopen(self._said_r)
        said = self._said.readline()
        assert said.startswith("holding "), said
        self.answered = int(said.split()[1])  # Attach replies waiting on its connections, unread

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


def quiet(pled, timeout: float = 30) -> dict:
    """Status's ``daemon`` once pled holds no connection but the one asking and none it closed with fds unread:
    what pled reports, at a moment when its open fds can be compared with another such moment."""
    def settled() -> dict | None:
        st = daemon_status(pled)
        return st if st["connections"] == 1 and st["closed_with_fds_unread"] == 0 else None

    return wait_until(settled, timeout, message=lambda: f"{daemon_status(pled)}\n{pled.log()[-3000:]}")


def baseline(pled) -> tuple[dict, int]:
    """(Status's ``daemon`` with nothing of the test's in pled, pled's RSS) after one attach and detach, so that
    lazily made state is counted."""
    assert_serving(pled, "t1")
    return quiet(pled), rss(pled.pid)


def back_to(pled, d, before: tuple[dict, int]) -> None:
    """pled serves (a fresh client attaches and reads), and its fds and RSS are back where they were."""
    assert_serving(pled, "t1", d)
    st, mem = quiet(pled), rss(pled.pid)
    assert st["open_fds"] <= before[0]["open_fds"], (st, before[0])
    assert mem <= before[1] + RSS_BOUND, (mem, before[1])


def root_attaches(pled, times: int = 3) -> None:
    for _ in range(times):
        with client.attach("t1", socket=pled.socket, timeout=10) as t:
            assert t.shards[0].size > 0


def test_fds_unread_on_connections_pled_dropped_still_count_against_their_uid(pled_group):
    """A member leaves 16 Attach replies unread on a connection, shuts its side so that pled drops it, keeps the
    socket, 20 times. pled used to forget a dropped connection's fds: the member held them past its uid's share
    until the kernel refused pled every send, and root could not attach."""
    pled, gid, d = pled_group
    before = baseline(pled)
    member = Member(pled, gid, 65534, 20)
    try:
        root_attaches(pled)
        share = fdlimit.max_fds_in_flight(NOFILE)
        pled.wait_for("left with 16 table fds unread: they count against uid 65534")
        log = pled.wait_for(f"uid 65534 has {share} table fds unread over its connections, ")
        assert "ETOOMANYREFS" not in log, log[-3000:]
        st = wait_until(lambda: (d := daemon_status(pled))["closed_with_fds_unread"] == share // 16 and d, 30,
                        message=lambda: str(daemon_status(pled)))
        assert st["fds_in_flight"] == share, st
        member.release()
        back_to(pled, d, before)  # pled's ends of the member's sockets closed: its fds as before
    finally:
        member.end()


def test_a_uid_gets_no_table_fd_past_its_share_by_having_pled_drop_its_connections(pled_group):
    """A member holds its uid's share of table fds unread on connections it keeps open; another process of the same
    uid asks for one more on a connection of its own. pled used to drop the member's greediest connection to make
    room and send it: but the fds sent on a dropped connection stay in flight until its peer reads them (pled keeps
    its end: they count, as lingering), so the uid held one fd past its share for each connection it let pled
    drop. The new connection is the one refused; Status never shows more than the share in flight."""
    pled, gid, d = pled_group
    share = fdlimit.max_fds_in_flight(NOFILE)
    holder = Member(pled, gid, 65534, share // 16, how="keep")
    asker = None
    try:
        assert daemon_status(pled)["fds_in_flight"] == share
        asker = Member(pled, gid, 65534, 1, how="keep", attaches=1)  # back once answered or closed
        st = daemon_status(pled)
        assert (st["fds_in_flight"], st["closed_with_fds_unread"], st["dropped"]["fds_in_flight"]) == (share, 0, 1), st
        assert asker.answered == 0
        pled.wait_for(f"uid 65534 has {share} table fds unread over its connections; this one holds 0")
        root_attaches(pled)
    finally:
        holder.end()
        if asker is not None:
            asker.end()
    assert_serving(pled, "t1", d)


def test_connections_pled_dropped_with_fds_unread_count_in_their_uids_share_of_connections(pled_group):
    """A member opens its uid's share of the connections (a quarter of them), leaves one Attach reply unread on each
    and shuts its side: pled drops each, but keeps its end while the fd is unread (lingering), and counts it among
    the uid's connections. So another connection of that uid is refused, while another uid is admitted; once the
    member has closed its sockets, its uid is admitted again."""
    pled, gid, d = pled_group
    share = fdlimit.per_uid(fdlimit.max_connections(NOFILE))
    assert share <= fdlimit.max_fds_in_flight(NOFILE)  # the premise: one fd each is within the uid's fds in flight
    member = Member(pled, gid, 65534, share, attaches=1)
    try:
        st = wait_until(lambda: (s := daemon_status(pled))["closed_with_fds_unread"] == share and s, 30,
                        message=lambda: str(daemon_status(pled)))
        assert st["connections"] == 1 and st["refused"]["uid_share"] == 0, st  # only this Status call is open
        late = Member(pled, gid, 65534, 1, how="keep", attaches=1)  # the same uid, one more connection
        late.end()
        other = Member(pled, gid, 65533, 1, how="keep", attaches=1)  # another uid
        other.end()
        assert (late.answered, other.answered) == (0, 1)
        assert daemon_status(pled)["refused"]["uid_share"] == 1
        pled.wait_for(f"uid 65534 already holds {share} connections (at most {share} per uid)")
        member.release()
        wait_until(lambda: daemon_status(pled)["closed_with_fds_unread"] == 0, 30,
                   message=lambda: str(daemon_status(pled)))
        again = Member(pled, gid, 65534, 1, how="keep", attaches=1)
        again.end()
        assert again.answered == 1 and daemon_status(pled)["refused"]["uid_share"] == 1
    finally:
        member.end()
    assert_serving(pled, "t1", d)


def test_a_peer_held_only_by_its_own_socket_in_pleds_queue_is_let_go(pled_group):
    """The member stalls its replies (Pings past what the kernel takes), sends its own socket over that same
    connection, closes it and lets pled drop the connection at the call timeout: the socket lived on in pled's
    receive queue, its replies unread forever, and the uid's fds stayed counted for pled's whole life."""
    pled, gid, d = pled_group
    before = baseline(pled)
    member = Member(pled, gid, 65534, 4, how="anchor")
    try:
        wait_until(lambda: daemon_status(pled)["dropped"]["timeout"] == 4, 60,
                   message=lambda: f"{daemon_status(pled)}\n{pled.log()[-3000:]}")
        assert "an unread reply for over" in pled.log()
        st = quiet(pled)
        assert st["fds_in_flight"] == 0 and st["open_fds"] <= before[0]["open_fds"], (st, before[0])
        again = Member(pled, gid, 65534, 1)  # the same uid attaches again: nothing of it counted
        again.release()
        again.end()
        assert "uid 65534 has" not in pled.log()
    finally:
        member.end()
    back_to(pled, d, before)


def test_a_peer_held_behind_thousands_of_fd_messages_is_let_go_too(pled_group):
    """The same, with 5,000 messages that each carry an fd queued before its own socket (a send buffer that large
    takes root's SO_SNDBUFFORCE here; a member gets it where net.core.wmem_max allows): pled reads everything the
    peer sent, however much, not a fixed number of messages."""
    pled, _, d = pled_group
    before = baseline(pled)
    size = reply_size(pled.socket, ATTACH)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 64 << 20)
    s.connect(pled.socket)
    s.sendall(ATTACH * 16 + PING * pings_past_any_capacity())  # pled's replies stall: it reads nothing after these
    # The fds sent below count against root, pled's user here too (the kernel counts a user's fds in flight against
    # the sender's limit, pled's 256): only once pled has sent its 16, or it would meet ETOOMANYREFS sending them.
    queued(s, 16 * size)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        for _ in range(5000):
            socket.send_fds(s, [b" "], [null])
        socket.send_fds(s, [b" "], [s.fileno()])
    finally:
        os.close(null)
        s.close()
    wait_until(lambda: daemon_status(pled)["dropped"]["timeout"] == 1, 60,
               message=lambda: f"{daemon_status(pled)}\n{pled.log()[-3000:]}")
    st = quiet(pled)
    assert st["fds_in_flight"] == 0 and st["open_fds"] <= before[0]["open_fds"], (st, before[0])
    back_to(pled, d, before)


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
