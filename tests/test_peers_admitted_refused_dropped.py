"""Who pled admits, refuses and drops, with real clients that are other users: a process forked from the test (as
root) that takes a uid, a primary gid and supplementary groups of its own, each chosen so that no two are the same
number, and then talks to a real `pled serve` through pled's client library or a raw socket.

What decides is the kernel's word at connect time: SO_PEERCRED (pid, uid, primary gid) and SO_PEERGROUPS (the
supplementary groups). Here a uid is never equal to its gid, so a uid read as a gid (or the other way round) admits
the wrong client, and pled's group is met as a primary group with no supplementary ones as well as a supplementary
one. `pled status` and pled's log must name each client by its own pid and uid.
"""
from __future__ import annotations

import encodings.ascii  # noqa: F401  the children cannot import it: Python's stdlib may sit under root's 0700 home
import hashlib
import json
import os
import pwd
import re
import select
import socket
import time
from pathlib import Path

import pytest

import harness
from harness import run_pled, unused_gid, wait_until, write_config
from pled import client
from pled.client.library import attach
from pled.daemon.serving.session import CALL_TIMEOUT
from pled.shared import protocol

pytestmark = [pytest.mark.root, pytest.mark.daemon]


# -- ids nobody on this host has ------------------------------------------------------------------------------------

def unused_ids(n: int, start: int = 61000) -> list[int]:
    """``n`` distinct numbers from ``start`` on that name neither a user nor a group here."""
    users = {p.pw_uid for p in pwd.getpwall()}
    out: list[int] = []
    g = start
    while len(out) < n:
        g = unused_gid(g)
        if g not in users:
            out.append(g)
        g += 1
    return out


# -- a client as another user ---------------------------------------------------------------------------------------

def _attach(state: dict, sock: str) -> str:
    t = state["table"] = attach("t", socket=sock, populate=False, timeout=10)
    return f"attached generation {t.generation}"


def _read(state: dict) -> str:
    """A digest of the held table's first shard, read through the mapping."""
    t = state["table"]
    s = t.shards[0]
    return hashlib.sha256(t.buffer[s.offset: s.offset + s.size]).hexdigest()


def _raw_attach(state: dict, sock: str) -> str:
    """Attach over a raw connection that stays open afterwards: a client free to send more calls on it."""
    s = state["raw"] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(sock)
    return _raw_call(state, protocol.call(protocol.ATTACH, table="t"))


def _raw_call(state: dict, call: bytes) -> str:
    """``call`` on the raw connection: its reply's error (or "ok generation N") and how many fds came (closed)."""
    s = state["raw"]
    s.sendall(call)
    data, fds = b"", []
    while not data.endswith(b"\0"):
        chunk, got, _, _ = socket.recv_fds(s, 65536, 4)
        fds += got
        if not chunk:
            return f"closed by pled after {data!r}"
        data += chunk
    for fd in fds:
        os.close(fd)
    reply = json.loads(data[:-1])
    what = reply.get("error") or f"ok generation {reply['parameters'].get('generation')}"
    return f"{what}, {len(fds)} fd"


def _raw_again(state: dict) -> str:
    return _raw_call(state, protocol.call(protocol.ATTACH, table="t"))


def _flood(state: dict, sock: str, call: str) -> str:
    """One more connection that sends ``call`` a few hundred times and reads none of the replies; back once pled has
    begun to answer them (or closed it), so that each connection has been handled before the next is opened."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock)
    s.setblocking(False)
    try:
        s.send(call.encode() * 400)
    except BlockingIOError:
        pass
    state.setdefault("floods", []).append(s)
    poller = select.poll()
    poller.register(s, select.POLLIN | select.POLLRDHUP)
    if not poller.poll(10_000):
        raise TimeoutError("pled answered none of the calls in 10 s")
    return str(len(state["floods"]))


def _floods_closed(state: dict) -> str:
    """How many flooding connections pled has closed its end of (POLLRDHUP), whatever it left unread there."""
    closed = 0
    for s in state.get("floods", []):
        poller = select.poll()
        poller.register(s, select.POLLRDHUP)
        closed += bool(poller.poll(0))
    return str(closed)


def _ping(s: socket.socket) -> bytes:
    """A Ping on ``s``: pled's whole reply, or what came before it closed the connection (b"": refused at once)."""
    data = b""
    try:
        s.sendall(protocol.call(protocol.PING))
        while not data.endswith(b"\0"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except (BrokenPipeError, ConnectionResetError):  # pled closed it before the call was written
        pass
    return data


def _hold(state: dict, sock: str, n: int) -> str:
    """``n`` more connections, one after another, each with a Ping: how many pled answered; those stay open (idle)
    until close_all, the others (pled closed them) are closed."""
    answered = 0
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(sock)
        if _ping(s).endswith(b"\0"):
            answered += 1
            state.setdefault("held", []).append(s)
        else:
            s.close()
    return str(answered)


def _forks(state: dict, sock: str, n: int) -> str:
    """``n`` processes, one after another, each forked from this one (a new pid, the same uid and groups), that
    connect, call Ping and end: how many pled refused with PermissionDenied."""
    denied = 0
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(10)
                s.connect(sock)
                code = 0 if protocol.PERMISSION_DENIED.encode() in _ping(s) else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        denied += os.waitstatus_to_exitcode(status) == 0
    return str(denied)


def _close_all(state: dict) -> str:
    for s in state.pop("floods", []) + state.pop("held", []):
        s.close()
    for key in ("table", "raw"):
        if key in state:
            state.pop(key).close()
    return "closed"


ACTIONS = {f.__name__[1:]: f for f in (_attach, _read, _raw_attach, _raw_again, _flood, _floods_closed, _hold, _forks,
                                        _close_all)}


class UserProcess:
    """A process of its own, forked from this one and then uid ``uid``, primary gid ``gid`` and exactly ``groups``
    as its supplementary groups (setgroups, setresgid, setresuid: nothing of root left). ``do(action, *args)`` runs
    one of ACTIONS there and returns what it returned, or "<ExceptionName>: <message>" for what it raised; what an
    action keeps (an attached table, connections) stays in that process until ``close()``. It holds none of this
    process's fds but its two pipes, so it keeps open no connection it did not make itself."""

    def __init__(self, uid: int, gid: int, groups: list[int]) -> None:
        harness.require_marker("root", "runs a process as another uid")
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                keep = {0, 1, 2, requests_r, replies_w}
                for fd in map(int, os.listdir("/proc/self/fd")):
                    if fd not in keep:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                os.setgroups(groups)
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
                self._serve(requests_r, replies_w)
            finally:
                os._exit(0)
        os.close(requests_r)
        os.close(replies_w)
        self.pid, self.uid = pid, uid
        self._requests = os.fdopen(requests_w, "w")
        self._replies = os.fdopen(replies_r)

    @staticmethod
    def _serve(requests: int, replies: int) -> None:
        state: dict = {}
        with os.fdopen(requests) as inbox, os.fdopen(replies, "w") as outbox:
            for line in inbox:
                name, args = json.loads(line)
                try:
                    said = str(ACTIONS[name](state, *args))
                except Exception as err:  # the test reads what went wrong
                    said = f"{type(err).__name__}: {err}"
                outbox.write(json.dumps(said) + "\n")
                outbox.flush()

    def do(self, action: str, *args) -> str:
        self._requests.write(json.dumps([action, args]) + "\n")
        self._requests.flush()
        line = self._replies.readline()
        assert line, f"the process as uid {self.uid} ended"
        return json.loads(line)

    def close(self) -> None:
        """End the process (its connections close with it: the detach) and reap it."""
        if self._requests is not None:
            self._requests.close()
            self._replies.close()
            self._requests = None
            os.waitpid(self.pid, 0)


@pytest.fixture
def users():
    """make(uid, gid, groups) -> a UserProcess; each is ended after the test."""
    made: list[UserProcess] = []

    def make(uid: int, gid: int, groups: list[int] = ()) -> UserProcess:
        p = UserProcess(uid, gid, list(groups))
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def once(make, uid: int, gid: int, groups: list[int], action: str, *args) -> tuple[int, str]:
    """A fresh process as uid/gid/groups does ``action`` once and ends: (its pid, what it said)."""
    p = make(uid, gid, groups)
    try:
        return p.pid, p.do(action, *args)
    finally:
        p.close()


def open_up(sock: str) -> None:
    """Let any uid reach the socket, so that pled's own check decides (its 0660 mode in a 0750 directory would
    keep out a client outside pled's group before pled sees it)."""
    os.chmod(os.path.dirname(sock), 0o755)
    os.chmod(sock, 0o666)


def start(daemon, sidecar, open_dir: str, name: str, **keys) -> tuple[harness.Daemon, str]:
    """pled serving table t, its socket under ``open_dir`` (which every uid may traverse)."""
    sock = os.path.join(open_dir, name, "pled.sock")
    return daemon({"t": sidecar(shards=1, rows=64)}, socket=sock, **keys), sock


def start_as_own_user(open_dir: str, pleds: list, name: str, uid: int, gid: int) -> tuple[harness.Daemon, str]:
    """pled serving table t as its own user ``uid``, group ``gid`` (as under pled.service), with an open-file limit
    of 256 (128 connections), its socket in a directory of its own that only its group may traverse (the unit's
    RuntimeDirectory=pled)."""
    from pled.generator import make_sidecar

    run = os.path.join(open_dir, name)
    os.mkdir(run, 0o750)
    os.chown(run, uid, gid)  # the unit's RuntimeDirectory=pled: pled's own, its group may traverse
    make_sidecar(os.path.join(open_dir, "t"), "ples_int4", shards=1, rows=64)
    sock = os.path.join(run, "pled.sock")
    pled = harness.start(Path(open_dir), {"t": os.path.join(open_dir, "t")}, name=name, socket=sock, nofile=256,
                         prefix=["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"])
    pleds.append(pled)
    return pled, sock


def status_lists(sock: str, pid: int, uid: int) -> None:
    """`pled status` lists the client by its own pid and uid, attached to t (and the Status reply says the same)."""
    r = run_pled("status", "--socket", sock)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(rf"^  pid {pid}\s+uid {uid}\s+t\s", r.stdout, re.M), r.stdout
    st = client.call(protocol.STATUS, socket=sock)
    assert [(c["pid"], c["uid"], c["tables"]) for c in st["clients"]] == [(pid, uid, ["t"])], st["clients"]


def refused(said: str, pled: harness.Daemon, pid: int, uid: int) -> None:
    """The client was told pled refused its uid, and pled's log names its pid and uid."""
    assert said.startswith("PermissionDenied: ") and f"refused uid {uid}: run it in pled's group" in said, said
    pled.wait_for(f"refused pid {pid} uid {uid} (")


# -- a uid is not a gid, and pled's group counts as a primary group too ---------------------------------------------

def test_allow_uids_admits_a_client_by_its_uid_never_by_its_gid(daemon, sidecar, open_dir, users):
    """allow_uids = [A]. The client with uid A and gid B attaches and is listed as uid A; the client with uid B and
    gid A (A is its primary group, and a number in allow_uids) is refused, named as uid B."""
    a, b = unused_ids(2)
    pled, sock = start(daemon, sidecar, open_dir, "uids", allow_uids=[a])
    open_up(sock)

    allowed = users(a, b, [])
    assert allowed.do("attach", sock) == "attached generation 1"
    pled.wait_for(f"client attached: table t generation 1 to pid {allowed.pid} uid {a} (")
    status_lists(sock, allowed.pid, a)
    allowed.close()

    pid, said = once(users, b, a, [], "attach", sock)
    refused(said, pled, pid, b)


@pytest.mark.parametrize("case", ["primary_is_pleds_group", "supplementary_is_pleds_group", "primary_in_allow_groups",
                                  "neither"])
def test_pleds_group_and_allow_groups_admit_a_primary_or_supplementary_member(daemon, sidecar, open_dir, users, case):
    """pled runs with gid G (its socket's group) and allow_groups = [A]; the client's uid U is none of the gids.
    SO_PEERCRED gives only the primary gid, SO_PEERGROUPS only the supplementary ones: both count."""
    u, g, a, x, y = unused_ids(5)
    gid, groups = {"primary_is_pleds_group": (g, []), "supplementary_is_pleds_group": (x, [g]),
                   "primary_in_allow_groups": (a, []), "neither": (x, [y])}[case]
    pled, sock = start(daemon, sidecar, open_dir, "groups", allow_groups=[a], group=g, extra_groups=[])
    if g not in [gid, *groups]:
        open_up(sock)  # a member of G gets through the socket's own 0660 mode in group G; others need it opened

    p = users(u, gid, groups)
    said = p.do("attach", sock)
    if case == "neither":
        refused(said, pled, p.pid, u)
        return
    assert said == "attached generation 1", said
    pled.wait_for(f"client attached: table t generation 1 to pid {p.pid} uid {u} (")
    status_lists(sock, p.pid, u)


# -- allow_uids / allow_groups narrowed and widened by a reload -----------------------------------------------------

@pytest.mark.parametrize("key", ["allow_uids", "allow_groups"])
def test_a_reload_that_narrows_access_refuses_the_next_connect_and_widening_admits_again(daemon, sidecar, open_dir,
                                                                                          users, key):
    """The client (uid U, gid V) is admitted by ``key`` (allow_uids = [U], or allow_groups = [V]); the config is
    rewritten without it and reloaded: a new connection of the same user is refused; rewritten with it again and
    reloaded: admitted again.

    What pled does with a client already attached when access narrows (this test holds it to that): it keeps it.
    pled decides who may call when a connection is accepted, from the kernel's word at that moment
    (docs/protocol.md), and a reload does not revisit open connections. So the attached table stays mapped and
    readable (pled could not take a mapped memfd back anyway), `pled status` still lists the client, and pled even
    answers further calls on that same connection, a new Attach included: only new connections meet the narrowed
    policy. A client that must lose access at once has to be stopped (or pled restarted)."""
    u, v = unused_ids(2)
    sc = sidecar(shards=1, rows=64)
    sock = os.path.join(open_dir, "narrow", "pled.sock")
    allowed = {key: [u] if key == "allow_uids" else [v]}
    pled = daemon({"t": sc}, socket=sock, **allowed)
    open_up(sock)

    def rewrite_and_reload(**keys) -> None:
        write_config(pled.config, {"t": sc}, socket=sock, headroom_margin=0, **keys)
        r = run_pled("reload", "--socket", sock)
        assert r.returncode == 0 and r.stdout.splitlines() == ["unchanged: t", f"settings changed: {key}"], \
            r.stdout + r.stderr

    holder = users(u, v, [])
    assert holder.do("attach", sock) == "attached generation 1"
    digest = holder.do("read")
    raw = users(u, v, [])
    assert raw.do("raw_attach", sock) == "ok generation 1, 1 fd"
    pid, said = once(users, u, v, [], "attach", sock)
    assert said == "attached generation 1", said

    rewrite_and_reload()  # narrowed: no allow_uids, no allow_groups
    pid, said = once(users, u, v, [], "attach", sock)
    refused(said, pled, pid, u)
    # Already attached: still holding its table, still listed, and its open connection still served.
    assert holder.do("read") == digest
    holders = sorted([(holder.pid, u), (raw.pid, u)])
    wait_until(lambda: sorted((c["pid"], c["uid"]) for c in client.call(protocol.STATUS, socket=sock)["clients"])
               == holders, 10, lambda: f"not {holders}: {client.call(protocol.STATUS, socket=sock)['clients']}")
    assert raw.do("raw_again") == "ok generation 1, 1 fd"

    rewrite_and_reload(**allowed)  # widened again
    pid, said = once(users, u, v, [], "attach", sock)
    assert said == "attached generation 1", said
    pled.wait_for(f"client attached: table t generation 1 to pid {pid} uid {u} (")


# -- replies left unread: dropped by their size, before the call timeout --------------------------------------------

UNREAD_BOUND = 8 * 1024  # pled's per-uid bound on unread replies, scaled down for this test (see below)
SCALE_DOWN = ("import pled.daemon.serving.session as session\n"
              "assert hasattr(session, 'MAX_UNREAD_PER_UID')  # else this patch would change nothing\n"
              f"session.MAX_UNREAD_PER_UID = {UNREAD_BOUND}\n")
MISSPELT = protocol.call(protocol.ATTACH, table="a-table-pled-does-not-serve-" + "x" * 170)  # NoSuchTable each


def test_connections_that_leave_their_replies_unread_are_dropped_by_size_well_before_the_call_timeout(
        daemon, sidecar, open_dir, users):
    """A client (uid U) opens connection after connection, each sending a few hundred calls (an Attach of a table
    pled does not serve, answered io.pled.NoSuchTable) and reading no reply. pled writes replies only as a peer reads
    them and handles no further call while one waits, so once the kernel holds all it takes for a connection, that
    connection keeps one reply in pled, unwritten. Over all of U's connections those are bounded
    (MAX_UNREAD_PER_UID): the connection whose reply would pass the bound is dropped at once, logged with the bytes
    of replies it does not read. That must happen well within the call timeout (CALL_TIMEOUT, 5 s), which would drop
    these connections too, later and for another reason ("an unread reply for over 5 s").

    The bound is scaled down (32 MiB to 8 KiB, patched into pled's interpreter before it starts): with replies of a
    few hundred bytes (Status: about a kilobyte), 32 MiB would take tens of thousands of connections, more than pled
    admits for one uid. One connection alone cannot reach its own 4 MiB bound (MAX_UNREAD) at all: pled holds one
    reply for it at a time, and none comes near 4 MiB. (NoSuchTable rather than Status replies: pled answers one in
    well under a tenth of a millisecond, Status in about one, and the kernel takes some 150 replies per connection
    before one waits in pled.)"""
    u, v = unused_ids(2)
    pled, sock = start(daemon, sidecar, open_dir, "unread", allow_uids=[u], patch=SCALE_DOWN)
    open_up(sock)
    with pytest.raises(client.NoSuchTable):
        client.attach(json.loads(MISSPELT[:-1])["parameters"]["table"], socket=sock)
    reply_size = len(protocol.encode(protocol.error(protocol.NO_SUCH_TABLE, table=json.loads(MISSPELT[:-1])[
        "parameters"]["table"], tables=["t"])))
    assert reply_size < UNREAD_BOUND // 8  # so that several connections are needed: a bound over all of them
    fds_before = pled.fds()

    p = users(u, v, [])
    dropped = re.compile(rf"dropping pid {p.pid} uid {u} \(.*\): (\d+) bytes of replies it does not read")
    began = time.monotonic()
    opened = 0
    while not dropped.search(pled.log()):
        assert time.monotonic() - began < CALL_TIMEOUT / 2, (
            f"{opened} connections leaving replies unread for {time.monotonic() - began:.1f} s, none logged as "
            f"dropped for its unread replies:\n{pled.log()[-3000:]}")
        opened = int(p.do("flood", sock, MISSPELT.decode()))
    took = time.monotonic() - began
    size = int(dropped.search(pled.log()).group(1))
    # The line names the bytes pled would have held for that connection: at least the reply that passed the bound.
    assert reply_size <= size <= UNREAD_BOUND + reply_size, pled.log()[-2000:]
    assert took < CALL_TIMEOUT / 2, f"dropped after {took:.1f} s"
    assert "for over" not in pled.log()  # nothing was dropped by the call timeout
    wait_until(lambda: int(p.do("floods_closed")) >= 1, 5, "pled did not close the connection it dropped")

    # U's flood fills its share again; a well-behaved connection of U is still answered: the connections holding
    # the unread bytes are the ones dropped, not the one whose small reply comes last.
    p.do("flood", sock, MISSPELT.decode())
    pid, said = once(users, u, v, [], "attach", sock)
    assert said == "attached generation 1", (said, pled.log()[-2000:])

    # The rest of pled is unharmed: another uid is answered meanwhile, and once U's connections are gone U attaches.
    assert client.call(protocol.STATUS, socket=sock)["tables"][0]["state"] == "ready"
    p.do("close_all")
    wait_until(lambda: pled.fds() <= fds_before, 10, lambda: f"pled holds {pled.fds()} fds, {fds_before} before")
    pid, said = once(users, u, v, [], "attach", sock)
    assert said == "attached generation 1", said


# -- what one uid may take: its share of the connections, its budget of log lines -----------------------------------

def test_pleds_own_user_is_not_held_to_a_uids_share_of_the_connections(open_dir, pleds, users):
    """pled runs as its own user P, group G (P is not G), as under pled.service, with an open-file limit of 256: 128
    connections, a quarter of them for any one uid. Root and pled's own user are its operators (docs/protocol.md):
    no share holds them, and the last 8 connections are kept for them, so that `pled status` and `pled reload`
    (`systemctl reload pled` runs as P) get through whatever the clients hold. A process as P holds a quarter and 8
    more, every one answered; a member of G is stopped at the quarter, refused by its uid's share."""
    from pled.daemon.serving import fdlimit

    p_uid, g, member, x, y = unused_ids(5)
    pled, sock = start_as_own_user(open_dir, pleds, "own", p_uid, g)
    share = fdlimit.per_uid(fdlimit.max_connections(256))

    as_pled = users(p_uid, x, [])
    assert as_pled.do("hold", sock, share + fdlimit.OPERATOR_RESERVE) == str(share + fdlimit.OPERATOR_RESERVE)
    in_group = users(member, y, [g])
    assert in_group.do("hold", sock, share + 1) == str(share)
    pled.wait_for(f"refusing pid {in_group.pid} uid {member} (")
    st = client.call(protocol.STATUS, socket=sock)["daemon"]
    assert st["refused"]["uid_share"] == 1 and st["connections"] == 2 * share + fdlimit.OPERATOR_RESERVE + 1, st
    assert f"uid {p_uid} already holds" not in pled.log()


def test_four_uids_filling_the_connections_leave_the_last_8_to_root_and_pleds_own_user(open_dir, pleds, users):
    """Four members of pled's group, each a uid of its own, take every connection they can (pled as its own user P,
    open-file limit 256: 128 connections, 32 a uid). Three get their quarter; the fourth is stopped 8 short of the
    cap, told nothing but closed, and pled's log says the last 8 are kept for root and pled's user. Root's
    `pled status` gets through, and P then takes those 8, every one answered, with no client's connection closed to
    make room; a fifth member is refused at the full cap, again by the reserve, not by its (empty) share."""
    from pled.daemon.serving import fdlimit

    p_uid, g, *ids = unused_ids(12)
    members, primaries = ids[:5], ids[5:10]
    pled, sock = start_as_own_user(open_dir, pleds, "four", p_uid, g)
    cap = fdlimit.max_connections(256)
    share, open_to_all = fdlimit.per_uid(cap), cap - fdlimit.OPERATOR_RESERVE
    assert 3 * share < open_to_all < 4 * share  # the fourth uid meets the reserve before its own share

    four = [users(uid, gid, [g]) for uid, gid in zip(members[:4], primaries[:4], strict=True)]
    held = [p.do("hold", sock, share + 1) for p in four]
    assert held == [str(share)] * 3 + [str(open_to_all - 3 * share)], (held, pled.log()[-2000:])
    pled.wait_for(f"refusing pid {four[3].pid} uid {members[3]} (")
    assert re.search(rf"refusing pid {four[3].pid} uid {members[3]} \(.*\): {open_to_all} connections open; the "
                     rf"last {fdlimit.OPERATOR_RESERVE} of {cap} are kept for root and pled's user", pled.log())

    r = run_pled("status", "--socket", sock)  # root, the reserve untouched
    assert r.returncode == 0, r.stdout + r.stderr
    assert client.call(protocol.STATUS, socket=sock)["daemon"]["connections"] == open_to_all + 1
    assert users(p_uid, primaries[4], []).do("hold", sock, fdlimit.OPERATOR_RESERVE) == str(fdlimit.OPERATOR_RESERVE)

    fifth = users(members[4], primaries[4], [g])
    assert fifth.do("hold", sock, 1) == "0"
    pled.wait_for(f"refusing pid {fifth.pid} uid {members[4]} (")
    assert re.search(rf"refusing pid {fifth.pid} uid {members[4]} \(.*\): {cap} connections open; the last",
                     pled.log()), pled.log()[-2000:]
    assert "closing idle connections" not in pled.log()  # P's 8 were the reserve's: nobody made room for them
    st = client.call(protocol.STATUS, socket=sock)["daemon"]  # root at the cap: an operator may close an idle one
    assert st["refused"]["uid_share"] == 3 + (share + 1 - (open_to_all - 3 * share)) + 1, st["refused"]
    assert st["refused"]["connection_cap"] == 0 and st["dropped"]["idle_evicted"] <= 1, st


def test_at_the_cap_with_every_connection_attached_even_root_is_refused_and_counted_as_the_cap(daemon, sidecar,
                                                                                                  open_dir):
    """With an open-file limit of 256 pled takes 128 connections. Root attaches on every one of them, so none is idle
    for pled to close: root's next connection is refused, the log says all 128 are attached or busy, and Status
    counts it under connection_cap (the metrics' reason to raise LimitNOFILE=), not under uid_share. Once one table
    is detached, root is answered again and nothing else was closed."""
    from pled.daemon.serving import fdlimit

    pled, sock = start(daemon, sidecar, open_dir, "cap", nofile=256)
    cap = fdlimit.max_connections(256)
    tables = [attach("t", socket=sock, populate=False, timeout=10) for _ in range(cap)]
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        with s:
            s.connect(sock)
            assert _ping(s) == b""  # closed at once, unanswered
        pled.wait_for(f"all {cap} connections are attached or busy (the cap, from the open-file limit)")
        fds = pled.fds()
        tables.pop().close()
        wait_until(lambda: pled.fds() < fds, 10, "pled did not close the connection of the table detached")
        st = client.call(protocol.STATUS, socket=sock, timeout=10)["daemon"]
        assert (st["refused"]["connection_cap"], st["refused"]["uid_share"]) == (1, 0), st["refused"]
        assert st["dropped"]["idle_evicted"] == 0 and st["clients"] == cap - 1, st
    finally:
        for t in tables:
            t.close()


def test_a_refused_uid_forking_a_process_per_call_gets_the_log_lines_of_one_process(daemon, sidecar, open_dir,
                                                                                     users):
    """A uid pled does not admit (the socket opened up, so that pled's own check decides) runs 300 processes one
    after another, each a new pid that connects, calls Ping and is refused. Each refusal is counted in Status, but
    its log lines are a budget of that uid's, whatever the pids: 64 at once, then one a second, the next line saying
    how many were held back; one per pid flooded the journal."""
    from pled.daemon.health.throttle import Budget

    u, v = unused_ids(2)
    pled, sock = start(daemon, sidecar, open_dir, "forks")
    open_up(sock)
    p = users(u, v, [])
    began = time.monotonic()
    assert p.do("forks", sock, 300) == "300"
    elapsed = time.monotonic() - began
    assert client.call(protocol.STATUS, socket=sock)["daemon"]["refused"]["access"] == 300
    budget = Budget()
    lines = len(re.findall(rf"refused pid \d+ uid {u} \(", pled.log()))
    assert budget.burst <= lines <= budget.burst + budget.rate * elapsed + 1, (lines, elapsed)
    # Once the budget has room again, the next refused process's line carries the count of those held back.
    wait_until(lambda: p.do("forks", sock, 1) == "1" and "more like it held back: at most 64 at once" in pled.log(),
               30, message=lambda: pled.log()[-2000:])
