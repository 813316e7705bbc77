"""Helpers for the attack tests (tests/test_attack_*.py): a daemon started the way an attack needs (low fd
limits, no CAP_SYS_RESOURCE, code patched in), and the checks that it still serves afterwards."""
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path


from conftest import Daemon, write_config
from pled import client
from pled.daemon import hostmem
from pled.shared import protocol

MiB = 1024**2
RSS_BOUND = 24 * MiB  # what pled's RSS may grow by across an attack, once it is over


class Attacked(Daemon):
    """`pled serve` with an optional prefix command (setpriv), an fd limit, and a Python snippet run first."""

    def __init__(self, config: Path, socket_path: str, *, nofile: int | None = None, prefix=(), patch: str = ""):
        self.config, self.socket = config, socket_path
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM")}
        self.log_path = config.with_suffix(f".{time.monotonic_ns()}.log")
        self._log = open(self.log_path, "w")
        code = f"{patch}\nimport sys\nfrom pled.cli import main\nsys.exit(main(['serve', '-c', {str(config)!r}]))"

        def limit():
            if nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen([*prefix, sys.executable, "-c", code], stderr=self._log, stdout=subprocess.DEVNULL,
                                     env=env, preexec_fn=limit)


def start(tmp_path, tables: dict, name: str = "pled", wait: str = "ready:", **kw) -> Attacked:
    config_keys = {k: kw.pop(k) for k in list(kw) if k not in ("nofile", "prefix", "patch")}
    config_keys.setdefault("headroom_margin", 0)
    sock = config_keys.pop("socket", None) or str(tmp_path / f"run-{name}" / "pled.sock")
    cfg = write_config(tmp_path / f"{name}.toml", tables, socket=sock, **config_keys)
    d = Attacked(cfg, sock, **kw)
    if wait:
        d.wait_for(wait)
    return d


def rss(pid: int) -> int:
    return hostmem.own_rss(pid=pid)


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


# -- a reply left waiting in pled: the peer's socket is full when it is written (issue 19, finding 1) --------

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
