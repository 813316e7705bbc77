"""The one way the tests and the benchmarks start `pled serve`, and what they share to talk to it.

    from harness import start, write_config          # in tests (pytest puts tests/ on sys.path)
    from tests.harness import start                  # in bench/, run as `python -m bench` from the repository root

``start(directory, tables, **config keys)`` writes a config there (tomli-w) and starts pled on it, ready unless
``wait=None``; ``Daemon(config)`` starts pled on a config already written. Either way the daemon is a real
process with its stderr in a log file, started as a test asks:

    env={"NOTIFY_SOCKET": ...}       added to this environment, from which systemd's own variables are removed
    fds=[(fd, "pled.1.t")]           passed as systemd passes its fd store: at 3, 4, ... with LISTEN_FDS,
                                     LISTEN_FDNAMES and LISTEN_PID (pled's own pid)
    nofile=, fsize=                  RLIMIT_NOFILE (soft and hard) and RLIMIT_FSIZE (soft), set by prlimit
    cgroup=                          a cgroup directory pled joins before it runs a line of Python
    group=, extra_groups=, user=     as subprocess.Popen takes them; prefix=["setpriv", ...] for the rest
    patch="python code"              run in pled's interpreter before pled itself (a fault, a slow disk)

and then: ``wait_for(text)``, ``wait_ready()``, ``log()``, ``pid``, ``fds()``, ``reload()``, ``stop()`` (the exit
status). Tests mark what they need (tests/conftest.py); a test that starts pled without the ``daemon`` marker
fails here, so `make test-fast` never starts one.

Also here: ``run_pled`` (one pled command to its end), ``NotifySocket`` (a notify socket bound as systemd binds
its own), ``JournalSocket`` (journald's native socket, its entries parsed), ``wait_until`` (poll a condition with a
deadline), ``unused_gid``, ``require_fuse``.
"""
from __future__ import annotations

import array
import atexit
import fcntl
import grp
import os
import signal
import socket as socket_mod
import struct
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import tomli_w

LAYOUTS = ["ples_fp8", "ples_int4", "ples_nvfp4"]
SUMMARY: list[str] = []  # lines a test leaves for the end of the run (figures a closing note quotes), past capture
SYSTEMD_ENV = ("NOTIFY_SOCKET", "JOURNAL_STREAM", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_PID", "LISTEN_FDS",
               "LISTEN_FDNAMES", "FDSTORE")

T = TypeVar("T")


# -- markers: what the running test said it needs ---------------------------------------------------------------

current_markers: set[str] | None = None  # the running test's markers (tests/conftest.py); None outside pytest


def require_marker(name: str, what: str) -> None:
    """Fail the running test unless it carries ``@pytest.mark.<name>``: the fast lane selects by marker."""
    if current_markers is not None and name not in current_markers:
        raise AssertionError(f"this test {what}: mark it @pytest.mark.{name} (the markers: pyproject.toml, "
                             "tests/conftest.py)")


# -- polling ----------------------------------------------------------------------------------------------------

def wait_until(condition: Callable[[], T], timeout: float = 30, message: str | Callable[[], str] = "", *,
               interval: float = 0.02) -> T:
    """Poll ``condition()`` until it returns something true (returned) or ``timeout`` s pass (AssertionError,
    with ``message``, or a callable making it then)."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"not within {timeout} s: {text or condition}")
        time.sleep(interval)


def stays_false(condition: Callable[[], object], seconds: float, message: str | Callable[[], str] = "", *,
                interval: float = 0.02) -> None:
    """Watch ``condition()`` for ``seconds``: an AssertionError as soon as it is true (a thing that must not
    happen, such as a busy loop's log lines piling up, checked over a window rather than once after a sleep)."""
    end = time.monotonic() + seconds
    while True:
        if got := condition():
            text = message() if callable(message) else message
            raise AssertionError(f"{text or condition}: {got!r}")
        if time.monotonic() >= end:
            return
        time.sleep(interval)


# -- configs ----------------------------------------------------------------------------------------------------

def _toml(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_toml(v) for v in value]
    if isinstance(value, dict):
        return {k: _toml(v) for k, v in value.items()}
    return value


def write_config(path: Path, tables: Mapping[str, str | Path | Mapping], **keys) -> Path:
    """A pled.toml written with tomli-w: ``keys`` at the top, then one [[table]] per entry of ``tables`` (name -> its
    path, or a dict of the table's keys). Its socket is beside it (``path.parent/run/pled.sock``) unless ``socket`` is
    given, never the host's /run/pled. Any string may appear anywhere (quotes, backslashes, control characters)."""
    path = Path(path)
    keys.setdefault("socket", str(path.parent / "run" / "pled.sock"))
    doc = _toml(keys)
    if tables:
        doc["table"] = [{"name": name} | (_toml(dict(p)) if isinstance(p, Mapping) else {"path": str(p)})
                        for name, p in tables.items()]
    path.write_text(tomli_w.dumps(doc))
    return path


def read_config(path: Path) -> dict:
    return tomllib.loads(Path(path).read_text())


def clean_env(**extra: str) -> dict:
    """This process's environment without what systemd gives a service (a test passes those itself), plus ``extra``."""
    return {k: v for k, v in os.environ.items() if k not in SYSTEMD_ENV} | extra


# -- pled serve -------------------------------------------------------------------------------------------------

_running: list[Daemon] = []


class Daemon:
    """A real `pled serve` on ``config`` (see the top of this file for the options), its log and its socket."""

    def __init__(self, config: Path, socket: str | None = None, *, env: Mapping[str, str] | None = None,
                 fds: Sequence[tuple[int, str]] = (), log: Path | None = None, nofile: int | None = None,
                 fsize: int | None = None, cgroup: Path | None = None, prefix: Sequence[str] = (), patch: str = "",
                 user: int | str | None = None, group: int | str | None = None,
                 extra_groups: Sequence[int] | None = None):
        require_marker("daemon", "starts pled serve")
        self.config = Path(config)
        self.socket = socket if socket is not None else self._socket_of(self.config)
        self.log_path = Path(log) if log else self.config.with_suffix(f".{time.monotonic_ns()}.log")
        if patch:  # the patch first, then pled's own main, in one interpreter
            argv = [sys.executable, "-c", f"{patch}\nimport sys\nfrom pled.cli import main\n"
                    "sys.exit(main(['serve', '-c', sys.argv[1]]))", str(self.config)]
        else:
            argv = [sys.executable, "-m", "pled", "serve", "-c", str(self.config)]
        limits = ([f"--nofile={nofile}:{nofile}"] if nofile is not None else []) + \
                 ([f"--fsize={fsize}:unlimited"] if fsize is not None else [])
        argv = (["prlimit", *limits] if limits else []) + [*prefix, *argv]
        full_env = clean_env(**(env or {}))
        # Each passed fd is first copied above 3 + len(fds), so that placing one at 3, 4, ... overwrites no other.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3 + len(fds)) for fd, _ in fds]
        if fds or cgroup is not None:
            # bash, then exec: pled keeps the shell's pid, so LISTEN_PID=$$ is pled's, and cgroup.procs takes it.
            script = 'cg="$1"; shift; if [ -n "$cg" ]; then echo $$ > "$cg/cgroup.procs" || exit 70; fi; '
            if fds:
                full_env |= {"LISTEN_FDS": str(len(fds)), "LISTEN_FDNAMES": ":".join(name for _, name in fds)}
                script += "export LISTEN_PID=$$; "
            moves = " ".join(f"{3 + i}<&{h} {h}<&-" for i, h in enumerate(high))
            argv = ["bash", "-c", f'{script}exec "$@" {moves}', "bash", str(cgroup or ""), *argv]
        self.started = time.perf_counter()
        try:
            with open(self.log_path, "w") as log_file:
                self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log_file, env=full_env,
                                             pass_fds=high, user=user, group=group, extra_groups=extra_groups)
        finally:
            for h in high:
                os.close(h)
        _running.append(self)

    @staticmethod
    def _socket_of(config: Path) -> str | None:
        try:
            return read_config(config).get("socket", "/run/pled/pled.sock")
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
            return None  # a config pled is meant to refuse

    @property
    def pid(self) -> int:
        """The started process's pid: pled's own, as everything above execs (unless ``prefix`` forks)."""
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 60, count: int = 1) -> str:
        """Until ``text`` is in the log (``count`` times); the log then. An AssertionError, with the log, if pled
        exits first or the time runs out."""
        def seen():
            log = self.log()
            if log.count(text) >= count:
                return log
            if self.proc.poll() is not None and self.log().count(text) < count:
                raise AssertionError(f"pled exited ({self.proc.returncode}) before logging {text!r}:\n{log[-5000:]}")
            return None

        return wait_until(seen, timeout, message=lambda: f"{text!r} not logged:\n{self.log()[-5000:]}")

    def wait_ready(self, timeout: float = 60) -> float:
        """Until pled says it is ready: seconds since it was started."""
        self.wait_for("ready:", timeout)
        return time.perf_counter() - self.started

    def wait_ready_or_exit(self, timeout: float = 60) -> int | None:
        """Until pled is ready (None) or has exited (its status): a refusal shows at once, not as a timeout."""
        wait_until(lambda: self.proc.poll() is not None or "ready:" in self.log(), timeout,
                   message=lambda: f"pled neither ready nor gone:\n{self.log()[-5000:]}")
        return self.proc.poll()

    def reload(self, timeout: float = 60) -> str:
        """SIGHUP, then until pled logs how that reload ended: "reload done" or "reload failed" (returned)."""
        log = self.log()
        before = {word: log.count(word) for word in ("reload done", "reload failed")}
        self.send_signal(signal.SIGHUP)

        def ended():
            log = self.log()
            return next((word for word, n in before.items() if log.count(word) > n), None)

        return wait_until(ended, timeout, message=lambda: f"no reload ended:\n{self.log()[-5000:]}")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = 60) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """``sig`` (SIGTERM), then the exit status; SIGKILL after ``timeout`` s. Again later: the same status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self in _running:
            _running.remove(self)
        return self.proc.returncode


_DAEMON_OPTIONS = ("env", "fds", "log", "nofile", "fsize", "cgroup", "prefix", "patch", "user", "group", "extra_groups")


def start(directory: Path, tables: Mapping[str, str | Path], *, name: str | None = None, wait: str | None = "ready:",
          socket: str | None = None, **options) -> Daemon:
    """Write ``directory/<name>.toml`` (``tables``; the config keys in ``options``, headroom_margin 0 unless given;
    its socket ``directory/run-<name>/pled.sock`` unless ``socket``), start pled on it (the Daemon options in
    ``options``), and wait until it logs ``wait`` (None: do not wait)."""
    directory = Path(directory)
    if name is None:
        name = next(f"pled{i}" for i in range(1000) if not (directory / f"pled{i}.toml").exists())
    process = {k: options.pop(k) for k in list(options) if k in _DAEMON_OPTIONS}
    options.setdefault("headroom_margin", 0)
    sock = socket or str(directory / f"run-{name}" / "pled.sock")
    d = Daemon(write_config(directory / f"{name}.toml", tables, socket=sock, **options), sock, **process)
    if wait:
        d.wait_for(wait)
    return d


@atexit.register
def _stop_all() -> None:
    """Whatever is still running when the interpreter ends (a test or benchmark that failed half-way)."""
    for d in list(_running):
        d.stop(timeout=10)


# -- the pled command -------------------------------------------------------------------------------------------

def run_pled(*args, env: Mapping[str, str] | None = None, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """The real CLI in a real process, to its end (``run_pled("serve", ...)`` for a start that must be refused)."""
    if args and args[0] == "serve":
        require_marker("daemon", "runs pled serve")
    return subprocess.run([sys.executable, "-m", "pled", *map(str, args)], capture_output=True, text=True,
                          env=clean_env(**(env or {})), timeout=timeout, **kw)


# -- the host ---------------------------------------------------------------------------------------------------

HOST_SETTINGS = [  # what a test that starts systemd (as PID 1, or under podman) must leave as it found it
    "/proc/sys/kernel/hostname", "/proc/sys/kernel/domainname", "/proc/sys/kernel/pid_max",
    "/proc/sys/kernel/core_pattern", "/proc/sys/kernel/sysrq", "/proc/sys/kernel/printk", "/proc/sys/kernel/panic",
    "/proc/sys/kernel/ctrl-alt-del", "/proc/sys/fs/nr_open", "/proc/sys/fs/file-max",
    "/proc/sys/fs/inotify/max_user_instances", "/proc/sys/fs/inotify/max_user_watches",
    "/proc/sys/fs/protected_regular", "/proc/sys/fs/protected_symlinks", "/proc/sys/fs/suid_dumpable",
    "/proc/sys/vm/overcommit_memory", "/proc/sys/vm/swappiness", "/proc/sys/vm/max_map_count",
    "/proc/sys/net/core/somaxconn", "/proc/sys/net/ipv4/ip_forward", "/sys/kernel/mm/transparent_hugepage/enabled",
    "/sys/kernel/mm/transparent_hugepage/shmem_enabled", "/etc/passwd", "/etc/group", "/etc/shadow", "/etc/gshadow",
]


def host_settings() -> dict[str, str]:
    """The text of each of HOST_SETTINGS this host has, to compare before and after."""
    out = {}
    for path in HOST_SETTINGS:
        try:
            out[path] = Path(path).read_text()
        except OSError:
            pass
    return out

def unused_gid(start: int = 4242) -> int:
    """The first gid from ``start`` on that names no group on this host (for a test's own socket group)."""
    taken = {g.gr_gid for g in grp.getgrall()}
    return next(g for g in range(start, start + 100_000) if g not in taken)


def require_fuse() -> None:
    """Skip unless a FUSE file system can be mounted here (root, /dev/fuse, libfuse3 for mfusepy)."""
    import pytest

    require_marker("root", "mounts a FUSE file system")
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as err:
        pytest.skip(f"FUSE bindings unavailable ({err}); .ci/run installs libfuse3")
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root")


def mount_fuse(script: str, source, point, *args: str):
    """Start tests/``script`` (a FUSE file system over ``source`` at ``point``, with ``args``) and wait until it is
    mounted; the Popen. Skips (naming what the file system said) where it cannot mount here within 20 s."""
    import pytest

    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / script), str(source), str(point), *args],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not os.path.ismount(point):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.skip("could not mount FUSE here: " + (proc.stderr.read() if proc.poll() is not None else "timeout"))
        time.sleep(0.05)
    return proc


def blocked_calls(flag: Path, at_least: int = 1, timeout: float = 5) -> list[str]:
    """The calls the file system holds, once there are ``at_least`` of them."""
    calls = Path(f"{flag}.calls")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = calls.read_text().splitlines() if calls.exists() else []
        if len(lines) >= at_least:
            return lines
        time.sleep(0.02)
    raise AssertionError(f"no call reached the file system within {timeout} s")


def drop_page_cache(files) -> None:
    """POSIX_FADV_DONTNEED on each file: they leave the page cache, nothing else does."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- systemd's notify socket ------------------------------------------------------------------------------------

class NotifySocket:
    """Collects sd_notify datagrams as systemd's manager does (SO_PASSCRED, SCM_RIGHTS): ``messages`` holds
    (sender pid, fields, fds) in arrival order, ``received`` when each arrived (time.monotonic())."""

    def __init__(self, path: Path | str):
        self.path = str(path)
        self.sock = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setsockopt(socket_mod.SOL_SOCKET, socket_mod.SO_PASSCRED, 1)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[int, list[str], list[int]]] = []
        self.received: list[float] = []
        self.errors: list[str] = []  # what the reader thread found wrong; raised by lines()
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        fd_space = socket_mod.CMSG_SPACE(253 * 4)
        cred_space = socket_mod.CMSG_SPACE(struct.calcsize("3i"))
        while not self._stop:
            try:
                data, ancdata, flags, _ = self.sock.recvmsg(65536, fd_space + cred_space)
            except TimeoutError:
                continue
            except OSError:
                return
            if flags & socket_mod.MSG_CTRUNC:  # an assert here would only end this thread
                self.errors.append(f"a notify message's ancillary data was truncated (MSG_CTRUNC): {data[:80]!r}")
            pid, fds = 0, []
            for level, kind, payload in ancdata:
                if level == socket_mod.SOL_SOCKET and kind == socket_mod.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
                    fds += list(a)
                elif level == socket_mod.SOL_SOCKET and kind == socket_mod.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", payload[:12])[0]
            self.received.append(time.monotonic())
            self.messages.append((pid, data.decode().split("\n"), fds))

    def lines(self, pid: int | None = None) -> list[str]:
        if self.errors:
            raise AssertionError("; ".join(self.errors))
        return [line for p, fields, _ in list(self.messages) if pid in (None, p) for line in fields]

    def wait_for(self, line: str, timeout: float = 60, count: int = 1) -> None:
        """Until ``line`` has arrived (``count`` times)."""
        wait_until(lambda: self.lines().count(line) >= count, timeout,
                   message=lambda: f"{line!r} never arrived; got {self.lines()}")

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


# -- journald's native socket -----------------------------------------------------------------------------------

def parse_journal_entry(data: bytes) -> dict[str, list[str]]:
    """One entry of the journal's native protocol (https://systemd.io/JOURNAL_NATIVE_PROTOCOL/), read as journald
    reads it: ``KEY=value`` lines, and ``KEY``, a newline, a 64-bit little-endian length, that many bytes, a newline.
    Each key's values in order (a field may repeat). An AssertionError for anything else."""
    entry: dict[str, list[str]] = {}
    i = 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            i = nl + 1
        else:
            key = line
            (n,) = struct.unpack("<Q", data[nl + 1:nl + 9])
            value = data[nl + 9:nl + 9 + n]
            assert len(value) == n and data[nl + 9 + n:nl + 10 + n] == b"\n", f"a bad binary field {key!r}: {data!r}"
            i = nl + 10 + n
        assert key and not key.startswith(b"_") and key.strip(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") == b"", \
            f"a bad key {key!r}"
        entry.setdefault(key.decode(), []).append(value.decode())
    return entry


class JournalSocket:
    """Stands in for journald's native socket: a datagram socket bound at ``path`` (pled sends there where
    PLED_JOURNAL_SOCKET names it). A thread reads it (unless ``read=False``: then the queue fills, as with a
    journald that does not keep up, until ``start()``): ``entries`` holds each entry parsed, in arrival order;
    an entry passed as a memfd (SCM_RIGHTS) is read from the fd, and ``sealed`` records its seals."""

    def __init__(self, path: Path | str, read: bool = True):
        self.path = str(path)
        self.sock = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.entries: list[dict[str, list[str]]] = []
        self.sealed: list[int | None] = []  # per entry: F_GET_SEALS of the memfd it came in, None for a datagram
        self.errors: list[str] = []
        self._stop = False
        self._thread: threading.Thread | None = None
        if read:
            self.start()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        while not self._stop:
            try:
                data, ancdata, _, _ = self.sock.recvmsg(1 << 20, socket_mod.CMSG_SPACE(4))
            except TimeoutError:
                continue
            except OSError:
                return
            seals = None
            try:
                for level, kind, payload in ancdata:
                    if level == socket_mod.SOL_SOCKET and kind == socket_mod.SCM_RIGHTS:
                        (fd,) = struct.unpack("i", payload[:4])
                        try:
                            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                            data = os.pread(fd, os.fstat(fd).st_size, 0)
                        finally:
                            os.close(fd)
                self.entries.append(parse_journal_entry(data))
                self.sealed.append(seals)
            except Exception as err:  # an assert here would only end this thread
                self.errors.append(f"{type(err).__name__}: {err}: {data[:200]!r}")

    def with_id(self, message_id: str) -> list[dict[str, list[str]]]:
        if self.errors:
            raise AssertionError("; ".join(self.errors))
        return [e for e in list(self.entries) if e.get("MESSAGE_ID") == [message_id]]

    def wait_for(self, message_id: str, timeout: float = 60, count: int = 1) -> dict[str, list[str]]:
        """Until ``count`` entries with that MESSAGE_ID have arrived: the last of them."""
        return wait_until(lambda: self.with_id(message_id)[count - 1:], timeout,
                          message=lambda: f"no entry {message_id} (x{count}) among "
                                          f"{[e.get('MESSAGE') for e in self.entries]}")[0]

    def close(self):
        self._stop = True
        if self._thread is not None:
            self._thread.join()
        self.sock.close()
