"""What pled counts while it runs: attaches served, refusals and dropped connections by reason, reloads.

One ``Counters`` is made by the Daemon and handed to the parts that count (the server, the handlers, the
reloader), each in its constructor; all of them count in the loop thread. The figures go out in Status
(``daemon``) and the metrics (pled/shared/metrics.py). They restart at 0 with the process: nothing keeps them
across a restart of pled. ``version`` changes with every count, so the metrics writer knows when to write.
"""
from __future__ import annotations

# Why a client was refused: the reasons Status and the metrics name (each one listed, at 0, from the start).
REFUSED = (
    "access",  # not root, pled's user or group, nor in allow_uids / allow_groups (io.pled.PermissionDenied)
    "reload_access",  # io.pled.Reload from a user other than root or pled's own
    "no_such_table",  # Attach of a table pled does not serve
    "not_ready",  # Attach of a table not ready yet (without "wait"), or failed
    "uid_share",  # a new connection whose uid holds its share of the connections (or the operators' last ones)
    "connection_cap",  # a new connection at the cap, with no idle one to close for it
)
# Why pled closed a connection itself (a client that closes its own is not counted).
DROPPED = (
    "unread_replies",  # more replies unread than its bound, or its uid's
    "fds_in_flight",  # more table fds sent and not received than its bound, its uid's, or the kernel's
    "timeout",  # half a call, or an unread reply, for longer than CALL_TIMEOUT
    "invalid_message",  # a call too long, not JSON, not a call, or too many calls behind one waiting
    "idle_evicted",  # idle (no table, no call) at the cap: closed to admit a new client
    "internal_error",  # handling it failed inside pled (a bug): that connection ends, pled serves on
)


class Counters:
    def __init__(self) -> None:
        self.attaches = 0  # Attach replies whose table fd the kernel took
        self.refused: dict[str, int] = dict.fromkeys(REFUSED, 0)
        self.dropped: dict[str, int] = dict.fromkeys(DROPPED, 0)
        self.reloads: dict[str, int] = {"done": 0, "failed": 0}
        self.version = 0  # changes with every count

    def attached(self) -> None:
        self.attaches += 1
        self.version += 1

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        self.version += 1

    def drop(self, reason: str) -> None:
        """pled closed a connection for ``reason``; "" (the peer closed it, or pled is stopping) counts nothing."""
        if not reason:
            return
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self.version += 1

    def reload_ended(self, result: str) -> None:
        """``result``: "done" or "failed"."""
        self.reloads[result] = self.reloads.get(result, 0) + 1
        self.version += 1

    def snapshot(self) -> dict:
        """The counts as Status shows them (copies: a later count changes none of them)."""
        return {"attaches": self.attaches, "refused": dict(self.refused), "dropped": dict(self.dropped),
                "reloads": dict(self.reloads)}
