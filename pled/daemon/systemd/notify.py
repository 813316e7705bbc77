"""Talking to systemd: sd_notify messages (READY=1, STATUS=, WATCHDOG=1, FDSTORE=1, ...).

sd_notify's protocol is one datagram per message on an AF_UNIX socket named by NOTIFY_SOCKET (a path,
or an abstract address written with a leading '@'), its text UTF-8. One datagram socket sends every
message; messages that carry a file descriptor (FDSTORE=1) pass it with SCM_RIGHTS in the same sendmsg.
Without NOTIFY_SOCKET every call is a silent no-op, so the same program runs in a terminal. A failure
names the socket and is logged once (until a message gets through again), never raised: systemd being
unreachable must not stop pled from serving. What pled keeps in systemd's fd store, under which names, and
what systemd hands back at start (LISTEN_FDS) are fdstore.py's.
"""
from __future__ import annotations

import array
import logging
import os
import socket
from collections.abc import Mapping

from pled.shared.boundary import printable

log = logging.getLogger(__name__)

SCM_MAX_FD = 253  # the kernel refuses more fds than this in one message


def socket_address(name: str) -> str:
    """NOTIFY_SOCKET as an AF_UNIX address: '@name' is the abstract address '\\0name'."""
    if name.startswith("@"):
        return "\0" + name[1:]
    if name.startswith("/"):
        return name
    raise ValueError("not an absolute path or an abstract '@' address")


class Notifier:
    _sock: socket.socket | None = None

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.address = env.get("NOTIFY_SOCKET") or None
        self.watchdog_interval = _watchdog_interval(env)
        self._failing = False
        if self.address is None:
            return
        try:
            self._target = socket_address(self.address)
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        except (OSError, ValueError) as err:
            log.warning("cannot use notify socket '%s': %s; running without systemd notifications", self.address, err)
            self.address = None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *lines: str, fds: tuple[int, ...] = ()) -> bool:
        """One datagram: the lines joined by newlines, UTF-8, with ``fds`` attached. False if it did not go."""
        if self._sock is None:
            return False
        message = "\n".join(printable(line) for line in lines)  # a path's newline must not start another field
        try:
            if len(fds) > SCM_MAX_FD:
                raise OSError(f"{len(fds)} fds in one message; the kernel allows {SCM_MAX_FD}")
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            # errors="replace": a path that is not valid UTF-8 shows with U+FFFD rather than failing the message
            self._sock.sendmsg([message.encode("utf-8", errors="replace")], ancillary, 0, self._target)
        except OSError as err:
            if not self._failing:
                log.warning("Failed to send notify message %r to '%s': %s; further failures are not logged until one "
                            "gets through", message.split("\n")[0], self.address, err)
            self._failing = True
            return False
        if self._failing:
            log.info("notify socket '%s' reachable again", self.address)
            self._failing = False
        return True

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def stopping(self, status: str = "stopping") -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> None:
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def store_fd(self, fd: int, name: str) -> bool:
        """FDSTORE=1: systemd keeps its own copy of ``fd`` across our restarts. FDPOLL=0: a memfd never
        signals anything, and systemd must not drop it on EPOLLHUP."""
        return self.send("FDSTORE=1", f"FDNAME={name}", "FDPOLL=0", fds=(fd,))

    def remove_fd(self, name: str) -> bool:
        return self.send("FDSTOREREMOVE=1", f"FDNAME={name}")

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def _watchdog_interval(env) -> float | None:
    """Half of WATCHDOG_USEC, if the watchdog is meant for this process."""
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not a number", usec)
        return None
    return value / 2e6 if value > 0 else None
