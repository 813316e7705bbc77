"""One root exception for everything pled refuses or fails at.

Each subclass carries the object it is about (a file, a key, a table) and an
exit status, so the CLI turns any of them into one clear line and the right
code. 78 is EX_CONFIG from sysexits.h: systemd units name it in
RestartPreventExitStatus= so that a refusal does not restart-loop.
"""
from __future__ import annotations

from pled.shared.boundary import clip

EX_OK = 0
EX_FAILURE = 1
EX_NOT_RUNNING = 3  # as systemctl status and LSB init scripts say "not running"
EX_USAGE = 64  # sysexits.h: the command was used wrongly (a bad argument)
EX_UNAVAILABLE = 69  # sysexits.h: a Python module the command needs is not installed in this environment
EX_NOPERM = 77  # sysexits.h: this user may not (reach pled's socket, be admitted by pled, reload)
EX_CONFIG = 78
EX_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C


class PledError(Exception):
    """Root of pled's errors. ``exit_status`` is what the CLI exits with."""

    exit_status = EX_FAILURE
    table: str | None = None  # the table it is about, where it is about one (the journal's PLED_TABLE)


class FileRefused(PledError):
    """A file pled was given is refused: the message names the file, then the problem."""

    exit_status = EX_CONFIG

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{clip(path)}: {problem}")
        self.path = path
        self.problem = problem


class ConfigError(FileRefused):
    """The configuration file is missing, unreadable or invalid."""


class SidecarError(FileRefused):
    """A table's files are missing, truncated, foreign or inconsistent."""


class PreflightRefused(PledError):
    """The host or its memory cgroup cannot hold the tables."""

    exit_status = EX_CONFIG

    def __init__(self, message: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


class StagingError(PledError):
    """Copying a table into its region failed (I/O error, source changed)."""

    def __init__(self, table: str, problem: str) -> None:
        super().__init__(f"table {table}: {problem}")
        self.table = table
        self.problem = problem


class RegionError(PledError):
    """A memfd is not a pled region, or its header or seals are wrong."""
