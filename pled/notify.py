"""Talking to systemd: sd_notify messages and the file descriptor store.

Plain messages go through sdnotify; messages that carry a file descriptor
(FDSTORE=1) through ``socket.send_fds`` on the same socket, which sdnotify
cannot do. Without NOTIFY_SOCKET every call is a silent no-op, so the same
program runs in a terminal. A failure names the socket and is logged, never
raised: systemd being unreachable must not stop pled from serving.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import sdnotify

log = logging.getLogger(__name__)

SCM_MAX_FD = 253  # the kernel refuses more fds than this in one message
FDS_START = 3  # SD_LISTEN_FDS_START
FDNAME_PREFIX = "pled"


class Notifier:
    _sock: socket.socket | None = None

    def __init__(self, env: dict | None = None) -> None:
        env = os.environ if env is None else env
        self.address = env.get("NOTIFY_SOCKET") or None
        self.watchdog_interval = _watchdog_interval(env)
        if self.address is None:
            return
        try:
            self._notifier = sdnotify.SystemdNotifier(debug=True)
            self._sock = self._notifier.socket
        except OSError as err:
            log.warning("Failed to connect to notify socket '%s': %s; running without systemd notifications", self.address, err)
            self.address = None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *lines: str, fds: tuple[int, ...] = ()) -> bool:
        if self._sock is None:
            return False
        message = "\n".join(lines)
        if len(fds) > SCM_MAX_FD:
            raise ValueError(f"cannot pass {len(fds)} fds in one notify message; the kernel allows {SCM_MAX_FD}")
        try:
            if fds:
                socket.send_fds(self._sock, [message.encode()], list(fds))
            else:
                self._notifier.notify(message)
            return True
        except OSError as err:
            log.warning("Failed to send notify message %r to '%s': %s", message.split("\n")[0], self.address, err)
            return False

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


def fd_name(table: str, generation: int) -> str:
    """FDNAME for a table's region: 'pled.<generation>.<table>' (fd names may not hold ':')."""
    return f"{FDNAME_PREFIX}.{generation}.{table}"


def parse_fd_name(name: str) -> tuple[str, int] | None:
    parts = name.split(".", 2)
    if len(parts) != 3 or parts[0] != FDNAME_PREFIX or not parts[1].isdigit():
        return None
    return parts[2], int(parts[1])


@dataclass(frozen=True)
class StoredFd:
    fd: int
    name: str


def listen_fds(env: dict | None = None, unset: bool = True) -> list[StoredFd]:
    """The fds systemd passed us (LISTEN_FDS/LISTEN_FDNAMES), if they are meant for this process.

    As sd_listen_fds_with_names(unset_environment=1): the variables are removed so that no child
    inherits them, and each fd is marked close-on-exec.
    """
    env = os.environ if env is None else env
    pid, count, names = env.get("LISTEN_PID"), env.get("LISTEN_FDS", "0"), env.get("LISTEN_FDNAMES", "")
    if unset:
        for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            env.pop(key, None)
    if pid != str(os.getpid()) or not count.isdigit():
        return []
    labels = names.split(":") if names else []
    out = []
    for i in range(int(count)):
        fd = FDS_START + i
        try:
            os.set_inheritable(fd, False)
        except OSError:
            log.warning("LISTEN_FDS names fd %d but it is not open; ignoring it", fd)
            continue
        out.append(StoredFd(fd, labels[i] if i < len(labels) else "unknown"))
    return out
