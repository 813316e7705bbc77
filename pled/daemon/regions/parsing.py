"""A reload's planning, in a child process of its own, so that parsing what a reload reads never holds the loop.

A reload re-reads the config, every table's headers, its META.json and a checkpoint's index, then plans.
``json.loads`` and ``tomllib`` hold the GIL while they parse: a 32 MiB index (within pled's bound, ~1.8 M entries)
held the loop's Pings 2.6 s when a thread of pled's own process parsed it (issue 44, finding 3). Here the whole
planning pass (planning.plan_reload) runs in a fresh interpreter instead:

- started with fork/exec (``python -c``, no fds but a pipe each way and stderr), its working directory "/", its
  environment pled's without systemd's variables (NOTIFY_SOCKET: only pled talks to systemd);
- bounded by its own resource limits, set before it reads anything: address space ``ADDRESS_SPACE`` (the largest
  input each parser accepts, parsed: see ``ADDRESS_SPACE``), CPU ``CPU_SECONDS``; and by the parent's wall clock,
  ``WALL_SECONDS``, after which it is killed (SIGKILL). PR_SET_PDEATHSIG ends it with pled;
- its result (the ReloadPlan, or the PledError's line and table) and its log records come back pickled over its
  stdout: pled's own objects, made by pled's own code, read by the planning thread (not the loop), through a
  reader whose Python ``read`` the unpickler calls once a 64 KiB frame, so the loop is given the GIL between
  frames. Log records are re-emitted in pled as they were made, in order.

A child that is killed, runs out of its limits or dies of a bug fails the reload with one line naming the limit;
pled keeps serving what it served.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import os
import pickle
import resource
import select
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

from pled.shared.errors import PledError

log = logging.getLogger(__name__)

# The child's address space: its interpreter and pled's planning modules take ~40 MiB; the largest accepted input
# of each kind (a 32 MiB index of 1.8 M entries, the heaviest) parses to ~0.5 GiB of Python objects, with the raw
# bytes and their decoded text beside them (measured: tests/test_liveness.py's worst index peaks under 700 MiB).
ADDRESS_SPACE = 1 << 30
CPU_SECONDS = 60  # per reload: parsing every accepted input of a large config takes a few seconds
WALL_SECONDS = 120  # the parent's bound: a child blocked on a hung file system is killed then
_FRAME = 1 << 16  # pickle's frames (protocol 4+): the reader is called once per frame
_SYSTEMD_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
PR_SET_PDEATHSIG = 1


class PlanningFailed(PledError):
    """The planning child refused the config (its PledError's line), or ended without an answer."""

    def __init__(self, message: str, table: str | None = None, exit_status: int = 1) -> None:
        super().__init__(message)
        self.table = table
        self.exit_status = exit_status


class _Frames:
    """A file for pickle: ``read`` hands out at most a frame at a time, a Python call each (a point where the
    interpreter lets another thread, the loop, take the GIL)."""

    def __init__(self, data: bytes | memoryview) -> None:
        self.data, self.at = memoryview(data), 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n < 0 else self.at + n
        out = bytes(self.data[self.at:end])
        self.at += len(out)
        return out

    def readinto(self, buffer) -> int:
        piece = self.read(len(buffer))
        buffer[:len(piece)] = piece
        return len(piece)

    def readline(self) -> bytes:
        end = bytes(self.data[self.at:self.at + _FRAME]).find(b"\n")
        return self.read(-1 if end < 0 else end + 1)



class _Sink:
    """A file for pickle's writing: ``write`` is called once per frame."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, data) -> int:
        self.chunks.append(bytes(data))
        return len(data)


def _dumps(obj: object) -> bytes:
    """pickle.dumps through a Python file, so that a large object is written a frame at a time."""
    sink = _Sink()
    pickle.Pickler(sink, protocol=5).dump(obj)
    return b"".join(sink.chunks)


_SAID_HERE = False


def _plan_here(err: OSError, source: str, served: dict, proc_root: str, served_pages: dict[str, int] | None,
               served_writable: frozenset[str]):
    """The planning pass in this (the planning) thread, where the child cannot be started: pled's user may not
    execute ``sys.executable`` again (an interpreter under a directory only root may search; the package's
    /usr/lib/pled is not such a one). Said once in the log; the reload itself works as before."""
    global _SAID_HERE
    if not _SAID_HERE:
        _SAID_HERE = True
        log.warning("a reload's planning cannot run in a child process (%s: %s); it runs in pled's planning thread, "
                    "where a large index holds the loop while it is parsed; give pled's user execute access to "
                    "its interpreter's path", err.strerror or err, sys.executable)
    from pled.daemon.regions import planning

    return planning.plan_reload(source, served, proc_root, served_pages, served_writable)


def _loads(data: bytes) -> Any:
    return pickle.Unpickler(_Frames(data)).load()


def _unpickle_plan(data: bytes) -> Any:
    """The child's answer, as pled's objects, without a garbage collection over them in the loop's thread.

    A large plan (a table of 120,000 tensors) is a million objects: unpickling them crosses the cyclic collector's
    thresholds many times, and its collections, run by whichever thread allocates next (often the loop), held the
    loop up to a second (measured: Pings of 979 ms, faulthandler's dumps showing the loop "Garbage-collecting").
    The collector is off while they are built, and they are then frozen (gc.freeze: never traversed again). They
    are acyclic records a table keeps while it is served; reference counting frees them when it is released."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _loads(data)
    finally:
        if enabled:
            gc.enable()
        gc.freeze()


def plan_reload(source: str, served: dict, proc_root: str = "/", served_pages: dict[str, int] | None = None,
                served_writable: frozenset[str] = frozenset()):
    """planning.plan_reload(...) in a child process (see the module's doc); the ReloadPlan, or PledError."""
    import pled

    root = os.path.dirname(os.path.dirname(os.path.abspath(pled.__file__)))
    env = {k: v for k, v in os.environ.items() if k not in _SYSTEMD_ENV}
    env["OPENBLAS_NUM_THREADS"] = "1"
    level = logging.getLogger("pled").getEffectiveLevel()
    request = _dumps((source, served, proc_root, served_pages, served_writable, level))
    code = f"import sys; sys.path.insert(0, {root!r}); from pled.daemon.regions.parsing import child; child()"
    started = time.monotonic()
    try:
        proc = subprocess.Popen([sys.executable, "-c", code, str(os.getpid())], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, cwd="/", env=env, close_fds=True)
    except PermissionError as err:  # pled's user may not execute its own interpreter's path (a private prefix)
        return _plan_here(err, source, served, proc_root, served_pages, served_writable)
    try:
        out = _exchange(proc, request, started + WALL_SECONDS)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()
    if not out:
        raise PlanningFailed(f"planning the reload {_ended(proc.returncode, time.monotonic() - started)}; "
                             "pled serves what it served")
    kind, payload, records = _unpickle_plan(out)
    for record in records:
        logging.getLogger(record.name).handle(record)
    if kind == "ok":
        return payload
    message, table, status = payload
    raise PlanningFailed(message, table, status)


def _exchange(proc: subprocess.Popen, request: bytes, deadline: float) -> bytes:
    """Write ``request`` to the child, read all it writes; b"" when the deadline passes first (it is killed)."""
    assert proc.stdin is not None and proc.stdout is not None
    out_fd, in_fd = proc.stdout.fileno(), proc.stdin.fileno()
    os.set_blocking(in_fd, False)
    pending = memoryview(request)
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            proc.kill()
            return b""
        writers = [in_fd] if pending else []
        readable, writable, _ = select.select([out_fd], writers, [], min(left, 1.0))
        if writable:
            try:
                pending = pending[os.write(in_fd, pending):]
            except BlockingIOError:
                pass
            except BrokenPipeError:  # the child ended without reading it all: its exit status says why
                pending = pending[:0]
            if not pending:
                proc.stdin.close()
        if readable:
            chunk = os.read(out_fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def _ended(status: int | None, seconds: float) -> str:
    if status == -signal.SIGKILL and seconds >= WALL_SECONDS:
        return f"took more than {WALL_SECONDS} s (a file system that does not answer?)"
    if status in (-signal.SIGKILL, -signal.SIGXCPU):
        return (f"was ended by {signal.Signals(-status).name} (its bounds: {CPU_SECONDS} s of CPU, "
                f"{ADDRESS_SPACE >> 20} MiB of address space)")
    return f"ended without an answer (exit status {status})"


# -- the child ---------------------------------------------------------------------------------------------------

class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args = record.getMessage(), None  # as text: the arguments may not pickle
        record.exc_info = record.exc_text = None
        self.records.append(record)


def child() -> None:
    """The planning child's whole life: limits first, then the request, the plan, the answer, exit."""
    parent = int(sys.argv[1])
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # pled ended before the line above
        os._exit(1)
    for limit, value in ((resource.RLIMIT_AS, ADDRESS_SPACE), (resource.RLIMIT_CPU, CPU_SECONDS)):
        soft, hard = resource.getrlimit(limit)
        want = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(limit, (want, want))
        except (OSError, ValueError):  # a seccomp filter refusing setrlimit: the wall bound still holds
            pass
    source, served, proc_root, served_pages, served_writable, level = _loads(sys.stdin.buffer.read())
    handler = _Records()
    root = logging.getLogger()
    root.handlers[:] = [handler]
    logging.getLogger("pled").setLevel(level)
    try:
        from pled.daemon.regions import planning

        answer: tuple = ("ok", planning.plan_reload(source, served, proc_root, served_pages, served_writable))
    except PledError as err:
        answer = ("refused", (str(err), getattr(err, "table", None), err.exit_status))
    except Exception as err:  # a bug: its traceback on stderr (pled's log), the reload failed with its name
        traceback.print_exc()
        answer = ("refused", (f"planning failed unexpectedly: {type(err).__name__}", None, 1))
    try:
        data = _dumps((*answer, handler.records))
    except Exception as err:  # noqa: BLE001  a plan that does not pickle is a bug: said, not hung on
        traceback.print_exc()
        data = _dumps(("refused", (f"planning's answer could not be sent: {type(err).__name__}", None, 1), []))
    out = sys.stdout.buffer
    out.write(data)
    out.flush()
    os._exit(0)
