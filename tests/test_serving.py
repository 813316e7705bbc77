"""A real daemon process, real clients (processes and threads), real sockets and memfds."""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from forked import become
from harness import run_pled, wait_until
from pled import client
from pled.daemon.serving import server
from pled.shared import protocol

MiB = 1024**2


def settled_fds(pled, want: int | None = None, timeout: float = 10) -> int:
    """The daemon's fd count once it stops changing (it sees a client's close a moment after the client)."""
    deadline = time.monotonic() + timeout
    last = pled.fds()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = pled.fds()
        if now == last and (want is None or now == want):
            return now
        last = now
    return last


def shmem() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def raw_call(sock_path: str, payload: bytes, read: bool = True, timeout: float = 10) -> dict | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(sock_path)
    s.sendall(payload)
    if not read:
        s.close()
        return None
    data = b""
    while not data.endswith(b"\0"):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    return json.loads(data[:-1]) if data else None


CLIENT = textwrap.dedent("""
    import json, os, sys, time
    from pled.client import attach
    t = attach(sys.argv[1], socket=sys.argv[2])
    st = os.fstat(t.fd)
    print(json.dumps({"ino": st.st_ino, "dev": st.st_dev, "resident": t.residency(),
                      "populate_s": t.populate_seconds}), flush=True)
    sys.stdin.readline()  # hold the table until told to go
""")


def test_two_processes_share_the_same_pages(sidecar, daemon):
    d = sidecar("ples_int4", shards=4, rows=160_000)  # 64 MB table
    pled = daemon({"ples_int4": d})
    base = shmem()
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, "ples_int4", pled.socket], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        seen = [json.loads(p.stdout.readline()) for p in procs]
        assert seen[0]["ino"] == seen[1]["ino"] and seen[0]["dev"] == seen[1]["dev"]
        assert all(s["resident"] == 1.0 for s in seen)
        grown = shmem() - base
        # Each client mapped and pre-faulted the whole 66 MiB region; Shmem must not grow by a copy per client.
        assert grown < 16 * MiB, f"Shmem grew by {grown / MiB:.1f} MiB with two clients attached"
        st = client.call(protocol.STATUS, socket=pled.socket)
        pids = {c["pid"] for c in st["clients"]}
        assert {p.pid for p in procs} <= pids
        assert all(c["tables"] == ["ples_int4"] for c in st["clients"])
    finally:
        for p in procs:
            p.communicate("\n", timeout=30)
    log = pled.wait_for("client detached")
    assert f"client attached: table ples_int4 generation 1 to pid {procs[0].pid} uid 0" in log


def test_bytes_tensors_and_zero_copy(sidecar, daemon):
    d = sidecar("ples_fp8", shards=3, rows=5000)
    pled = daemon({"ples_fp8": d})
    with client.attach("ples_fp8", socket=pled.socket) as t:
        assert t.generation == 1 and t.manifest.layout == "ples_fp8" and len(t.shards) == 3
        for s in t.shards:
            with open(s.path, "rb") as f:
                assert t.buffer[s.offset : s.offset + s.size] == f.read()
        assert set(t.tensors) == {f"shard_{i}/{n}" for i in range(3) for n in ("weight_fp8", "weight_scale")}
        for entry in t.manifest.tensors:
            view = t.shard_tensors(entry.shard)[entry.name]
            assert view.data_ptr() == t.address + entry.offset  # a view into the mapping, not a copy
        w = t.tensors["shard_1/weight_fp8"]
        assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == (5000, 160)
        assert t.residency() == 1.0
        del w, view


def test_writes_through_a_client_mapping_fail(sidecar, daemon):
    d = sidecar("ples_int4", shards=2, rows=1000)
    pled = daemon({"ples_int4": d})
    with client.attach("ples_int4", socket=pled.socket) as t:
        with pytest.raises(TypeError):
            t.buffer[0:1] = b"X"  # the mapping is PROT_READ
        import fcntl
        import mmap

        assert fcntl.fcntl(t.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY  # pled sends a read-only fd
        with pytest.raises(PermissionError):  # a second, writable mapping of the same fd
            mmap.mmap(t.fd, t.manifest.region_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.pwrite(t.fd, b"X", 0)
        writable = os.open(f"/proc/self/fd/{t.fd}", os.O_RDWR)  # root may reopen it writable: the seals still hold
        try:
            with pytest.raises(PermissionError):
                os.pwrite(writable, b"X", 0)
            with pytest.raises(PermissionError):
                mmap.mmap(writable, t.manifest.region_bytes, flags=mmap.MAP_SHARED,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(writable)
    # A write through a torch view faults the writer, and only the writer.
    code = textwrap.dedent(f"""
        from pled.client import attach
        t = attach("ples_int4", socket={pled.socket!r})
        t.tensors["shard_0/weight_i4"][0, 0] = 7
        print("wrote")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGSEGV and "wrote" not in r.stdout
    with client.attach("ples_int4", socket=pled.socket) as t, open(d / "shard_0.safetensors", "rb") as f:
        s = t.shards[0]
        assert t.buffer[s.offset : s.offset + s.size] == f.read()
    assert client.call(protocol.PING, socket=pled.socket) == {}


def test_200_clients_attach_at_once(sidecar, daemon):
    pled = daemon({"t": sidecar(shards=2, rows=1000)})
    barrier = threading.Barrier(200)

    def one(_):
        barrier.wait()
        t = client.attach("t", socket=pled.socket, populate=False, timeout=60)
        return t

    with ThreadPoolExecutor(200) as pool:
        tables = list(pool.map(one, range(200)))
    try:
        assert len(tables) == 200 and all(t.manifest.table == "t" for t in tables)
        st = client.call(protocol.STATUS, socket=pled.socket)
        assert len(st["clients"]) == 200
    finally:
        for t in tables:
            t.close()


def test_no_fd_leak_after_1000_attach_close_cycles(sidecar, daemon):
    pled = daemon({"t": sidecar(shards=2, rows=100)})
    client.call(protocol.PING, socket=pled.socket)
    before = settled_fds(pled)
    mine = len(os.listdir("/proc/self/fd"))
    for _ in range(1000):
        client.attach("t", socket=pled.socket, populate=False).close()
    assert settled_fds(pled, before) == before
    assert len(os.listdir("/proc/self/fd")) == mine


MALFORMED = [
    b"\0",
    b"not json\0",
    b"[1, 2, 3]\0",
    b'{"method": 42}\0',
    b'{"method": "io.pled.Attach", "parameters": []}\0',
    b'{"method": "io.pled.Explode", "parameters": {}}\0',
    b'{"method": "io.pled.Attach", "parameters": {"table": 7}}\0',
    b"\xff\xfe\xfd\0",
    b"x" * (protocol.MAX_CALL + 10),
]


def test_daemon_survives_malformed_input(sidecar, daemon):
    pled = daemon({"t": sidecar(shards=1, rows=10)})
    client.call(protocol.PING, socket=pled.socket)
    before = settled_fds(pled)
    for payload in MALFORMED:
        reply = raw_call(pled.socket, payload)
        assert reply is None or "error" in reply, (payload[:40], reply)
        assert client.call(protocol.STATUS, socket=pled.socket)["tables"][0]["state"] == "ready"
    assert raw_call(pled.socket, b'{"method": "io.pled.Explode"}\0')["error"] == protocol.METHOD_NOT_FOUND
    assert raw_call(pled.socket, b'{"method": "io.pled.Attach", "parameters": {"table": 7}}\0') == {
        "error": protocol.INVALID_PARAMETER, "parameters": {"parameter": "table"}}
    # Disconnect in the middle of a reply, many times.
    for _ in range(50):
        raw_call(pled.socket, protocol.call(protocol.ATTACH, table="t"), read=False)
        raw_call(pled.socket, protocol.call(protocol.STATUS), read=False)
    # Half a message, then silence: dropped after the call timeout, while others are served meanwhile.
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.connect(pled.socket)
    stuck.sendall(b'{"method": "io.pled.Sta')
    t0 = time.monotonic()
    assert client.call(protocol.PING, socket=pled.socket, timeout=2) == {}
    stuck.settimeout(server.CALL_TIMEOUT + 10)
    assert stuck.recv(4096) == b""  # the daemon closed it
    assert time.monotonic() - t0 < server.CALL_TIMEOUT + 5
    stuck.close()
    assert settled_fds(pled, before) == before
    assert "half a message" in pled.log()
    assert pled.proc.poll() is None


@pytest.mark.slow
def test_fuzzed_messages_never_hurt_the_daemon(sidecar, daemon):
    from hypothesis import HealthCheck, given, settings, strategies as st

    pled = daemon({"t": sidecar(shards=1, rows=10)})
    client.call(protocol.PING, socket=pled.socket)
    before = settled_fds(pled)
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                               lambda inner: (st.lists(inner, max_size=4)
                                              | st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                               max_leaves=10)
    methods = st.sampled_from([protocol.ATTACH, protocol.STATUS, protocol.PING, "x"]) | st.text(max_size=30)
    calls = st.fixed_dictionaries({"method": methods, "parameters": json_values})

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(st.binary(max_size=300).map(lambda b: b + b"\0"),
                     calls.map(lambda c: json.dumps(c).encode() + b"\0")),
           st.booleans())
    def poke(payload, read):
        reply = raw_call(pled.socket, payload, read=read)
        if reply is not None and read:
            assert isinstance(reply, dict)

    poke()
    assert client.call(protocol.STATUS, socket=pled.socket)["tables"][0]["state"] == "ready"
    assert settled_fds(pled, before) == before


def test_errors_are_typed_and_say_what_to_do(sidecar, daemon, tmp_path):
    with pytest.raises(client.DaemonUnavailable, match="systemctl start pled"):
        client.attach("t", socket=str(tmp_path / "nobody-home.sock"))
    pled = daemon({"t": sidecar(shards=1, rows=10)})
    with pytest.raises(client.NoSuchTable, match=r"serves no table 'nope' \(it serves: t\)"):
        client.attach("nope", socket=pled.socket)


@pytest.mark.root
def test_a_refused_uid_gets_permission_denied(sidecar, daemon):
    """A client running as nobody (the test forks and drops to uid 65534) against a socket it may open."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another uid")
    run = tempfile.mkdtemp(prefix="pled-perm-", dir="/tmp")
    os.chmod(run, 0o755)
    try:
        for allow, expected in (([], "PermissionDenied"), ([65534], "attached")):
            sock = os.path.join(run, f"pled{len(allow)}.sock")
            pled = daemon({"t": sidecar(shards=1, rows=10)}, socket=sock, allow_uids=allow)
            os.chmod(sock, 0o666)  # so that the kernel lets nobody connect and pled's own check decides
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: drop to nobody, attach, report
                try:
                    become(65534)
                    try:
                        client.attach("t", socket=sock, populate=False).close()
                        os.write(w, b"attached")
                    except client.PermissionDenied as err:
                        os.write(w, b"PermissionDenied " + str(err).encode())
                finally:
                    os._exit(0)
            os.close(w)
            os.waitpid(pid, 0)
            with os.fdopen(r) as f:
                said = f.read()
            assert said.startswith(expected), said
            if expected == "PermissionDenied":
                assert "allow_uids" in said
                assert "refused pid" in pled.wait_for("uid 65534") and "WARNING" in pled.log()
            pled.stop()
    finally:
        for name in os.listdir(run):
            os.unlink(os.path.join(run, name))
        os.rmdir(run)


def test_a_client_outlives_the_daemon_and_reattaches(sidecar, daemon):
    d = sidecar("ples_nvfp4", shards=3, rows=4000)
    first = daemon({"ples_nvfp4": d})
    t = client.attach("ples_nvfp4", socket=first.socket)
    expected = t.gather(torch.arange(0, 12000, 7)).clone()
    first.proc.kill()
    first.proc.wait()
    # The mapping stays valid: every byte still reads, gathers give the same rows.
    for s in t.shards:
        with open(s.path, "rb") as f:
            assert t.buffer[s.offset : s.offset + s.size] == f.read()
    assert torch.equal(t.gather(torch.arange(0, 12000, 7)), expected)
    with pytest.raises(client.DaemonUnavailable):
        client.attach("ples_nvfp4", socket=first.socket)
    second = daemon({"ples_nvfp4": d}, socket=first.socket)  # replaces the dead daemon's socket file
    assert "removing stale socket" in second.log()
    with client.attach("ples_nvfp4", socket=second.socket) as again:
        assert torch.equal(again.gather(torch.arange(0, 12000, 7)), expected)
    t.close()


def test_a_live_socket_is_not_taken_over(sidecar, daemon, tmp_path):
    first = daemon({"t": sidecar(shards=1, rows=10)})
    second = daemon({"t": sidecar(shards=1, rows=10)}, socket=first.socket, wait=None)
    assert second.proc.wait(timeout=30) == 78
    assert f"another pled is serving at {first.socket} (pid {first.pid})" in second.log()
    not_a_socket = tmp_path / "file.sock"
    not_a_socket.write_text("")
    third = daemon({"t": sidecar(shards=1, rows=10)}, socket=str(not_a_socket), wait=None)
    assert third.proc.wait(timeout=30) == 78 and "exists and is not a socket" in third.log()
    assert client.call(protocol.PING, socket=first.socket) == {}


def test_not_ready_then_wait(sidecar, daemon):
    d = sidecar("ples_int4", shards=4, rows=80_000)  # 32 MB, staged at 8 MB/s: about 4 s
    pled = daemon({"slow": d}, wait="listening on", staging_bandwidth="8MB/s")
    with pytest.raises(client.NotReady) as err:
        client.attach("slow", socket=pled.socket)
    assert err.value.progress["state"] in ("waiting", "staging") and err.value.progress["shards"] == 4
    st = client.call(protocol.STATUS, socket=pled.socket)
    assert st["tables"][0]["state"] != "ready"
    assert run_pled("status", "--socket", pled.socket).returncode == 1  # not resident yet
    t0 = time.monotonic()
    with client.attach("slow", socket=pled.socket, wait=True, timeout=60) as t:
        assert t.manifest.rows == 320_000
    assert time.monotonic() - t0 > 0.5  # it really waited for the staging to finish
    assert "table slow staged" in pled.log()


def test_status_command(sidecar, daemon, tmp_path):
    pled = daemon({"ples_int4": sidecar(shards=2, rows=1000)})
    with client.attach("ples_int4", socket=pled.socket):
        r = run_pled("status", "--socket", pled.socket)
        assert r.returncode == 0, r.stderr
        assert "ples_int4" in r.stdout and "ready" in r.stdout and "100%" in r.stdout
        assert "1 client(s) attached" in r.stdout
        row = next(line.split() for line in r.stdout.splitlines() if line.startswith("ples_int4 "))
        j = json.loads(run_pled("status", "--json", "--socket", pled.socket).stdout)["tables"][0]
        assert row[-3] == j["page_size"].replace(" ", "") and row[-2] == "1", r.stdout  # PAGES, then GEN
        policy = j["numa"]["policy"]
        assert f"  note: ples_int4: NUMA {policy}: node 0 " in r.stdout, r.stdout
        # Status reports the last residency measure (cachestat walks every page: 35 ms per 4 GiB), not one per call.
        age = lambda: client.call(protocol.STATUS, socket=pled.socket)["tables"][0]["resident_measured_seconds_ago"]  # noqa: E731
        wait_until(lambda: age() >= 0.5, 10, message=lambda: f"measured {age()} s ago at every call")
        by_config = run_pled("status", "-c", pled.config)  # the socket read from the config: the same answer
        assert by_config.returncode == 0 and by_config.stdout.splitlines()[1:] == r.stdout.splitlines()[1:], \
            by_config.stdout + by_config.stderr
        j = json.loads(run_pled("status", "--json", "--socket", pled.socket).stdout)
        assert j["healthy"] and j["tables"][0]["resident_share"] == 1.0 and j["tables"][0]["sealed"]
        assert j["tables"][0]["generation"] == 1 and len(j["tables"][0]["fingerprint"]) == 64
        assert j["clients"][0]["pid"] == os.getpid()
        if j["tables"][0]["huge_page_policy"] in ("never", "deny"):
            assert "4 KiB pages" in r.stdout and "shmem_enabled" in r.stdout
    r = run_pled("status", "--socket", str(tmp_path / "none.sock"))
    assert r.returncode == 3 and "not running" in r.stderr
