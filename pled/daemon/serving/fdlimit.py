"""File descriptors: how many pled may open, and how many connections that leaves room for.

systemd's default soft RLIMIT_NOFILE is 1024 (with a hard limit of 524288), and Linux also caps the fds
a user has in flight over Unix sockets (sent, not yet received) at the sender's RLIMIT_NOFILE unless it
holds CAP_SYS_RESOURCE, which pled.service does not. So pled raises its soft limit to the hard one at
start (units/pled.service sets LimitNOFILE=), and keeps its connection cap well below what is left.

Within the cap no one uid other than root and pled's own may hold more than a quarter of the connections, and
the last OPERATOR_RESERVE are kept for root and pled's user: a client in pled's group that opens (and attaches)
connections until the cap cannot lock out `pled status`, `pled reload` or the other users' processes.
"""
from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

log = logging.getLogger(__name__)

CONNECTIONS_CAP = 4096  # more clients than any host runs vLLM processes
RESERVE = 128  # fds for the regions (two generations a table while reloading), staging, the store, logs
OPERATOR_RESERVE = 8  # connections only root and pled's own user may take


def raise_nofile() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return soft if soft != resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as err:
        log.warning("could not raise the open-file limit from %d to %d (%s); serving at most %d clients", soft, hard,
                    err, max_connections(soft))
        return soft
    log.info("open-file limit raised from %d to %d: up to %d clients", soft, hard, max_connections(hard))
    return hard


def soft_limit() -> int:
    """The soft RLIMIT_NOFILE in force: how many fds pled may hold."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def open_fds(proc: str = "/proc/self/fd") -> int | None:
    """How many fds this process holds now (None where /proc is not there)."""
    try:
        return len(os.listdir(proc)) - 1  # listdir's own fd of the directory is listed too
    except OSError:
        return None


def max_connections(limit: int) -> int:
    """Connections pled accepts with ``limit`` fds: the cap, or what the limit leaves after the reserve."""
    reserve = max(RESERVE, limit // 8)
    return max(16, min(CONNECTIONS_CAP, limit - reserve))


def max_fds_in_flight(limit: int) -> int:
    """Region fds one peer uid may have sent to it and not yet received: a small share of the kernel's cap."""
    return max(16, min(256, limit // 4))


@dataclass(frozen=True)
class FdBudget:
    """Table fds sent and not yet received (the kernel refuses pled more past its open-file limit): at most
    ``per_uid`` for one peer uid, ``total`` over all peers, the last ``reserve`` of which only root and pled's
    own user may take."""
    per_uid: int
    total: int
    reserve: int


def fd_budget(limit: int) -> FdBudget:
    """With ``limit`` fds: half the kernel's cap over all peers, an eighth of that kept for root and pled's user."""
    total = max(32, limit // 2)
    return FdBudget(max_fds_in_flight(limit), total, max(16, total // 8))


def per_uid(cap: int) -> int:
    """Connections one uid (other than root and pled's own) may hold: a quarter of the cap, at least 16."""
    return max(16, cap // 4)


def over_share(uid: int, operators: tuple[int, ...], open_by_uid: int, open_total: int, cap: int) -> str | None:
    """Why a new connection of ``uid`` is refused though the cap is not reached (None: it is not)."""
    if uid in operators:
        return None
    if open_by_uid >= per_uid(cap):
        return f"uid {uid} already holds {open_by_uid} connections (at most {per_uid(cap)} per uid)"
    if open_total >= cap - OPERATOR_RESERVE:
        return f"{open_total} connections open; the last {OPERATOR_RESERVE} of {cap} are kept for root and pled's user"
    return None
