import array
import grp
import os
import signal
import socket
import struct
import threading
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pled.generator import make_sidecar

LAYOUTS = ["ples_fp8", "ples_int4", "ples_nvfp4"]
SUMMARY: list[str] = []  # lines a test leaves for the end of the run (figures a closing note quotes), past capture


def pytest_terminal_summary(terminalreporter) -> None:
    for line in SUMMARY:
        terminalreporter.write_line(line)


@pytest.fixture
def sidecar(tmp_path):
    """make(layout, shards, rows) -> the directory of a fresh synthetic sidecar."""

    def make(layout="ples_int4", shards=4, rows=256, **kw) -> Path:
        d = tmp_path / f"{layout}-{shards}x{rows}"
        make_sidecar(str(d), layout, shards=shards, rows=rows, **kw)
        return d

    return make


@pytest.fixture
def open_dir():
    """A directory under /tmp that any uid may traverse (tmp_path's parents are 0700), removed afterwards: for
    sockets and sidecars that a test's non-root client must reach."""
    d = tempfile.mkdtemp(prefix="pled-open-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


def run_pled(*args, env=None, timeout=60, **kw) -> subprocess.CompletedProcess:
    """The real CLI in a real process."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("NOTIFY_SOCKET", None)
    full_env.pop("JOURNAL_STREAM", None)
    return subprocess.run([sys.executable, "-m", "pled", *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout, **kw)


def write_config(path: Path, tables: dict[str, Path | str], **keys) -> Path:
    """A pled.toml for a test; its socket is beside it, never the host's /run/pled."""
    keys.setdefault("socket", str(path.parent / "run" / "pled.sock"))
    lines = [f"{k} = {v!r}" if isinstance(v, (str, list)) else f"{k} = {v}" for k, v in keys.items()]
    for name, p in tables.items():
        lines += ["[[table]]", f'name = "{name}"', f'path = "{p}"']
    path.write_text("\n".join(lines).replace("'", '"') + "\n")
    return path


class Daemon:
    """A real `pled serve` process, its log, and its socket."""

    def __init__(self, config: Path, socket: str):
        self.config, self.socket = config, socket
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM")}
        self.log_path = config.with_suffix(f".{time.monotonic_ns()}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "pled", "serve", "-c", str(config)],
                                     stderr=self._log, stdout=subprocess.DEVNULL, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.log()
            if text in log:
                return log
            if self.proc.poll() is not None:
                raise AssertionError(f"pled exited ({self.proc.returncode}) before logging {text!r}:\n{log}")
            time.sleep(0.02)
        raise AssertionError(f"{text!r} not logged within {timeout} s:\n{self.log()}")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def daemon(tmp_path):
    """start(tables, **config keys) -> a running Daemon that is ready; all are stopped afterwards."""
    started = []

    def start(tables: dict, wait: str | None = "ready:", socket: str | None = None, **keys) -> Daemon:
        sock = socket or str(tmp_path / f"run{len(started)}" / "pled.sock")
        keys.setdefault("headroom_margin", 0)
        cfg = write_config(tmp_path / f"pled{len(started)}.toml", tables, socket=sock, **keys)
        d = Daemon(cfg, sock)
        started.append(d)
        if wait:
            d.wait_for(wait)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture
def pleds():
    """A list to put started daemons in (tests/attack.py's start); each is stopped afterwards."""
    started = []
    yield started
    for p in started:
        p.stop()


def unused_gid(start: int = 4242) -> int:
    """The first gid from ``start`` on that names no group on this host (for a test's own socket group)."""
    taken = {g.gr_gid for g in grp.getgrall()}
    return next(g for g in range(start, start + 100_000) if g not in taken)


def require_fuse() -> None:
    """Skip unless a FUSE file system can be mounted here (root, /dev/fuse, libfuse3 for mfusepy)."""
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as err:
        pytest.skip(f"FUSE bindings unavailable ({err}); .ci/run installs libfuse3")
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root")


class NotifySocket:
    """Collects sd_notify datagrams: (sender pid, fields, fds)."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[int, list[str], list[int]]] = []
        self.errors: list[str] = []  # what the reader thread found wrong; raised by lines()
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        fd_space = socket.CMSG_SPACE(253 * 4)
        cred_space = socket.CMSG_SPACE(struct.calcsize("3i"))
        while not self._stop:
            try:
                data, ancdata, flags, _ = self.sock.recvmsg(65536, fd_space + cred_space)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            if flags & socket.MSG_CTRUNC:  # an assert here would only end this thread
                self.errors.append(f"a notify message's ancillary data was truncated (MSG_CTRUNC): {data[:80]!r}")
            pid, fds = 0, []
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
                    fds += list(a)
                elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", payload[:12])[0]
            self.messages.append((pid, data.decode().split("\n"), fds))

    def lines(self, pid: int | None = None) -> list[str]:
        if self.errors:
            raise AssertionError("; ".join(self.errors))
        return [line for p, fields, _ in self.messages if pid in (None, p) for line in fields]

    def wait_for(self, line: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if line in self.lines():
                return
            time.sleep(0.02)
        raise AssertionError(f"{line!r} never arrived; got {self.lines()}")

    def stored(self) -> list[tuple[str, int]]:
        out = []
        for _, fields, fds in self.messages:
            if "FDSTORE=1" in fields:
                name = next(f[len("FDNAME="):] for f in fields if f.startswith("FDNAME="))
                out.append((name, fds[0]))
        return out

    def close(self):
        self._stop = True
        self._thread.join()
        self.sock.close()
        for _, _, fds in self.messages:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass


@pytest.fixture
def notify_socket(tmp_path):
    n = NotifySocket(tmp_path / "notify.sock")
    yield n
    n.close()


def serve(cfg: Path, env: dict, fds: list[tuple[int, str]] = (), log: Path | None = None) -> subprocess.Popen:
    """pled serve as systemd starts it: LISTEN_PID is its own pid, stored fds at 3, 4, ..."""
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM", "WATCHDOG_USEC")} | env
    redirect = " ".join(f"{3 + i}<&{fd}" for i, (fd, _) in enumerate(fds))
    if fds:
        env |= {"LISTEN_FDS": str(len(fds)), "LISTEN_FDNAMES": ":".join(n for _, n in fds)}
    script = f'{"export LISTEN_PID=$$; " if fds else ""}exec "$0" -m pled serve -c "$1" {redirect}'
    stderr = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(["bash", "-c", script, sys.executable, str(cfg)], env=env, pass_fds=[fd for fd, _ in fds],
                            stderr=stderr)


def stop(proc: subprocess.Popen) -> int:
    proc.terminate()
    return proc.wait(timeout=30)
