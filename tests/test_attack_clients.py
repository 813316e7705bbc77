"""Issue 11, what a client can do: each finding's attack against a real daemon, which must go on serving
(Status answers, a fresh client attaches and reads) with its fds and RSS back where they were."""
import errno
import os
import resource
import socket
import time

import pytest

from attack import assert_serving, baseline, limit_lines, raw
from forked import as_user, become
from harness import start, stays_false, wait_until
from pled.shared import protocol


@pytest.fixture(autouse=True)
def many_fds():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_1_a_deeply_nested_call_is_refused_not_fatal(tmp_path, sidecar, pleds):
    d = sidecar(shards=4, rows=64)
    pled = start(tmp_path, {"t1": d})
    pleds.append(pled)
    before = baseline(pled, "t1")
    nested = b'{"method":"io.pled.Ping","parameters":{"a":' + b"[" * 5000 + b"]" * 5000 + b"}}\0"
    for _ in range(3):
        reply = raw(pled.socket, nested)
        assert reply["error"] == protocol.INVALID_MESSAGE and "nests" in reply["parameters"]["reason"]
    assert_serving(pled, "t1", d, before)


def idle_connections(path: str, n: int) -> list[socket.socket]:
    """Up to ``n`` connections that send nothing; those refused because the listen backlog is full are skipped."""
    idle = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as err:
            s.close()
            assert err.errno == errno.EAGAIN, err  # the backlog is full
            continue
        idle.append(s)
    return idle


def test_3_idle_connections_past_the_fd_limit_neither_spin_nor_lock_others_out(tmp_path, sidecar, pleds):
    d = sidecar(shards=4, rows=64)
    pled = start(tmp_path, {"t1": d}, nofile=1024)  # systemd's default soft limit, as the hard one here
    pleds.append(pled)
    before = baseline(pled, "t1")
    idle = idle_connections(pled.socket, 1500)
    wait_until(lambda: limit_lines(pled.log()), 30)  # pled has met its limit
    stays_false(lambda: limit_lines(pled.log()) > 5, 2, "pled logs its limit over and over")
    assert_serving(pled, "t1", d)  # a newcomer is let in (an idle connection makes room for it)
    log = pled.log()
    assert (log.count("cannot accept") + log.count("refusing clients")
            + log.count("closing idle connections")) <= 5, log[-2000:]
    for s in idle:
        s.close()
    assert_serving(pled, "t1", d, before)


def test_3_accept_rests_while_no_fd_is_free(tmp_path, sidecar, pleds):
    """The cap is what keeps pled below its fd limit; with it lifted, accept() hits EMFILE: the listener must
    rest (not spin, not log a line per try) and take clients again once fds are free."""
    d = sidecar(shards=4, rows=64)
    pled = start(tmp_path, {"t1": d}, nofile=256,
                 patch="import pled.daemon.serving.fdlimit as f; f.max_connections = lambda n: 4096")
    pleds.append(pled)
    before = baseline(pled, "t1")
    idle = idle_connections(pled.socket, 400)
    pled.wait_for("cannot accept clients")
    stays_false(lambda: pled.log().count("cannot accept clients") > 1, 3, "a line per try")
    assert pled.log().count("cannot accept clients") == 1, pled.log()[-2000:]  # today's main: a line per try
    for s in idle:
        s.close()
    assert_serving(pled, "t1", d, before)


def test_4_a_client_that_calls_and_never_reads_is_dropped(tmp_path, sidecar, pleds):
    d = sidecar(shards=4, rows=64)
    pled = start(tmp_path, {"t1": d})
    pleds.append(pled)
    before = baseline(pled, "t1")
    greedy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    greedy.connect(pled.socket)
    greedy.setblocking(False)
    call = protocol.call(protocol.STATUS) * 64
    dropped = None
    deadline = time.monotonic() + 60
    while dropped is None and time.monotonic() < deadline:
        try:
            greedy.send(call)
        except BlockingIOError:
            time.sleep(0.01)
        except OSError as err:
            dropped = err.errno
    assert dropped in (errno.EPIPE, errno.ECONNRESET), "the greedy connection was never dropped"
    greedy.close()
    assert "dropping pid" in pled.log()
    assert_serving(pled, "t1", d, before)


@pytest.mark.root
def test_5_fds_in_flight_are_bounded_per_connection(tmp_path, sidecar, pleds):
    """8 connections each send 200 Attach calls and read nothing. pled runs with no capability, as in its unit, so
    the kernel counts every fd in flight against pled's user and refuses pled any more past its fd limit
    (ETOOMANYREFS; CAP_SYS_RESOURCE or CAP_SYS_ADMIN would exempt it), and every other client's attach would fail
    while the attackers stay. pled's own bound comes first: an attacker receives at most MAX_FDS_PER_CONNECTION fds
    and is dropped, named, and others attach meanwhile."""
    try:
        from pled.daemon.serving.session import MAX_FDS_PER_CONNECTION
    except ImportError:  # today's main, which has no such bound
        MAX_FDS_PER_CONNECTION = 16

    d = sidecar(shards=4, rows=64)
    drop = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"]
    pled = start(tmp_path, {"t1": d}, nofile=1024, prefix=drop)
    pleds.append(pled)
    before = baseline(pled, "t1")
    attackers = []
    for _ in range(8):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(pled.socket)
        s.sendall(protocol.call(protocol.ATTACH, table="t1") * 200)
        attackers.append(s)
    pled.wait_for("table fds sent to it are unread")
    for _ in range(20):
        assert_serving(pled, "t1", d)
    received = []
    for s in attackers:
        s.settimeout(10)
        n = 0
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(s, 65536, 64)
            except ConnectionResetError:
                break
            for fd in fds:
                os.close(fd)
            n += len(fds)
            if not data:
                break
        received.append(n)
        s.close()
    assert max(received) <= MAX_FDS_PER_CONNECTION, received
    assert pled.log().count("table fds sent to it are unread") >= 1
    assert_serving(pled, "t1", d, before)


CHAOS = """
import os, random
import pled.daemon.handlers as h, pled.daemon.regions.planning as p, pled.daemon.tables as t
rng = random.Random(11)
KINDS = [RuntimeError, KeyError, OSError, ValueError, TypeError, RecursionError, ZeroDivisionError, AttributeError]
def chaotic(f):
    def g(*a, **k):
        if os.path.exists(os.environ["PLED_CHAOS"]) and rng.random() < 0.4:
            raise rng.choice(KINDS)("chaos")
        return f(*a, **k)
    return g
for cls, names in ((h.Handlers, ["ping", "status", "attach", "reload", "attach_reply", "on_close"]),
                   (t.TableState, ["sources", "describe"])):
    for n in names:
        setattr(cls, n, chaotic(getattr(cls, n)))
p.plan_reload = chaotic(p.plan_reload)
"""


def test_exceptions_thrown_into_handlers_never_stop_the_daemon(tmp_path, sidecar, pleds, monkeypatch):
    from pled import client

    d = sidecar(shards=4, rows=64)
    flag = tmp_path / "chaos-on"
    monkeypatch.setenv("PLED_CHAOS", str(flag))
    pled = start(tmp_path, {"t1": d}, patch=CHAOS)
    pleds.append(pled)
    before = baseline(pled, "t1")
    flag.touch()
    answered = {"ok": 0, "error": 0}
    for i in range(150):
        method = [protocol.PING, protocol.STATUS, protocol.ATTACH, protocol.RELOAD][i % 4]
        try:
            if method == protocol.ATTACH:
                with client.attach("t1", socket=pled.socket, timeout=20):
                    pass
            else:
                client.call(method, socket=pled.socket, timeout=20)
            answered["ok"] += 1
        except (client.ProtocolError, client.ReloadFailed):
            answered["error"] += 1
    assert answered["ok"] > 10 and answered["error"] > 10, answered
    flag.unlink()
    log = pled.log()
    assert "chaos" in log and "Traceback" in log  # logged, with where it happened
    assert_serving(pled, "t1", d, before)


@pytest.mark.root
def test_a_group_member_holding_attached_connections_cannot_lock_out_root_or_others(tmp_path, sidecar, open_dir, pleds):
    """A member of pled's group opens connections, attaches on each and keeps them (an attached connection is never
    idle, so none makes room): it gets at most its uid's share, and root's Status still goes through."""
    import signal as signal_mod

    from harness import unused_gid
    from pled import client
    from pled.daemon.serving import fdlimit

    gid = unused_gid()
    d = sidecar(shards=2, rows=64)
    sock_path = os.path.join(open_dir, "pled.sock")
    pled = start(tmp_path, {"t1": d}, socket=sock_path, nofile=200,
                 prefix=["setpriv", f"--regid={gid}", "--clear-groups"])
    pleds.append(pled)
    cap = fdlimit.max_connections(200)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the member: uid 65534 in pled's group, holding every connection it can get
        try:
            become(65534, [gid])
            held = 0
            for _ in range(cap + 10):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(5)
                try:
                    s.connect(sock_path)
                    s.sendall(protocol.call(protocol.ATTACH, table="t1"))
                    data, fds, _, _ = socket.recv_fds(s, 65536, 4)
                except OSError:
                    continue
                for fd in fds:
                    os.close(fd)
                held += bool(fds)
                s.detach()  # kept open until this process ends
            os.write(w, str(held).encode())
            signal_mod.pause()
        finally:
            os._exit(0)
    os.close(w)
    try:
        held = int(os.read(r, 64))
        st = client.call(protocol.STATUS, socket=sock_path, timeout=10)  # root, at once
        assert 0 < held <= fdlimit.per_uid(cap), (held, cap)
        assert sum(1 for c in st["clients"] if c["uid"] == 65534) == held
        assert f"uid 65534 already holds {fdlimit.per_uid(cap)} connections" in pled.log()
        assert_serving(pled, "t1", d)
    finally:
        os.kill(pid, signal_mod.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)



def test_the_attach_and_detach_lines_of_one_uid_are_a_budget_not_a_flood(tmp_path, sidecar, pleds):
    """One uid attaching and leaving over and over (a member forking short-lived children did 1,600 lines a second)
    gets its first 64 lines, then one a second, and the next line written says how many were held back; every
    attach is still counted in Status, and other uids' lines are their own budget."""
    from pled import client
    from pled.daemon.health.throttle import Budget

    d = sidecar(shards=2, rows=64)
    pled = start(tmp_path, {"t1": d})
    pleds.append(pled)
    budget = Budget()
    start_at = time.monotonic()
    for _ in range(150):
        with client.attach("t1", socket=pled.socket, populate=False):
            pass
    elapsed = time.monotonic() - start_at
    time.sleep(1.1)  # room for one more line: it carries the count of those held back
    with client.attach("t1", socket=pled.socket, populate=False):
        pass
    # pled writes the line once the kernel took the fd: the client may have it first
    log = pled.wait_for("more like it held back: at most 64 at once, then 1 a second", timeout=10)
    lines = log.count("client attached: table t1") + log.count("client detached:")
    assert lines <= budget.burst + budget.rate * (elapsed + 1.2) + 2, (lines, elapsed)
    st = client.call(protocol.STATUS, socket=pled.socket)["daemon"]
    assert st["attaches"] == 151, st
    assert_serving(pled, "t1", d)


def test_a_budget_writes_its_burst_then_its_rate_and_says_what_it_held_back(monkeypatch):
    from pled.daemon.health import throttle

    now = [100.0]
    monkeypatch.setattr(throttle.time, "monotonic", lambda: now[0])
    budget, written = throttle.Budget(burst=3, rate=1.0), []

    def emit(fmt, *args):
        written.append(fmt % args)

    assert [budget.log("u", emit, "line %d", i) for i in range(5)] == [True, True, True, False, False]
    assert budget.log("other", emit, "other")  # a key of its own
    now[0] += 2.5
    assert budget.log("u", emit, "line %d", 5) and budget.log("u", emit, "line %d", 6)
    assert not budget.log("u", emit, "line %d", 7)
    assert written == ["line 0", "line 1", "line 2", "other",
                       "line 5 (2 more like it held back: at most 3 at once, then 1 a second)", "line 6"]


def test_a_budget_quiet_for_a_day_writes_its_burst_again_not_a_days_worth_of_lines(monkeypatch):
    """Quiet for long enough, a key's budget is full again, and full is its burst: a peer quiet for a day that then
    floods gets 64 lines at once, not a day's refill of 86,400; a line said once a minute (Throttle), quiet for an
    hour, is said once, not 60 times."""
    from pled.daemon.health import throttle

    now = [100.0]
    monkeypatch.setattr(throttle.time, "monotonic", lambda: now[0])
    written: list[str] = []

    def emit(fmt, *args):
        written.append(fmt % args)

    budget, once_a_minute = throttle.Budget(), throttle.Throttle()
    assert budget.log("uid 1000", emit, "a line") and once_a_minute.log("accept", emit, "accept() failed")
    now[0] += 86400.0
    assert [budget.log("uid 1000", emit, "line %d", i) for i in range(1000)].count(True) == budget.burst
    assert [once_a_minute.log("accept", emit, "accept() failed") for _ in range(100)].count(True) == 1
    assert len(written) == 2 + budget.burst + 1, written[-3:]


@pytest.mark.root
def test_refused_reloads_of_one_uid_are_a_budget_not_a_flood(tmp_path, sidecar, open_dir, pleds):
    """A member of pled's group pipelines 500 Reload calls, each refused (only root and pled's user may reload):
    it wrote 28,000 warning lines a second. Now its lines are a budget; every refusal is still counted."""
    from harness import unused_gid
    from pled import client
    from pled.daemon.health.throttle import Budget

    gid = unused_gid()
    d = sidecar(shards=2, rows=64)
    sock_path = os.path.join(open_dir, "pled.sock")
    pled = start(tmp_path, {"t1": d}, socket=sock_path, prefix=["setpriv", f"--regid={gid}", "--clear-groups"])
    pleds.append(pled)

    def reload_500_times() -> str:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock_path)
        s.sendall(protocol.call(protocol.RELOAD) * 500)
        got = b""
        s.settimeout(20)
        while got.count(b"\0") < 500:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        return str(got.count(b"PermissionDenied"))

    began = time.monotonic()
    assert as_user(reload_500_times, groups=[gid]) == "500"
    elapsed = time.monotonic() - began
    budget = Budget()
    lines = pled.log().count("refused io.pled.Reload from")
    assert lines <= budget.burst + budget.rate * elapsed + 2, (lines, elapsed)
    assert client.call(protocol.STATUS, socket=sock_path)["daemon"]["refused"]["reload_access"] == 500
    assert_serving(pled, "t1", d)
