"""Logging for a terminal or for journald.

Under systemd (JOURNAL_STREAM names our stderr) each line starts with its syslog
priority, ``<3>`` error, ``<4>`` warning, ``<6>`` info, ``<7>`` debug, so that
``journalctl -p warning -u pled`` works; journald adds time and pid itself.
Elsewhere: a plain human line with a timestamp.
"""
from __future__ import annotations

import logging
import os
import sys

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


class _JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{_PRIORITY.get(record.levelno, 6)}>"
        return "\n".join(prefix + line for line in super().format(record).splitlines())


def setup(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if stderr_is_journal():
        handler.setFormatter(_JournalFormatter("%(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s pled[%(process)d] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
