"""The arithmetic of a uid's share of table fds in flight (session.fd_budget_drops), on real sockets: the fds a
connection has handed to the kernel that its peer has not received (SIOCOUTQ says so) and the fds of replies still
queued in pled both count, each once, and only against the uid of the connection that holds them. What an
operator sees of it is which connection pled drops before sending more, and the reason it logs. The daemon-level
tests (test_fds_in_flight.py) show it through Status and the journal; these pin each term of the sum, which those
reach only by chance of timing (a reply queued in pled while the fds of an earlier one wait in the kernel)."""
import array
import os
import socket

import pytest

from pled.daemon.serving import session
from pled.daemon.serving.access import Peer
from pled.daemon.serving.fdlimit import FdBudget
from pled.daemon.serving.session import Lingering, Outgoing, Session

OPERATORS = (0,)
ROOMY = FdBudget(per_uid=1000, total=1000, reserve=0)


@pytest.fixture
def connect():
    """connect(uid, sent, queued) -> (a Session on a real socketpair, its peer's end): ``sent`` replies with one
    table fd each handed to the kernel and unread by the peer, ``queued`` more waiting in pled. All closed after."""
    made: list[tuple[Session, socket.socket]] = []
    memfd = os.memfd_create("table", os.MFD_CLOEXEC)

    def make(uid: int, sent: int = 0, queued: int = 0) -> tuple[Session, socket.socket]:
        ours, theirs = socket.socketpair()
        conn = Session(ours, Peer(pid=1000 + len(made), uid=uid, gid=uid + 7, groups=frozenset({uid + 7}),
                                  command="peer"), allowed=True)
        made.append((conn, theirs))
        for _ in range(sent):  # as Server._flush writes a reply: its fds go with its first byte
            conn.queue(Outgoing(b"reply", [os.dup(memfd)]))
            conn.sent(socket.send_fds(conn.sock, [conn.out[0].data], conn.out[0].fds))
        for _ in range(queued):
            conn.queue(Outgoing(b"reply", [os.dup(memfd)]))
        return conn, theirs

    yield make
    os.close(memfd)
    for conn, theirs in made:
        conn.discard()
        conn.sock.close()
        theirs.close()


def receive_all(theirs: socket.socket) -> int:
    """The peer reads everything queued for it and closes the fds it got: how many."""
    got = 0
    while True:
        try:
            data, anc, _, _ = theirs.recvmsg(4096, socket.CMSG_SPACE(64 * 4), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return got
        for level, kind, raw in anc:
            if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
                fds = array.array("i")
                fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
                for fd in fds:
                    os.close(fd)
                got += len(fds)
        if not data:
            return got


def test_a_connections_fds_in_flight_are_those_in_the_kernel_plus_those_queued_in_pled(connect):
    conn, theirs = connect(1001, sent=3, queued=2)
    assert (conn.fds_queued(), conn.fds_in_flight()) == (2, 5)
    # One more fd past the per-connection bound only with both counted: the connection is dropped, saying so.
    n = session.MAX_FDS_PER_CONNECTION - 5 + 1
    assert session.fd_budget_drops(conn, [conn], n, ROOMY, Lingering(), OPERATORS) == [
        (conn, f"5 table fds sent to it are unread (at most {session.MAX_FDS_PER_CONNECTION} per connection)")]
    assert session.fd_budget_drops(conn, [conn], n - 1, ROOMY, Lingering(), OPERATORS) == []
    assert receive_all(theirs) == 3
    assert conn.fds_in_flight() == 2  # received: only the queued ones are left


def test_a_uids_share_counts_fds_in_the_kernel_once_and_drops_only_what_frees_room(connect):
    """uid 1001 has one connection with 3 fds in the kernel and 2 queued in pled; its share is 5 and another of
    its connections asks for one more. Dropping the first frees only the 2 queued (the 3 sent stay in flight until
    its peer reads them): 3 + 1 fit, so that one is dropped and the asker is answered."""
    busy, _ = connect(1001, sent=3, queued=2)
    asker, _ = connect(1001)
    drops = session.fd_budget_drops(asker, [busy, asker], 1, FdBudget(per_uid=5, total=1000, reserve=0),
                                    Lingering(), OPERATORS)
    assert drops == [(busy, "uid 1001 has 5 table fds unread over its connections; this one holds 5")]


def test_one_fd_in_the_kernel_and_one_asked_for_fill_a_share_of_two_not_of_one(connect):
    """Its only other connection holds one fd in the kernel and none queued: dropping it frees nothing, so the
    asker is the one dropped when the share is 1, and answered when it is 2."""
    holder, _ = connect(1001, sent=1)
    asker, _ = connect(1001)
    for share, dropped in ((1, [asker]), (2, [])):
        drops = session.fd_budget_drops(asker, [holder, asker], 1, FdBudget(share, 1000, 0), Lingering(), OPERATORS)
        assert [c for c, _ in drops] == dropped, share


def test_fds_unread_on_a_connection_pled_dropped_count_in_its_uids_share(connect):
    gone, _ = connect(1001, sent=1)
    lingering = Lingering()
    lingering.close_or_keep(gone, quiet=True)  # its peer has not read the fd: pled keeps its end, and counts it
    assert lingering.fds(1001) == 1
    asker, _ = connect(1001)
    assert session.fd_budget_drops(asker, [asker], 1, FdBudget(1, 1000, 0), lingering, OPERATORS) == [
        (asker, "uid 1001 has 1 table fds unread over its connections, 1 of them on connections pled has closed; "
                "this one holds 0")]
    assert session.fd_budget_drops(asker, [asker], 1, FdBudget(2, 1000, 0), lingering, OPERATORS) == []
    lingering.close()


def test_fds_in_flight_to_other_uids_count_in_no_share_but_their_own(connect):
    """uids 1000 and 1002 each hold 3 fds in the kernel; uid 1001, holding none, asks for 2 with a share of 2."""
    lower, _ = connect(1000, sent=3)
    higher, _ = connect(1002, sent=3)
    asker, _ = connect(1001)
    budget = FdBudget(per_uid=2, total=1000, reserve=0)
    assert session.fd_budget_drops(asker, [lower, higher, asker], 2, budget, Lingering(), OPERATORS) == []
    assert [c for c, _ in session.fd_budget_drops(asker, [lower, higher, asker], 3, budget, Lingering(),
                                                  OPERATORS)] == [asker]
