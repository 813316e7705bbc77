"""File descriptors: how many pled may open, and how many connections that leaves room for.

systemd's default soft RLIMIT_NOFILE is 1024 (with a hard limit of 524288), and Linux also caps the fds
a user has in flight over Unix sockets (sent, not yet received) at the sender's RLIMIT_NOFILE unless it
holds CAP_SYS_RESOURCE, which pled.service does not. So pled raises its soft limit to the hard one at
start (units/pled.service sets LimitNOFILE=), and keeps its connection cap well below what is left.
"""
from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

CONNECTIONS_CAP = 4096  # more clients than any host runs vLLM processes
RESERVE = 128  # fds for the regions (two generations a table while reloading), staging, the store, logs


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


def max_connections(limit: int) -> int:
    """Connections pled accepts with ``limit`` fds: the cap, or what the limit leaves after the reserve."""
    reserve = max(RESERVE, limit // 8)
    return max(16, min(CONNECTIONS_CAP, limit - reserve))


def max_fds_in_flight(limit: int) -> int:
    """Region fds one peer uid may have sent to it and not yet received: a small share of the kernel's cap."""
    return max(16, min(256, limit // 4))
