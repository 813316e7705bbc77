"""Logging for a terminal or for journald.

Under systemd (JOURNAL_STREAM names our stderr) each record goes to the journal through its native protocol
(journal.py: MESSAGE_ID, PLED_TABLE and the other fields a call passes with ``extra=journal.fields(...)``), where
the journal's socket is there (``journal_socket``); whenever a record cannot go that way, and where the socket is
not there at all, it is a line on stderr that starts with its syslog priority, ``<3>`` error, ``<4>`` warning,
``<6>`` info, ``<7>`` debug, so that ``journalctl -p warning -u pled`` works; journald adds time and pid itself.
Elsewhere: a plain human line with a timestamp. JOURNAL_STREAM, not the socket's existence, decides, as systemd.exec(5)
advises: a pled started by hand on a host with journald, or with its stderr sent to a file, keeps its text log.

Every form escapes every non-printable character of a message (pled.shared.boundary.printable): a peer's
command line, a path or a file's text can hold ESC, BEL or U+2028, and none of it reaches a terminal or
splits a journal entry. A traceback keeps its line breaks; each of its lines is escaped the same way.

The refusal pled exits 78 with (EX_CONFIG: the config, a sidecar or the preflight) is logged by pled.cli.main with
``journal.refusal_fields``: the journal's "refused" MESSAGE_ID and the table's name.
"""
from __future__ import annotations

import logging
import os
import stat
import sys
from collections.abc import Mapping

from pled.daemon.health import journal
from pled.shared.boundary import ascii_count, printable


def stderr_is_journal(env: Mapping[str, str] | None = None) -> bool:
    stream = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    dev, _, ino = stream.partition(":")
    numbers = ascii_count(dev), ascii_count(ino)
    if None in numbers:
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == numbers


def journal_socket(env: Mapping[str, str] | None = None) -> str | None:
    """The journal's native socket, where pled's stderr is the journal and the socket is there; else None.
    ``PLED_JOURNAL_SOCKET`` names another path for it (tests)."""
    env = os.environ if env is None else env
    if not stderr_is_journal(env):
        return None
    path = env.get(journal.ENV_SOCKET) or journal.SOCKET
    try:
        return path if stat.S_ISSOCK(os.stat(path).st_mode) else None
    except (OSError, ValueError):
        return None


class _Escaping(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        return "\n".join(printable(line) for line in super().formatException(ei).splitlines())

    def formatStack(self, stack_info: str) -> str:
        return "\n".join(printable(line) for line in stack_info.splitlines())


class _JournalFormatter(_Escaping):
    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{journal.priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).splitlines())


def setup(level: str = "INFO") -> None:
    stderr = logging.StreamHandler(sys.stderr)
    handler: logging.Handler = stderr
    if stderr_is_journal():
        stderr.setFormatter(_JournalFormatter("%(message)s"))
        path = journal_socket()
        if path is not None:
            try:
                handler = journal.JournalHandler(stderr, path)
                handler.setFormatter(_Escaping("%(message)s"))
            except OSError:  # no socket to be had (no fd free): the lines on stderr, as without the journal's socket
                handler = stderr
    else:
        handler.setFormatter(_Escaping("%(asctime)s pled[%(process)d] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
