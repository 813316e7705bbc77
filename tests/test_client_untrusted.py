"""The client library does not trust the server.

The fake server here is the attacker, honestly so: a real Unix socket served from a thread, answering an Attach
with real fds (memfds made with os.memfd_create and sealed, or a regular file on disk) whose bytes are built by
hand to be wrong in exactly one way each: a valid prefix with a correct sha256 over a manifest that nests too deep,
names an unknown key, places a tensor outside the region... Each case must end in a ``ClientError`` (so that the
vLLM plugin's ``fallback = "disk"`` falls back instead of crashing the load) whose message says what was wrong,
with every fd that arrived closed: /proc/self/fd counts the same before and after. A reply dripped one byte a
second must not hold ``attach(timeout=2)`` longer than about two seconds.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import resource
import signal
import socket
import sys
import threading
import time
from dataclasses import replace

import pytest

from fakeserver import FakeServer
from pled.client import connection, held_files, tensor_views
from pled.client.connection import ClientError, DaemonUnavailable, ProtocolError
from pled.client.library import attach
from pled.shared import protocol, region
from pled.shared.region import _PREFIX, ALIGN, MAGIC, Manifest, ShardEntry, TensorEntry

FINGERPRINT = "f" * 64


def _fds() -> dict[str, str]:
    """This process's open fds and what each is (the listing's own fd among them, as it is both times)."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd, closed by now
            fds[fd] = "?"
    return fds


@pytest.fixture
def no_fd_leak():
    """Asserts, after the test and its fake server are done, that this process has as many fds open as before."""
    before = _fds()

    def added() -> dict[str, str]:  # fds open now that were not before (by number and what they are)
        return {fd: what for fd, what in _fds().items() if before.get(fd) != what and what != "?"}

    yield
    deadline = time.monotonic() + 5  # the fake server's thread closes its own copies as it ends
    while added() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not added(), added()  # one closed meanwhile by something else (a collected object) is no leak


def attach_reply(**over) -> bytes:
    params = {"table": "t", "generation": 1, "fingerprint": FINGERPRINT, "region_bytes": 2 * ALIGN, **over}
    return json.dumps({"parameters": params}).encode()


def manifest() -> Manifest:
    """A well-formed generic table: one shard of 64 bytes at 2 MiB, one tensor, U8[64], filling it."""
    shard = ShardEntry(0, "/srv/t/shard_0.safetensors", 64, 1, 2, 3, "a" * 64, ALIGN, 0, "")
    return Manifest("t", "safetensors", 0, 0, ALIGN, 2 * ALIGN, FINGERPRINT, (shard,),
                    (TensorEntry("w", 0, "U8", (64,), ALIGN, 64),))


def doc() -> dict:
    return json.loads(manifest().to_json())


def header(raw: bytes, data_offset: int = ALIGN, length: int | None = None) -> bytes:
    """A correct prefix (magic, version, sha256 of ``raw``) before ``raw``: only the manifest itself is wrong."""
    return _PREFIX.pack(MAGIC, region.FORMAT_VERSION, 0, data_offset, len(raw) if length is None else length,
                        hashlib.sha256(raw).digest()) + raw


def memfd(content: bytes, size: int = 2 * ALIGN, seal: bool = True) -> int:
    fd = os.memfd_create("fake-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, content, 0)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, region.SEALS)
    return fd


def serve_and_attach(tmp_path, fd: int, reply: bytes | None = None):
    """Serve ``fd`` for table "t" and attach to it; the fake server is done (its fds closed) when this returns."""
    server = FakeServer(str(tmp_path / "pled.sock"), reply or attach_reply(), [fd])
    try:
        return attach("t", socket=server.path, timeout=10, populate=False)
    finally:
        server.join()


def refused(tmp_path, fd: int, kind: str = "BadRegion", match: str = "", reply: bytes | None = None) -> str:
    """Attach to ``fd`` served by the fake server: a ClientError of class ``kind`` whose message matches."""
    with pytest.raises(ClientError, match=match) as caught:
        t = serve_and_attach(tmp_path, fd, reply)
        t.close()  # attached: the test fails, and its own fd is not the leak reported
    assert isinstance(caught.value, getattr(connection, kind)), repr(caught.value)
    return str(caught.value)


def manifest_fd(d: dict) -> int:
    return memfd(header(json.dumps(d).encode()))


# -- the control: a well-formed region from the same fake server is attached ----------------------------------

def test_a_well_formed_region_from_the_fake_server_is_attached(tmp_path, no_fd_leak):
    t = serve_and_attach(tmp_path, memfd(region.encode_header(manifest())))
    try:
        assert t.manifest == manifest() and t.generation == 1
    finally:
        t.close()


# -- the fd --------------------------------------------------------------------------------------------------

def test_a_regular_file_instead_of_a_memfd_is_refused(tmp_path, no_fd_leak):
    path = tmp_path / "region"
    path.write_bytes(region.encode_header(manifest()))  # a valid region's bytes: only the kind of file is wrong
    os.truncate(path, 2 * ALIGN)
    refused(tmp_path, os.open(path, os.O_RDONLY | os.O_CLOEXEC), match="not a memfd.*cannot be sealed")


def test_an_unsealed_memfd_is_refused(tmp_path, no_fd_leak):
    refused(tmp_path, memfd(region.encode_header(manifest()), seal=False), match="not sealed")


def test_a_memfd_sealed_against_writes_only_is_refused(tmp_path, no_fd_leak):
    fd = memfd(region.encode_header(manifest()), seal=False)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # it may still shrink under a mapping: SIGBUS
    refused(tmp_path, fd, match="not sealed")


# -- the header ----------------------------------------------------------------------------------------------

def test_garbage_bytes_are_refused(tmp_path, no_fd_leak):
    refused(tmp_path, memfd(os.urandom(4096)), match="not a pled region")


def test_a_header_claiming_more_than_the_memfd_is_refused(tmp_path, no_fd_leak):
    raw = manifest().to_json()
    refused(tmp_path, memfd(header(raw, data_offset=1 << 40, length=(1 << 40) - 64)), match="claims")


# -- the manifest --------------------------------------------------------------------------------------------

def test_a_manifest_nested_100000_deep_is_refused(tmp_path, no_fd_leak):
    raw = b'{"table":' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # its sha256 in the prefix is right
    refused(tmp_path, memfd(header(raw)), match="nests more than 4 levels deep")


def test_an_unknown_manifest_key_is_refused(tmp_path, no_fd_leak):
    d = doc()
    d["evil"] = 1
    refused(tmp_path, manifest_fd(d), match="unknown key 'evil'")


def test_an_unknown_shard_key_is_refused(tmp_path, no_fd_leak):
    d = doc()
    d["shards"][0]["evil"] = 1
    refused(tmp_path, manifest_fd(d), match="unknown key 'evil' in shard 0")


def test_shards_that_are_not_a_list_are_refused(tmp_path, no_fd_leak):
    d = doc()
    d["shards"] = d["shards"][0]
    refused(tmp_path, manifest_fd(d), match="shards as .* not a list")


def test_an_offset_that_is_not_an_integer_is_refused(tmp_path, no_fd_leak):
    d = doc()
    d["tensors"][0]["offset"] = str(ALIGN)
    refused(tmp_path, manifest_fd(d), match="offset as .* in tensor 0, not an integer")


def test_a_tensor_beyond_the_region_is_refused(tmp_path, no_fd_leak):
    m = manifest()
    m = replace(m, tensors=(replace(m.tensors[0], offset=m.region_bytes - 8),))
    refused(tmp_path, memfd(region.encode_header(m)), match="places tensor 'w' at bytes .* outside its shard")


def test_a_shard_beyond_the_region_is_refused(tmp_path, no_fd_leak):
    m = manifest()
    m = replace(m, shards=(replace(m.shards[0], size=2 * ALIGN),))
    refused(tmp_path, memfd(region.encode_header(m)), match="places shard 0 .* outside bytes")


def test_a_tensor_whose_size_is_not_its_shapes_is_refused(tmp_path, no_fd_leak):
    m = manifest()
    m = replace(m, tensors=(replace(m.tensors[0], shape=(1 << 40,)),))
    refused(tmp_path, memfd(region.encode_header(m)), match="64 bytes .512 bits., but U8.* is 8796093022208 bits")


def test_an_unknown_dtype_is_refused(tmp_path, no_fd_leak):
    m = manifest()
    m = replace(m, tensors=(replace(m.tensors[0], dtype="Q7"),))
    refused(tmp_path, memfd(region.encode_header(m)), match="unknown dtype 'Q7'")


def test_the_dtypes_a_region_may_hold_are_those_pled_stages():
    from pled.daemon.sources.safetensors_file import DTYPE_BITS

    assert DTYPE_BITS is region.DTYPE_BITS  # one table, for the daemon's reader and the client's check
    assert set(tensor_views._TORCH_DTYPES) <= set(region.DTYPE_BITS)


@pytest.mark.parametrize("status", [{"tables": 5}, {"tables": [{"table": 1}]}, {"tables": ["t"]}, []])
def test_the_plugins_list_of_tables_comes_from_a_checked_status_reply(status):
    with pytest.raises(ProtocolError, match="no list of tables"):
        held_files._served_tables(status, "/run/pled/pled.sock")
    assert held_files._served_tables({"tables": [{"table": "a"}, {"table": "b"}]}, "s") == ["a", "b"]


# -- the reply -----------------------------------------------------------------------------------------------

def test_a_reply_nested_100000_deep_is_refused(tmp_path, no_fd_leak):
    reply = b'{"parameters":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    refused(tmp_path, memfd(region.encode_header(manifest())), "ProtocolError", "nests more than 16 levels deep", reply)


def test_a_generation_that_is_not_a_count_is_refused(tmp_path, no_fd_leak):
    reply = attach_reply(generation="one")
    refused(tmp_path, memfd(region.encode_header(manifest())), "ProtocolError", "generation 'one'", reply)


def test_an_error_whose_parameters_are_not_an_object_is_refused(tmp_path, no_fd_leak):
    reply = json.dumps({"error": "io.pled.NoSuchTable", "parameters": [1, 2]}).encode()
    refused(tmp_path, memfd(region.encode_header(manifest())), "ProtocolError", "parameters", reply)


def test_a_reply_dripped_a_byte_a_second_ends_within_the_timeout(tmp_path, no_fd_leak):
    server = FakeServer(str(tmp_path / "pled.sock"), attach_reply(), [memfd(region.encode_header(manifest()))],
                        drip=True)
    outcome: list = []

    def client() -> None:
        try:
            outcome.append(attach("t", socket=server.path, timeout=2, populate=False))
        except BaseException as err:  # noqa: BLE001 - the outcome is what is checked
            outcome.append(err)

    start = time.monotonic()
    worker = threading.Thread(target=client, daemon=True)
    worker.start()
    worker.join(6)
    took = time.monotonic() - start
    server.join()  # stops the drip: a client still waiting then sees the connection close
    worker.join(10)
    assert took < 3.5, f"attach(timeout=2) was still waiting after {took:.1f} s (the timeout was per receive)"
    assert isinstance(outcome[0], DaemonUnavailable) and "did not answer io.pled.Attach within 2 s" in str(outcome[0])


def attach_in_child(path: str, timeout: float, limit: float) -> tuple[float, float, str]:
    """attach("t", timeout=...) in a forked child: (seconds it took, user CPU seconds it spent, "<ErrorClass>:
    message" or "attached"); a child still running after ``limit`` seconds is killed ("still running"). A child, not
    a thread: a parse that holds the GIL would hold this test's clock too. The user CPU time (wait4's rusage) is what
    the bounds below are stated in: on a busy machine a child that gave up at its deadline may wait its turn for a
    core long after it, but it spends no more CPU than the deadline let it, and one that ignored the deadline spends
    the whole check however idle the machine is. User time, not system time: the parse runs in user space; what the
    kernel spends for the child is mostly faulting in the buffers a 64 MiB manifest is read and checked in (66,000
    minor faults, 0.15 s idle), which on a host short of memory includes reclaiming other processes' pages (the
    child's CPU passed 1.5 s so, with several test runs beside it)."""
    r, w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            try:
                attach("t", socket=path, timeout=timeout, populate=False).close()
                said = "attached"
            except BaseException as err:  # noqa: BLE001 - what it raised is the outcome
                said = f"{type(err).__name__}: {err}"
            os.write(w, said.encode()[:4000])
        finally:
            os._exit(0)
    os.close(w)
    while (ended := os.wait4(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() - start > limit:
            os.kill(pid, signal.SIGKILL)
            _, _, usage = os.wait4(pid, 0)
            os.close(r)
            return time.monotonic() - start, usage.ru_utime, "still running"
        time.sleep(0.01)
    took, usage = time.monotonic() - start, ended[2]
    with os.fdopen(r) as f:
        return took, usage.ru_utime, f.read()


ESCAPED_QUOTES = b'\\"'  # the text that froze pled and its clients (boundary.depth's regex)


@pytest.mark.parametrize("what", ["reply", "manifest", "reply of lists", "manifest of lists"])
def test_a_reply_or_manifest_of_escaped_quotes_ends_attach_within_its_timeout(tmp_path, what):
    """Finding 3: attach(timeout=1.0) was still running after 12 s on a 256 KiB reply of escaped quotes, and on a
    sealed memfd whose 1 MiB manifest is made of them. Each is refused now, well within the timeout; so are the
    largest reply and manifest made of empty lists (json.loads builds them without a hook that could look at the
    clock: the count of values bounds them, 22 million in 64 MiB). Within the timeout in user CPU time
    (attach_in_child): the largest manifest of lists is refused in 0.33 s of it, where json.loads would take seconds
    to build its lists."""
    lists = b'{"table":[' + b"[]," * ((region.MAX_MANIFEST - 20) // 3) + b"[]]}"
    reply, raw = {"reply": (ESCAPED_QUOTES * (128 * 1024), manifest().to_json()),
                  "manifest": (attach_reply(), ESCAPED_QUOTES * (512 * 1024)),
                  "reply of lists": (lists[:8 * 1024 * 1024 - 2] + b"]}", manifest().to_json()),
                  "manifest of lists": (attach_reply(), lists)}[what]
    data_offset = region.align(_PREFIX.size + len(raw))
    server = FakeServer(str(tmp_path / "pled.sock"), reply, [memfd(header(raw, data_offset), data_offset + ALIGN)])
    took, cpu, said = attach_in_child(server.path, 1.0, limit=5.0)
    server.join()
    assert cpu < 1.5 and said != "still running", f"attach(timeout=1) took {took:.1f} s, {cpu:.1f} s of user CPU: " \
                                                  f"{said[:300]}"
    kind = "ProtocolError" if what.startswith("reply") else "BadRegion"
    assert said.startswith(kind) and ("values" if "lists" in what else "not JSON") in said, said[:300]


@pytest.mark.slow
def test_a_manifest_too_long_to_check_within_the_timeout_ends_attach_at_the_timeout(tmp_path):
    """A server whose region's manifest (13 MiB: 180,000 tensors, within the count of values a manifest may hold)
    takes longer to parse and check than the timeout: attach(timeout=0.5) gives up at its timeout
    (DaemonUnavailable), not seconds later: it spends at most the timeout's CPU (attach_in_child), where the check
    alone, without a deadline and measured the same way, spends more than twice that."""
    n = 180_000
    data_offset = 16 * ALIGN  # past the header and its 13 MiB manifest, as a region's data must be
    shard = ShardEntry(0, "/s", 0, 1, 2, 3, "a" * 64, data_offset, 0, "")
    tensors = tuple(TensorEntry(f"t{i}", 0, "U8", (0,), data_offset, 0) for i in range(n))
    raw = replace(manifest(), data_offset=data_offset, region_bytes=data_offset + ALIGN, shards=(shard,),
                  tensors=tensors).to_json()
    assert _PREFIX.size + len(raw) <= data_offset
    start = time.thread_time()
    Manifest.from_json(raw)  # what the same check costs without a deadline: more than the timeout
    unbounded = time.thread_time() - start
    server = FakeServer(str(tmp_path / "pled.sock"), attach_reply(),
                        [memfd(header(raw, data_offset), data_offset + ALIGN)])
    took, cpu, said = attach_in_child(server.path, 0.5, limit=3 * unbounded + 10)
    server.join()
    assert unbounded > 1.0, f"the manifest took only {unbounded:.2f} s of CPU to check: no test of the timeout"
    assert cpu < 0.75 and said.startswith("DaemonUnavailable") and "did not end in time" in said, (took, cpu, said)


def test_a_manifest_with_negative_dimensions_is_refused(tmp_path, no_fd_leak):
    """Finding 7: [-4, -4] has the product 16 of a U8[16]: the shape's extents are checked before its size."""
    m = manifest()
    m = replace(m, tensors=(replace(m.tensors[0], shape=(-8, -8)),))
    refused(tmp_path, memfd(region.encode_header(m)), match="shape that has a negative extent")


ZERO_SIZED = {"table": "t", "state": "ready", "resident_share": 1.0, "huge_page_bytes": 0, "region_bytes": 0,
              "shards_done": 1, "shards": 1, "bytes": 0, "generation": 1, "fingerprint": "f" * 12}
STATUS_HEAD = {"version": "x", "pid": 1, "uptime_seconds": 1, "socket": "s", "clients": []}


@pytest.mark.parametrize("fmt", ["text", "json", "prometheus"])
@pytest.mark.parametrize("status", [{"tables": 5}, {"tables": [{"table": "t"}]}, {"tables": [], "uptime_seconds": []},
                                    {**STATUS_HEAD, "tables": [ZERO_SIZED]}])
def test_pled_status_says_in_one_line_that_a_status_reply_is_not_pleds(tmp_path, fmt, status):
    """The status renderers (text, Prometheus) against a server whose Status reply is JSON of another shape: one
    line naming the socket, exit 1, no traceback."""
    from harness import run_pled

    server = FakeServer(str(tmp_path / "pled.sock"), json.dumps({"parameters": status}).encode())
    r = run_pled("status", "--socket", server.path, "--format", fmt, timeout=60)
    server.join()
    assert "Traceback" not in r.stderr, r.stderr
    if r.returncode != 0:  # json prints any object it was given
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert server.path in r.stderr and "not one this pled can read" in r.stderr, r.stderr


@pytest.mark.parametrize("command, reply", [("reload", {"changed": 5}), ("verify", {"tables": [5]})])
def test_pled_reload_and_verify_say_in_one_line_that_a_reply_is_not_pleds(tmp_path, command, reply):
    """A second attack's finding: `pled reload` on a Reload reply of another shape, `pled verify` on such a Status,
    ended in a traceback (TypeError)."""
    from harness import run_pled

    server = FakeServer(str(tmp_path / "pled.sock"), json.dumps({"parameters": reply}).encode())
    r = run_pled(command, "--socket", server.path, timeout=60)
    server.join()
    assert "Traceback" not in r.stderr and r.returncode == 1, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and server.path in r.stderr, r.stderr


def test_a_reply_with_more_fds_than_a_reply_carries_is_refused_and_they_are_closed(tmp_path, no_fd_leak):
    """A second attack's finding: a server that sends 4 fds with each of a hundred bytes of its reply: the client
    kept them all (20,000 of them at one test's peak) and then answered as if nothing were wrong. It refuses the
    reply at the second fd and closes every one it received."""
    path = str(tmp_path / "pled.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    pipes = [os.pipe() for _ in range(2)]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            try:
                for _ in range(100):
                    socket.send_fds(conn, [b" "], [fd for pair in pipes for fd in pair])
                conn.sendall(json.dumps({"parameters": {}}).encode() + b"\0")
            except OSError:  # the client gave up on the reply: it is entitled to
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with pytest.raises(ProtocolError, match="sent [0-9]+ file descriptors with one reply; a reply carries at most 1"):
        connection.call(protocol.PING, socket=path, timeout=10)
    thread.join(10)
    listener.close()
    for pair in pipes:
        for fd in pair:
            os.close(fd)


def test_a_client_at_its_open_file_limit_is_told_the_fd_was_cut_short_and_keeps_none(tmp_path):
    """A process with every fd its limit allows in use but one (the connection's) attaches: the kernel cannot give it
    the region's fd, closes it and says so (MSG_CTRUNC). The client refuses the reply with a ClientError that says
    so and names the open-file limit, not "pled sent 0 file descriptors": and afterwards this process has exactly
    the one fd free it had before, none kept. (A forked child, before the fake server's thread starts: its limit is
    its own.)"""
    path = str(tmp_path / "pled.sock")
    go_r, go_w = os.pipe()
    said_r, said_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(go_w)
            os.close(said_r)
            os.read(go_r, 1)  # the fake server listens
            top = max(map(int, os.listdir("/proc/self/fd")))
            resource.setrlimit(resource.RLIMIT_NOFILE, (top + 8, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            filler = []
            try:
                while True:
                    filler.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as err:
                assert err.errno == errno.EMFILE, err
            os.close(filler.pop())  # one fd free: the connection's
            try:
                attach("t", socket=path, timeout=10, populate=False).close()
                said = "attached"
            except ClientError as err:
                said = f"{type(err).__name__}: {err}"
            free = 0
            try:
                while free < 2:
                    filler.append(os.open(os.devnull, os.O_RDONLY))
                    free += 1
            except OSError:
                pass
            os.write(said_w, f"{free} {top + 8} {said}".encode())
        finally:
            os._exit(0)
    os.close(go_r)
    os.close(said_w)
    server = FakeServer(path, attach_reply(), [memfd(region.encode_header(manifest()))])
    os.write(go_w, b"x")
    os.close(go_w)
    with os.fdopen(said_r) as f:
        said = f.read()
    os.waitpid(pid, 0)
    server.join()
    free, limit, said = said.split(" ", 2)
    assert said.startswith("ProtocolError: the kernel cut short the file descriptors pled at"), said
    assert "(MSG_CTRUNC)" in said and f"open-file limit ({limit}; raise it" in said, said  # its own soft limit
    assert free == "1", f"{free} fds free after the refusal, 1 before"


def attach_sent_five_fds(tmp_path, match: str) -> None:
    """attach() against a server that sends 5 fds (a region and two pipes' ends) with the first byte of its Attach
    reply: refused with a ProtocolError matching ``match``."""
    fds = [memfd(region.encode_header(manifest())), *(fd for pair in [os.pipe() for _ in range(2)] for fd in pair)]
    server = FakeServer(str(tmp_path / "pled.sock"), attach_reply(), fds)
    try:
        with pytest.raises(ProtocolError, match=match):
            attach("t", socket=server.path, timeout=10, populate=False).close()
    finally:
        server.join()


def test_a_reply_with_more_fds_than_the_client_takes_at_once_is_refused_as_cut_short(tmp_path, no_fd_leak):
    """A server that sends 5 fds with the first byte of an Attach reply, more than the client's ancillary buffer
    holds: the kernel gives it 4, closes the fifth and says so (MSG_CTRUNC). The client refuses the reply, says the
    fds were cut short, and closes the 4 it got."""
    attach_sent_five_fds(tmp_path, r"cut short the file descriptors .* \(MSG_CTRUNC\)")


def test_a_client_without_the_resource_module_still_says_the_fds_were_cut_short(tmp_path, no_fd_leak, monkeypatch):
    """A client whose interpreter cannot import ``resource`` (a minimal container's, or one that dropped its
    privileges and can no longer read the standard library's extensions: tests/test_containers.py) is still told
    the fds were cut short, its limit "unknown": never an ImportError in place of the refusal."""
    monkeypatch.setitem(sys.modules, "resource", None)  # the import system's own "cannot import" marker
    attach_sent_five_fds(tmp_path, r"\(MSG_CTRUNC\) .* open-file limit \(unknown; raise it")


def test_an_attach_reply_with_a_second_fd_is_refused_and_both_are_closed(tmp_path, no_fd_leak):
    """An Attach reply whose one message carries the region and another fd (a pipe, any fd of the server's): the
    client refuses it (a reply carries one fd at most) and closes both; taking the first and leaving the other
    would hand this process an fd nobody owns, each attach."""
    r, w = os.pipe()
    server = FakeServer(str(tmp_path / "pled.sock"), attach_reply(), [memfd(region.encode_header(manifest())), r])
    try:
        with pytest.raises(ProtocolError, match="sent 2 file descriptors with one reply; a reply carries at most 1"):
            attach("t", socket=server.path, timeout=10, populate=False).close()
    finally:
        server.join()
        os.close(w)


@pytest.mark.slow
def test_an_arrays_manifest_of_half_a_million_sources_ends_attach_within_its_timeout(tmp_path):
    """A second attack's finding: one array of 480,000 sources (and no tensors) made attach(timeout=0.2) take
    0.96 s: the sources were all built before the first check, and the first look at the clock. The columns are
    checked as they are read now (here the first source names no tensor), the deadline looked at as they go."""
    n = 480_000
    start = 16 * ALIGN  # past the manifest (about 9 MiB)
    doc = json.loads(manifest().to_json())
    doc |= {"layout": "ple-arrays", "rows": 0, "row_width": 0, "tensors": [], "region_bytes": start + ALIGN,
            "shards": [{"index": 0, "path": "/s", "size": 1 << 30, "mtime_ns": 1, "dev": 2, "ino": 3,
                        "fingerprint": "a" * 64, "offset": 0, "rows": 0}],
            "arrays": [{"prefix": "p", "param": "weight", "dtype": "U8", "shape": [n, 1], "offset": start,
                        "nbytes": n, "parts": n, "tensors": list(range(n)), "begins": [8] * n,
                        "starts": list(range(n)), "digests": [""] * n}]}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    data_offset = region.align(_PREFIX.size + len(raw))
    doc["data_offset"] = data_offset
    raw = json.dumps(doc, separators=(",", ":")).encode()
    with pytest.raises(ValueError, match="a source tensor 0 that is not one of the manifest's tensors"):
        Manifest.from_json(raw)
    server = FakeServer(str(tmp_path / "pled.sock"), attach_reply(), [memfd(header(raw, data_offset), start + ALIGN)])
    took, cpu, said = attach_in_child(server.path, 0.5, limit=10)
    server.join()
    assert cpu < 0.75, f"attach(timeout=0.5) took {took:.2f} s, {cpu:.2f} s of user CPU: {said[:200]}"
    assert said.startswith(("BadRegion", "DaemonUnavailable")), said[:300]


# -- the vLLM plugin's fallback ------------------------------------------------------------------------------

def test_the_plugins_disk_fallback_sees_a_bad_region_as_a_client_error(tmp_path, monkeypatch, caplog, no_fd_leak):
    """With fallback = "disk" a bad region is a warning and the files are read from disk; it was a crash."""
    d = doc()
    d["shards"] = "all of them"
    server = FakeServer(str(tmp_path / "pled.sock"), attach_reply(), [manifest_fd(d)])
    monkeypatch.setenv("PLED_SOCKET", server.path)
    monkeypatch.setenv("PLED_TABLES", "t")
    monkeypatch.setenv("PLED_FALLBACK", "disk")
    monkeypatch.setattr(held_files, "_state", None)
    monkeypatch.setattr(held_files.atexit, "register", lambda *a: None)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.pled"):
            st = held_files.state()
    finally:
        server.join()
    assert st is not None and not st.tables and not st.files
    assert "cannot attach" in caplog.text and "shards as" in caplog.text and "reading from disk" in caplog.text


def test_a_bad_region_is_a_client_error():
    assert issubclass(connection.BadRegion, ProtocolError) and issubclass(connection.BadRegion, ClientError)
