"""Logging for a terminal or for journald.

Under systemd (JOURNAL_STREAM names our stderr) each line starts with its syslog
priority, ``<3>`` error, ``<4>`` warning, ``<6>`` info, ``<7>`` debug, so that
``journalctl -p warning -u pled`` works; journald adds time and pid itself.
Elsewhere: a plain human line with a timestamp.

Both escape every non-printable character of a message (pled.shared.boundary.printable): a peer's
command line, a path or a file's text can hold ESC, BEL or U+2028, and none of it reaches a terminal or
splits a journal entry. A traceback keeps its line breaks; each of its lines is escaped the same way.
"""
from __future__ import annotations

import logging
import os
import sys

from pled.shared.boundary import printable

_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


def stderr_is_journal() -> bool:
    stream = os.environ.get("JOURNAL_STREAM", "")
    dev, _, ino = stream.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


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
        prefix = f"<{_PRIORITY.get(record.levelno, 6)}>"
        return "\n".join(prefix + line for line in super().format(record).splitlines())


def setup(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if stderr_is_journal():
        handler.setFormatter(_JournalFormatter("%(message)s"))
    else:
        handler.setFormatter(_Escaping("%(asctime)s pled[%(process)d] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
