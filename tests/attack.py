"""Helpers for the attack tests (tests/test_attack_*.py, tests/test_fd_ownership.py): raw calls, replies left
waiting in pled, and the checks that a daemon still serves afterwards with its fds and RSS back where they were.
The daemons themselves are started with tests/harness.py (low fd limits, setpriv, code patched in)."""
import fcntl
import json
import os
import select
import socket
import struct
import termios
import time
from pathlib import Path

from pled import client
from pled.daemon.memory import hostmem
from pled.shared import protocol

MiB = 1024**2
RSS_BOUND = 24 * MiB  # what pled's RSS may grow by across an attack, once it is over


def rss(pid: int) -> int:
    return hostmem.own_rss(pid=pid)


def limit_lines(log: str) -> int:
    """pled's lines saying it met its connection or fd limit."""
    return log.count("cannot accept") + log.count("refusing clients") + log.count("closing idle connections")


def raw(sock_path: str, payload: bytes, timeout: float = 10):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(sock_path)
        s.sendall(payload)
        buf = b""
        while not buf.endswith(b"\0"):
            chunk = s.recv(65536)
            if not chunk:
                return None
            buf += chunk
        return json.loads(buf[:-1])
    finally:
        s.close()


def settle_fds(pled, want: int, timeout: float = 15) -> int:
    deadline = time.monotonic() + timeout
    now = pled.fds()
    while now > want and time.monotonic() < deadline:
        time.sleep(0.05)
        now = pled.fds()
    return now


def baseline(pled, table: str) -> tuple[int, int]:
    """(fds, rss) after one attach and detach, so lazily made state is counted."""
    assert_serving(pled, table)
    return settle_fds(pled, 0, timeout=0.5), rss(pled.pid)


def assert_serving(pled, table: str, source: Path | None = None, before: tuple[int, int] | None = None) -> None:
    """Status answers, a fresh client attaches and reads the table; fds and RSS are back near ``before``."""
    assert pled.proc.poll() is None, f"pled exited ({pled.proc.returncode}):\n{pled.log()[-3000:]}"
    st = client.call(protocol.STATUS, socket=pled.socket, timeout=20)
    assert any(t["table"] == table and t["state"] == "ready" for t in st["tables"]), st
    with client.attach(table, socket=pled.socket, timeout=20) as t:
        first = t.shards[0]
        data = bytes(t.buffer[first.offset: first.offset + first.size])
        if source is not None:
            assert data == (source / os.path.basename(first.path)).read_bytes()
        else:
            assert len(data) == first.size
    if before is not None:
        fds, mem = before
        assert settle_fds(pled, fds) <= fds, f"pled holds {pled.fds()} fds, {fds} before"
        assert rss(pled.pid) <= mem + RSS_BOUND, f"pled's RSS {rss(pled.pid) / MiB:.0f} MiB, {mem / MiB:.0f} MiB before"


# -- a reply left waiting in pled: the peer's socket is full when it is written ------------------------------

PING = protocol.call(protocol.PING)
PING_REPLY = len(protocol.encode(protocol.reply()))


def unread(s: socket.socket) -> int:
    """Bytes waiting to be read on ``s`` (FIONREAD), once pled has stopped writing to it."""
    import fcntl
    import struct
    import termios

    last, stable_since = -1, time.monotonic()
    while time.monotonic() - stable_since < 0.3:
        now = struct.unpack("i", fcntl.ioctl(s.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        if now != last:
            last, stable_since = now, time.monotonic()
        time.sleep(0.02)
    return last


def ping_capacity(sock_path: str) -> int:
    """How many Ping replies the kernel takes from pled for one peer before a write would block: measured."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sock_path)
        s.setblocking(False)
        try:
            s.send(PING * 3000)
        except BlockingIOError:
            pass
        n = unread(s)
        assert n % PING_REPLY == 0, f"{n} bytes of Ping replies are not whole replies of {PING_REPLY}"
        return n // PING_REPLY
    finally:
        s.close()


def stuck_call(sock_path: str, call: bytes, capacity: int, tries: int = 6) -> socket.socket:
    """A connection whose reply to ``call`` waits in pled, unwritten: ``capacity`` Pings fill what the kernel
    takes for this peer, then ``call``. Returns the connection, its Ping replies unread."""
    for extra in range(tries):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock_path)
        s.sendall(PING * (capacity + extra) + call)
        if unread(s) == (capacity + extra) * PING_REPLY:
            return s
        s.close()
    raise AssertionError(f"no reply stayed in pled after {capacity}..{capacity + tries - 1} Pings")


def closed_by_peer(s: socket.socket) -> bool:
    """pled has closed its end of ``s`` (POLLRDHUP), whatever it left unread there."""
    poller = select.poll()
    poller.register(s, select.POLLRDHUP)
    return bool(poller.poll(0))


def read_all(s: socket.socket, quiet: float = 1.0) -> tuple[bytes, list[int]]:
    """Everything pled sends on ``s`` until it closes it or sends nothing for ``quiet`` seconds: (bytes, fds)."""
    s.settimeout(quiet)
    data, fds = b"", []
    while True:
        try:
            chunk, got, _, _ = socket.recv_fds(s, 1 << 20, 16)
        except (ConnectionResetError, TimeoutError):
            return data, fds
        fds += got
        data += chunk
        if not chunk:
            return data, fds


# -- waiting for what pled has done, never for a quiet moment -------------------------------------------------------

def reply_size(sock_path: str, call: bytes) -> int:
    """The bytes of pled's reply to ``call``, its NUL included (any fds that come with it closed): the same for each
    such call while nothing changes (an Attach of one generation of a table)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(sock_path)
        s.sendall(call)
        data = b""
        while not data.endswith(b"\0"):
            chunk, fds, _, _ = socket.recv_fds(s, 65536, 4)
            for fd in fds:
                os.close(fd)
            assert chunk, f"pled closed the connection after {data!r}"
            data += chunk
        return len(data)
    finally:
        s.close()


def queued(s: socket.socket, nbytes: int, timeout: float = 30) -> int:
    """Until ``nbytes`` of pled's replies wait unread on ``s`` (FIONREAD) or pled has closed its end of it: the
    bytes waiting then. pled answers a connection's calls in order, so these are its answers to the first calls.
    (Its modules are imported at the top: a forked child as another uid may not be able to import them.)"""
    def waiting() -> int:
        return struct.unpack("i", fcntl.ioctl(s.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]

    deadline = time.monotonic() + timeout
    while waiting() < nbytes and not closed_by_peer(s):
        assert time.monotonic() < deadline, f"{waiting()} bytes of replies after {timeout} s, not {nbytes}"
        time.sleep(0.01)
    return waiting()


def pings_past_any_capacity() -> int:
    """Pings enough that pled can neither write all their replies to a peer that reads none nor read past them: the
    kernel takes replies from pled until those unread are charged its send buffer (net.core.wmem_default: pled sets
    no SO_SNDBUF), each at least PING_REPLY bytes; pled reads a connection 64 KiB at a time, and only once it has
    answered every call read before. A call sent after these is never read while the peer reads nothing."""
    wmem = int(Path("/proc/sys/net/core/wmem_default").read_text())
    return wmem // PING_REPLY + 65536 // len(PING) + 16
