"""A reply never carries a dead fd.

A reply that cannot be written at once (the peer's socket is full) waits in pled. It used to keep the
region's fd *number*: a reload closed that fd, the next accept() took the number, and the waiting reply
then sent the attacker another client's connection (or a memfd still being staged). For every path that
queues a reply carrying fds (Attach, Attach with wait, the ETOOMANYREFS path) these tests fill the peer's
socket, close or reload the region behind the waiting reply, make pled accept new connections (so that a
freed number is taken again), and then read: the peer receives the original sealed region or nothing, never
another fd. A last test runs the same sequences as a non-root member of pled's group and tries every way we
know to write through whatever it received.
"""
import encodings.ascii  # noqa: F401  the forked non-root child cannot import it (the stdlib may sit under a 0700 home)
import json
import mmap
import os
import signal
import socket
import stat
import subprocess
import sys
import threading

import pytest

from attack import PING_REPLY, assert_serving, closed_by_peer, ping_capacity, read_all, stuck_call, unread
from forked import as_user
from harness import start, stays_false, unused_gid, wait_until, write_config
from pled import client
from pled.shared import protocol, region

pytestmark = pytest.mark.daemon

ATTACH = protocol.call(protocol.ATTACH, table="t1")
ATTACH_WAIT = protocol.call(protocol.ATTACH, table="slow", wait=True)


def identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def original_of(sock_path: str, table: str) -> tuple[int, int]:
    """The (dev, inode) of the region pled serves for ``table`` now."""
    with client.attach(table, socket=sock_path, populate=False) as t:
        return identity(t.fd)


def what_is(fd: int) -> str:
    st = os.fstat(fd)
    link = os.readlink(f"/proc/self/fd/{fd}")
    return f"{stat.filemode(st.st_mode)} {link} seals={region.seals(fd) if stat.S_ISREG(st.st_mode) else '-'}"


def reload_and_reuse(pled, change) -> list[socket.socket]:
    """``change()`` the config or the files, reload, wait for it; then connections, so freed numbers are reused."""
    change()
    assert pled.reload(timeout=3) == "reload done", pled.log()[-2000:]
    others = []
    for _ in range(24):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(pled.socket)
        others.append(s)
    client.call(protocol.PING, socket=pled.socket)  # pled has accepted them all once it answers this
    return others


def assert_original_or_nothing(data: bytes, fds: list[int], original: tuple[int, int]) -> None:
    try:
        for fd in fds:
            assert identity(fd) == original and region.is_sealed(fd), f"received {what_is(fd)}, not the original region"
        replies = [json.loads(m) for m in data.split(b"\0") if m]
        attached = [r for r in replies if "table" in r.get("parameters", {})]
        assert len(fds) == len(attached), (len(fds), attached)
    finally:
        for fd in fds:
            os.close(fd)


def touch_shard(d):
    shard = sorted(d.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


@pytest.mark.parametrize("how", ["reloaded", "removed"])
def test_a_waiting_attach_reply_sends_the_original_region(tmp_path, sidecar, pleds, how):
    d1, d2 = sidecar(shards=2, rows=64), sidecar("ples_fp8", shards=1, rows=64)
    pled = start(tmp_path, {"t1": d1, "t2": d2})
    pleds.append(pled)
    original = original_of(pled.socket, "t1")
    capacity = ping_capacity(pled.socket)
    victim = stuck_call(pled.socket, ATTACH, capacity)
    attached_lines = pled.log().count("client attached: table t1")
    change = (lambda: touch_shard(d1)) if how == "reloaded" else (
        lambda: write_config(pled.config, {"t2": d2}, socket=pled.socket, headroom_margin=0))
    others = reload_and_reuse(pled, change)
    assert pled.log().count("client attached: table t1") == attached_lines  # not attached while the fd waits
    data, fds = read_all(victim)
    assert data.count(b"\0") == capacity + data.count(b'"table"') and len(data) >= capacity * PING_REPLY
    assert_original_or_nothing(data, fds, original)
    assert len(fds) == 1, "the reply should have been kept, with its own fd, and sent once read"
    assert pled.log().count("client attached: table t1") == attached_lines + 1
    for s in others + [victim]:
        s.close()
    assert_serving(pled, "t2", d2)


def test_an_attach_reply_never_read_is_not_logged_as_attached(tmp_path, sidecar, pleds):
    d1 = sidecar(shards=2, rows=64)
    pled = start(tmp_path, {"t1": d1})
    pleds.append(pled)
    capacity = ping_capacity(pled.socket)
    before = pled.log().count("client attached")
    victim = stuck_call(pled.socket, ATTACH, capacity)
    victim.close()
    client.call(protocol.PING, socket=pled.socket)
    stays_false(lambda: pled.log().count("client attached") != before, 0.3, "logged as attached")
    assert_serving(pled, "t1", d1)


def test_a_waiting_attach_with_wait_sends_the_original_region(tmp_path, sidecar, pleds):
    keep, slow = sidecar("ples_fp8", shards=1, rows=64), sidecar(shards=4, rows=3000)
    pled = start(tmp_path, {"keep": keep, "slow": slow}, wait="listening on", staging_bandwidth="4MB/s")
    pleds.append(pled)
    capacity = ping_capacity(pled.socket)
    victim = stuck_call(pled.socket, ATTACH_WAIT, capacity)  # answered when "slow" is ready, into a full socket
    pled.wait_for("ready:")
    assert pled.log().count("client attached: table slow") == 0
    original = original_of(pled.socket, "slow")
    others = reload_and_reuse(pled, lambda: write_config(pled.config, {"keep": keep}, socket=pled.socket,
                                                         headroom_margin=0))
    data, fds = read_all(victim)
    assert_original_or_nothing(data, fds, original)
    assert len(fds) == 1
    for s in others + [victim]:
        s.close()
    assert_serving(pled, "keep", keep)


TOO_MANY_REFS = """
import errno, os, socket
_real = socket.send_fds
def _send_fds(sock, buffers, fds, *rest):
    # The kernel's ETOOMANYREFS, once per flag file: pled bounds the fds in flight per uid well below the kernel's
    # limit (tests/test_attack_clients.py, fds in flight), so the refusal pled must survive is simulated here.
    if os.path.exists({flag!r}):
        os.unlink({flag!r})
        raise OSError(errno.ETOOMANYREFS, os.strerror(errno.ETOOMANYREFS))
    return _real(sock, buffers, fds, *rest)
socket.send_fds = _send_fds
"""


def test_a_reply_kept_after_etoomanyrefs_sends_the_original_region(tmp_path, sidecar, pleds):
    d1 = sidecar(shards=2, rows=64)
    flag = tmp_path / "too-many-refs"
    pled = start(tmp_path, {"t1": d1}, patch=TOO_MANY_REFS.format(flag=str(flag)))
    pleds.append(pled)
    original = original_of(pled.socket, "t1")
    capacity = ping_capacity(pled.socket)
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # holds one fd in flight: the one dropped
    holder.connect(pled.socket)
    holder.sendall(ATTACH)
    wait_until(lambda: unread(holder) > 0, 10, message="the holder's Attach reply never came")  # its fd now in flight
    flag.touch()
    victim = stuck_call(pled.socket, ATTACH, capacity)
    assert not flag.exists(), "the victim's reply never met ETOOMANYREFS"
    assert "ETOOMANYREFS" in pled.log()
    others = reload_and_reuse(pled, lambda: touch_shard(d1))
    data, fds = read_all(victim)
    assert_original_or_nothing(data, fds, original)
    assert len(fds) == 1
    for s in others + [victim, holder]:
        s.close()
    assert_serving(pled, "t1", d1)


# -- a non-root member of pled's group ---------------------------------------------------------------------

def writable_ways(fd: int) -> list[str]:
    """Every way we know to change the file behind ``fd``; the names of those that worked."""
    worked = []
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:pled:"):
        worked.append(f"not a pled memfd: {what_is(fd)}")
        return worked
    if region.seals(fd) & region.SEALS != region.SEALS:
        worked.append(f"seals {region.seals(fd):#x}")
    attempts = {
        "pwrite": lambda f: os.pwrite(f, b"X", 0),
        "mmap PROT_WRITE": lambda f: mmap.mmap(f, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE).close(),
        "ftruncate down": lambda f: os.ftruncate(f, 0),
        "ftruncate up": lambda f: os.ftruncate(f, st.st_size + 4096),
        "fallocate": lambda f: os.posix_fallocate(f, st.st_size, 4096),
    }
    for what, attempt in attempts.items():
        for label, target in (("", fd), (" after reopening it O_RDWR", None)):
            if target is None:
                try:
                    target = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
                except OSError:
                    continue
                if os.geteuid() != 0:  # pled makes its regions 0444: only root may reopen one O_RDWR
                    worked.append(f"reopened O_RDWR (mode {stat.filemode(st.st_mode)})")
            try:
                attempt(target)
                worked.append(what + label)
            except OSError:
                pass
            finally:
                if target != fd:
                    os.close(target)
    return worked


@pytest.mark.root
@pytest.mark.slow
def test_a_member_of_pleds_group_gets_no_writable_fd_by_any_sequence(tmp_path, sidecar, open_dir, pleds):
    """Tried, as uid 65534 in pled's group: a plain Attach; Attach with wait; stuck Attach replies across
    reloads that restage the table, then many new connections; a reply left unread until pled drops it;
    reading pled's own /proc fds. Every fd received is checked with writable_ways()."""
    from pathlib import Path

    gid = unused_gid()
    d1 = sidecar(shards=2, rows=64)
    sock_path = os.path.join(open_dir, "pled.sock")
    pled = start(tmp_path, {"t1": d1}, socket=sock_path, prefix=["setpriv", f"--regid={gid}", "--clear-groups"])
    pleds.append(pled)
    capacity = ping_capacity(sock_path)
    stop = threading.Event()

    def reloads():  # while the child tries, the table is restaged over and over
        while not stop.is_set():
            touch_shard(d1)
            pled.proc.send_signal(signal.SIGHUP)
            stop.wait(0.4)

    def generation() -> int:
        return client.call(protocol.STATUS, socket=sock_path)["tables"][0]["generation"]

    def as_member():
        received = []
        with client.attach("t1", socket=sock_path) as t:
            received.append(os.dup(t.fd))
        with client.attach("t1", socket=sock_path, wait=True) as t:
            received.append(os.dup(t.fd))
        for _ in range(4):
            victim = stuck_call(sock_path, ATTACH, capacity)
            now = generation()
            wait_until(lambda now=now: generation() > now, 30, message="no reload restaged the table")
            others = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(16)]
            for s in others:
                s.connect(sock_path)
            received += read_all(victim)[1]
            for s in others + [victim]:
                s.close()
        lost = stuck_call(sock_path, ATTACH, capacity)
        wait_until(lambda: closed_by_peer(lost), 30, message="pled never dropped it")  # past CALL_TIMEOUT
        received += read_all(lost)[1]
        procfs = []
        for name in os.listdir(f"/proc/{pled.pid}/fd") if os.access(f"/proc/{pled.pid}/fd", os.R_OK) else []:
            try:
                procfs.append(os.open(f"/proc/{pled.pid}/fd/{name}", os.O_RDONLY))
            except OSError:
                pass
        problems = [f"fd {i}: {', '.join(ways)}" for i, fd in enumerate(received + procfs)
                    if (ways := writable_ways(fd))]
        return f"{len(received)} fds received, {len(procfs)} opened from pled's /proc; writable: {problems}"

    worker = threading.Thread(target=reloads)
    worker.start()
    try:
        said = as_user(as_member, groups=[gid])
    finally:
        stop.set()
        worker.join()
    assert said.endswith("writable: []") and "0 opened from pled's /proc" in said, said
    assert int(said.split()[0]) >= 6, said
    assert_serving(pled, "t1", Path(d1))


NO_PROC = """
import fcntl, logging, os
from pled.daemon.serving import session
logging.basicConfig(format="%(levelname)s %(message)s")
fd = os.memfd_create("pled:t", os.MFD_ALLOW_SEALING)
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
mine = [session.readonly_duplicate(fd) for _ in range(3)]
writable = os.memfd_create("pled:w", os.MFD_ALLOW_SEALING)  # a writable table's: sealed against all but writing
fcntl.fcntl(writable, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
try:
    session.readonly_duplicate(writable)
    refused = "duplicated"
except OSError:
    refused = "refused"
print(sorted({fcntl.fcntl(m, fcntl.F_GETFL) & os.O_ACCMODE for m in mine}), os.path.exists("/proc/self/fd"), refused)
"""


@pytest.mark.root
def test_without_proc_a_reply_gets_a_duplicate_and_the_log_says_so_once(tmp_path):
    """A read-only description of a memfd can only be opened through /proc. In a mount namespace with an empty
    /proc the reply's fd of a write-sealed region is a duplicate of pled's read-write one (the seals are what refuse
    writes), said once; a writable table's region (not write-sealed) is never duplicated: the client is refused."""
    import shutil
    import subprocess
    import sys

    if not shutil.which("unshare"):
        pytest.skip("needs unshare(1)")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        'mount -t tmpfs none /proc && exec "$0" -c "$1"', sys.executable, NO_PROC],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [f"[{os.O_RDWR}]", "False", "refused"], r.stdout
    assert r.stderr.count("cannot reopen a table's memfd read-only through /proc") == 1, r.stderr


def test_a_tables_fd_is_close_on_exec_in_the_client_from_the_moment_it_arrives(tmp_path, sidecar, pleds):
    """The memfd a client receives is its table's (the Table owns it) and no child's: a vLLM process that execs a
    child without closing its fds (close_fds=False, os.exec*, a shell's own redirections) must not hand it the
    table, whose memory that child would then keep alive after pled lets the table go. It is received
    close-on-exec (MSG_CMSG_CLOEXEC), not marked so afterwards, so no thread's fork and exec meanwhile gets it."""
    d = sidecar(shards=1, rows=64)
    pled = start(tmp_path, {"t1": d})
    pleds.append(pled)
    with client.attach("t1", socket=pled.socket, timeout=10) as t:
        assert not os.get_inheritable(t.fd)
        child = subprocess.run([sys.executable, "-c", f"import os; os.fstat({t.fd})"], close_fds=False,
                               capture_output=True, text=True, timeout=60)
        assert child.returncode != 0 and "Bad file descriptor" in child.stderr, (child.returncode, child.stderr)
