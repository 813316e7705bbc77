"""What the worker threads tell the loop: how a staging ended, and a reload's plan.

Each event is a small frozen dataclass, posted by a worker thread (stager.py) and handled in the loop thread.
A staging's end names its table and the ``StagingOwner`` that asked for it (the first staging, or a reload),
so the registry takes every staging's end along one path and hands the consequence to that owner.
A ``Staged`` event owns its Region until the registry has put it in the table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pled.daemon.regions.planning import ReloadPlan
from pled.daemon.tables import TableState
from pled.shared.region import Region


class StagingOwner(Protocol):
    """Whoever handed tables to the stager; told, in the loop thread, once the registry has recorded the end."""

    def table_ready(self, t: TableState) -> None: ...

    def table_failed(self, t: TableState, error: BaseException) -> None: ...

    def table_cancelled(self, t: TableState, reason: str) -> None: ...


@dataclass(frozen=True, eq=False)
class Staged:
    """The table is copied and sealed: ``region`` holds it."""

    table: TableState
    region: Region
    owner: StagingOwner


@dataclass(frozen=True, eq=False)
class StagingFailed:
    """Staging the table failed: a PledError or OSError that names the file, or a bug."""

    table: TableState
    error: BaseException
    owner: StagingOwner


@dataclass(frozen=True, eq=False)
class StagingCancelled:
    """pled is stopping: the table's staging stopped between two chunks, its partial copy closed."""

    table: TableState
    reason: str
    owner: StagingOwner


@dataclass(frozen=True, eq=False)
class Planned:
    """A reload's plan, made off the loop thread (planning.plan_reload)."""

    plan: ReloadPlan


@dataclass(frozen=True, eq=False)
class PlanningFailed:
    """A reload's planning refused the new config (a PledError) or hit a bug."""

    error: BaseException


@dataclass(frozen=True, eq=False)
class Verified:
    """The scheduled verify of a writable table's ``region`` ended: ``outcome`` (integrity.Outcome), or ``error``."""

    table: TableState
    region: Region
    outcome: object | None
    error: BaseException | None = None


StagingEnded = Staged | StagingFailed | StagingCancelled
Event = StagingEnded | Planned | PlanningFailed | Verified
