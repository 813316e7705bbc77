"""Writing to systemd's journal through its native protocol, with fields that can be searched.

Under journald (logs.py decides: JOURNAL_STREAM names pled's stderr, and the journal's socket is there) every log
record is one datagram to /run/systemd/journal/socket (https://systemd.io/JOURNAL_NATIVE_PROTOCOL/): MESSAGE
(escaped as every log line is: pled.shared.boundary.printable), PRIORITY, SYSLOG_IDENTIFIER=pled, CODE_FILE,
CODE_LINE, CODE_FUNC, and what a call site passes with ``extra=journal.fields(...)``: MESSAGE_ID, one fixed id per
kind of event (MESSAGE_IDS; units/pled.catalog explains each for ``journalctl -x``), PLED_TABLE (one per table the
entry is about), PLED_GENERATION, PLED_CLIENT_PID and PLED_CLIENT_UID. So ``journalctl -u pled PLED_TABLE=x`` and
``journalctl MESSAGE_ID=<id>`` work.

The format: each field is ``KEY=value`` and a newline; a value that holds a newline (a message with its traceback)
goes in the binary form, ``KEY``, a newline, its length as 64-bit little-endian, its bytes, a newline, so no value
can end its field and start another. Every value but MESSAGE passes through ``printable`` first, which leaves no
newline in it at all. An entry too big for one datagram (EMSGSIZE) goes in a sealed memfd passed with SCM_RIGHTS,
as libsystemd sends it.

Never blocking, never raising, never losing a line: each datagram goes with MSG_DONTWAIT; when a send fails (the
socket gone, journald not reading: EAGAIN) that record goes to the fallback handler (the ``<N>``-prefixed stderr
lines, which reach the journal through its stream, without the fields), after a note naming the socket and the
error, written at most once a minute.

Standard library only, not systemd-python: that needs libsystemd's headers and a compiler to install into
/usr/lib/pled, for one sendto(); this is the same protocol in a page, tested against a socket of the tests' own and
against journald itself (tests/test_journal.py, tests/test_systemd_pid1.py).
"""
from __future__ import annotations

import array
import errno
import fcntl
import logging
import os
import re
import socket
import struct
import time
from collections.abc import Iterable
from typing import Any, Literal

from pled.shared.boundary import printable
from pled.shared.errors import EX_CONFIG

SOCKET = "/run/systemd/journal/socket"
ENV_SOCKET = "PLED_JOURNAL_SOCKET"  # another path for it: for tests (the unit never sets it)
IDENTIFIER = "pled"
ATTR = "journal_fields"  # the LogRecord attribute fields() sets through ``extra=``
NOTE_EVERY = 60.0  # seconds between notes that the journal's socket refuses records

Event = Literal["ready", "refused", "reload_done", "reload_failed", "client_attached", "client_detached",
                "client_refused", "client_dropped", "verify_differs", "table_modified"]

# One id per kind of event, fixed for good (made once with uuid.uuid4().hex); units/pled.catalog explains each.
MESSAGE_IDS: dict[str, str] = {
    "ready": "d6841e352cdb46e08a9096e800671328",  # every table staged and served: READY=1
    "refused": "a14c21fd37df47e5994ed8ad9633c97c",  # config, sidecar or preflight refused at start: exit 78
    "reload_done": "36b05ea600f0435db6ac982303d3155a",
    "reload_failed": "ad97a81bbb5c4ddf9433e3966ec572cd",
    "client_attached": "94d871ad22b74bf78a1a23b67089c680",
    "client_detached": "6eb4b2a2088941bb8dbf83e6a3ecc469",
    "client_refused": "7a04562bbbf04e8e99f5386ae50a178a",  # a connection refused: access policy, or its uid's share
    "client_dropped": "751353ac3de341bbaa8ddb0bc64043e4",  # a connection pled closed: a bad call, stuck, over a bound
    "verify_differs": "2b056be33c5e416b9e9571a1ccb313bc",  # pled verify found a region that differs from its files
    "table_modified": "b14c68e002f64778ad9b81956b28e8fe",  # the scheduled verify: a writable table's bytes changed
}

PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}
_KEY = re.compile(r"[A-Z0-9][A-Z0-9_]{0,63}")  # journald's rule for a field a client may send
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def priority(levelno: int) -> int:
    return PRIORITY.get(levelno, 6)


def fields(event: Event | None = None, *, table: str | Iterable[str] | None = None, generation: int | None = None,
           peer: Any = None) -> dict[str, dict[str, list[str]]]:
    """``extra=`` for a log call: the journal fields of its entry. ``table``: a name, or several (each its own
    PLED_TABLE); ``generation``: where the entry is about one generation of one table; ``peer``: a client,
    anything with ``pid`` and ``uid`` (access.Peer)."""
    out: dict[str, list[str]] = {}
    if event is not None and event in MESSAGE_IDS:
        out["MESSAGE_ID"] = [MESSAGE_IDS[event]]
    if table is not None:
        out["PLED_TABLE"] = [table] if isinstance(table, str) else [str(t) for t in table]
    if generation is not None:
        out["PLED_GENERATION"] = [str(generation)]
    if peer is not None:
        for key, name in (("PLED_CLIENT_PID", "pid"), ("PLED_CLIENT_UID", "uid")):
            if getattr(peer, name, None) is not None:
                out[key] = [str(getattr(peer, name))]
    return {ATTR: out}


def refusal_fields(err: BaseException) -> dict[str, dict[str, list[str]]]:
    """``extra=`` for logging an error pled exits with: the "refused" entry (and its table) for a refusal of
    config, sidecar or preflight (exit 78), no fields for any other."""
    if getattr(err, "exit_status", None) == EX_CONFIG:
        return fields("refused", table=getattr(err, "table", None))
    return fields()


def field(key: str, value: str) -> bytes:
    """One field in the native format: ``KEY=value\\n``, or the binary form for a value holding a newline."""
    data = value.encode("utf-8", errors="replace")
    if b"\n" in data:
        return key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return key.encode() + b"=" + data + b"\n"


def entry(record: logging.LogRecord, message: str) -> bytes:
    """The datagram for ``record``: ``message`` (already escaped, lines of a traceback kept) and the fields."""
    items = [("MESSAGE", message), ("PRIORITY", str(priority(record.levelno))), ("SYSLOG_IDENTIFIER", IDENTIFIER),
             ("CODE_FILE", printable(record.pathname)), ("CODE_LINE", str(record.lineno)),
             ("CODE_FUNC", printable(record.funcName))]
    extra = getattr(record, ATTR, None)
    if isinstance(extra, dict):
        for key, values in extra.items():
            if isinstance(key, str) and _KEY.fullmatch(key):
                items += [(key, printable(v)) for v in (values if isinstance(values, (list, tuple)) else [values])]
    return b"".join(field(k, v) for k, v in items)


class JournalHandler(logging.Handler):
    """A logging handler that writes each record to the journal's socket, or else to ``fallback``."""

    def __init__(self, fallback: logging.Handler, path: str = SOCKET) -> None:
        super().__init__()
        self.path = path
        self.fallback = fallback
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._noted: float | None = None  # when the last note that the socket refused a record was written

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.send(entry(record, self.format(record)))
        except Exception as err:  # the socket gone or full, or anything else: stderr has the line
            self._fall_back(record, err)

    def send(self, data: bytes) -> None:
        try:
            self._sock.sendto(data, socket.MSG_DONTWAIT, self.path)
        except OSError as err:
            if err.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                raise
            self._send_memfd(data)

    def _send_memfd(self, data: bytes) -> None:
        """Too big for a datagram: the entry in a sealed memfd, the datagram carrying only that fd."""
        fd = os.memfd_create("pled-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self._sock.sendmsg([], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))],
                               socket.MSG_DONTWAIT, self.path)
        finally:
            os.close(fd)

    def _fall_back(self, record: logging.LogRecord, err: Exception) -> None:
        try:
            now = time.monotonic()
            if self._noted is None or now - self._noted >= NOTE_EVERY:
                self._noted = now
                why = (f"{errno.errorcode.get(err.errno, err.errno)}, {err.strerror}"
                       if isinstance(err, OSError) and err.errno else f"{type(err).__name__}: {err}")
                self.fallback.handle(logging.LogRecord(
                    __name__, logging.WARNING, __file__, 0, "the journal's socket %s refused a record (%s): log lines "
                    "go to stderr while it does (noted at most once a minute)", (self.path, why), None))
            self.fallback.handle(record)
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        self.acquire()
        try:
            self._sock.close()
        finally:
            self.release()
        super().close()
