"""The wire connection to pled: connect, one call and its reply (with any fds), the errors it raises.

A connection held open is an attachment: pled counts the client until it closes.
See docs/protocol.md. This module never imports the daemon's code, nor torch.
"""
from __future__ import annotations

import array
import errno
import grp
import os
import pwd
import socket as socket_mod
import stat
import time

from pled.shared import protocol
from pled.shared.boundary import BoundaryError, OutOfTime, clip, deadline as parse_deadline, load_json
from pled.shared.errors import PledError

DEFAULT_SOCKET = protocol.DEFAULT_SOCKET
ENV_SOCKET = "PLED_SOCKET"
_HINT = ("check `systemctl status pled` and `journalctl -u pled` (where pled runs in a container: that container, "
         "its log, and that its socket directory is mounted here)")


class ClientError(PledError):
    """Root of what attach() and call() raise."""


class DaemonUnavailable(ClientError):
    """Nothing is serving at the socket."""


class PermissionDenied(ClientError):
    """pled refused this process's uid."""


class NoSuchTable(ClientError):
    """pled does not serve a table of that name."""


class NotReady(ClientError):
    """The table is still being staged; ``progress`` says how far."""

    def __init__(self, message: str, progress: dict) -> None:
        super().__init__(message)
        self.progress = progress


class ReloadFailed(ClientError):
    """pled could not reload; it serves what it served before."""


class NotWritable(PermissionDenied):
    """This process did not get the read-write fd of a table (not a writer its config names, or not a writable
    table), and something asked it to write or register the table writable."""


class ProtocolError(ClientError):
    """The daemon answered something this client does not understand."""


class BadRegion(ProtocolError):
    """The fd sent for a table is not a sealed pled region, or its header or manifest is wrong: nothing was mapped."""


def socket_path(path: str | None = None) -> str:
    return path or os.environ.get(ENV_SOCKET) or DEFAULT_SOCKET


class Connection:
    """One blocking connection to the daemon. A Table keeps its own open while attached.

    ``timeout`` bounds a whole call, every send and receive of it together, however the reply trickles in, and the
    parse of its reply; the first call's time runs from the connect, so that attach() and call() end within
    ``timeout`` of their start. ``deadline`` is the last call's (time.monotonic()), for what its caller parses
    after it (attach(): the region's manifest)."""

    deadline: float = 0.0

    _sock: socket_mod.socket | None = None

    def __init__(self, path: str | None = None, timeout: float = 10.0) -> None:
        self.path = socket_path(path)
        self.timeout = timeout
        self._deadline: float | None = time.monotonic() + timeout  # the first call's, counted from the connect
        sock = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM | socket_mod.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(self.path)
        except OSError as err:
            sock.close()
            raise connect_error(self.path, err) from err
        self._sock = sock
        self._buf = bytearray()
        self._searched = 0  # bytes of _buf known to hold no NUL: each byte of a trickled reply is searched once

    def call(self, method: str, **parameters) -> tuple[dict, list[int]]:
        """Send one call; return the reply's parameters and the fds that came with it (the caller owns them).
        The reply is parsed within the bounds of any untrusted JSON (pled.shared.boundary); whatever is wrong with
        it is a ClientError, and every fd that came with it is closed then."""
        deadline, self._deadline = self._deadline, None
        if deadline is None:  # a later call on a connection held open: its own timeout from now
            deadline = time.monotonic() + self.timeout
        self.deadline = deadline
        sock = self._sock
        if sock is None:
            raise ClientError(f"the connection to pled at {self.path} is closed")
        try:
            sock.settimeout(_left(deadline))
            sock.sendall(protocol.call(method, **parameters))
            raw, fds = self._receive(sock, deadline)
        except TimeoutError as err:
            raise DaemonUnavailable(f"pled at {self.path} did not answer {method} within {self.timeout:g} s; "
                                    f"{_HINT}") from err
        except OSError as err:  # reset, broken pipe, or anything else the socket says
            raise DaemonUnavailable(f"pled at {self.path} closed the connection during {method} "
                                    f"({err.strerror or err}); {_HINT}") from err
        try:
            with parse_deadline(deadline):
                message = load_json(raw, max_bytes=protocol.MAX_REPLY, max_values=protocol.MAX_REPLY_VALUES)
            if not isinstance(message, dict):
                raise BoundaryError(f"is {type(message).__name__}, not an object")
            error, params = message.get("error"), message.get("parameters")
            params = {} if params is None else params
            if not isinstance(params, dict) or not isinstance(error, (str, type(None))):
                raise BoundaryError('has "parameters" that are not an object or an "error" that is not a string')
        except BoundaryError as err:
            close_all(fds)
            raise ProtocolError(f"pled at {self.path} sent a reply to {method} that {err}") from err
        except OutOfTime as err:
            close_all(fds)
            raise DaemonUnavailable(f"pled at {self.path} did not answer {method} within {self.timeout:g} s (its "
                                    f"reply of {len(raw)} bytes took longer than that to read); {_HINT}") from err
        if error is not None:
            close_all(fds)
            raise _error(error, params, self.path, method)
        return params, fds

    def _receive(self, sock: socket_mod.socket, deadline: float) -> tuple[bytes, list[int]]:
        fds: list[int] = []
        try:
            while True:
                end = self._buf.find(b"\0", self._searched)
                if end >= 0:
                    raw = bytes(self._buf[:end])
                    del self._buf[: end + 1]
                    self._searched = 0
                    return raw, fds
                self._searched = len(self._buf)
                if len(self._buf) > protocol.MAX_REPLY:
                    raise ProtocolError(f"reply from {self.path} exceeds {protocol.MAX_REPLY} bytes")
                sock.settimeout(_left(deadline))  # each receive gets what is left of the call's time
                data, flags = _receive_fds(sock, fds)
                if flags & socket_mod.MSG_CTRUNC:  # the kernel closed fds it could not give this process
                    raise ProtocolError(_cut_short(self.path))
                if len(fds) > MAX_REPLY_FDS:  # a reply carries one region at the most: not a pile of this process's fds
                    raise ProtocolError(f"pled at {self.path} sent {len(fds)} file descriptors with one reply; a reply "
                                        f"carries at most {MAX_REPLY_FDS}")
                if not data:
                    raise DaemonUnavailable(f"pled at {self.path} closed the connection; {_HINT}")
                self._buf += data
        except BaseException:  # a timeout or reset half-way through a reply too: its fds are ours to close
            close_all(fds)
            raise

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


MAX_REPLY_FDS = 1  # an Attach reply's region; every other reply carries none


_MAX_FDS_AT_ONCE = 4  # room for more than a reply carries: one too many is refused below, not cut short


def _receive_fds(sock: socket_mod.socket, fds: list[int]) -> tuple[bytes, int]:
    """(bytes, recvmsg's flags) of one receive; the fds that came with them appended to ``fds`` (the caller's to
    close), close-on-exec from the moment they exist (MSG_CMSG_CLOEXEC): a vLLM process that execs a child without
    closing its fds must not hand it a table's memfd, which would keep the table's memory alive after pled lets it
    go. socket.recv_fds cannot do that: it drops its flags argument (CPython 3.11)."""
    data, ancillary, flags, _ = sock.recvmsg(1 << 20, socket_mod.CMSG_LEN(_MAX_FDS_AT_ONCE * 4),
                                             socket_mod.MSG_CMSG_CLOEXEC)
    for level, kind, raw in ancillary:
        if (level, kind) == (socket_mod.SOL_SOCKET, socket_mod.SCM_RIGHTS):
            got = array.array("i")
            got.frombytes(raw[: len(raw) - len(raw) % got.itemsize])
            fds.extend(got)
    return data, flags


def _cut_short(path: str) -> str:
    """Why a reply's fds did not all arrive (MSG_CTRUNC): a process at its fd limit gets none, a reply with more than
    the client takes at once gets some; the kernel closed the rest."""
    try:  # imported here, on this rare path: a client's interpreter may lack the extension (a minimal container)
        import resource

        limit = str(resource.getrlimit(resource.RLIMIT_NOFILE)[0])  # never RLIM_INFINITY: Linux caps it at nr_open
    except ImportError:
        limit = "unknown"
    return (f"the kernel cut short the file descriptors pled at {path} sent with its reply (MSG_CTRUNC) and closed "
            f"them: this process may be at its open-file limit ({limit}; raise it: ulimit -n, LimitNOFILE=), or the "
            f"reply carried more than one reply does")


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _left(deadline: float) -> float:
    """Seconds left until ``deadline``; a timeout once none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no time left")
    return left


def _error(name: str, progress: dict, path: str, method: str = "") -> ClientError:
    """The error a reply to ``method`` names; what the daemon said is quoted clipped (it may be anything)."""
    params = {key: clip(value, 1000) if isinstance(value, str) else value for key, value in progress.items()}
    if name == protocol.PERMISSION_DENIED and method == protocol.RELOAD:  # group pled may attach, not reload
        return PermissionDenied(f"pled at {path} refused the reload from uid {params.get('uid', os.geteuid())}: only "
                                "root and user pled may reload (group pled may only attach); run `sudo pled reload` "
                                "or `sudo systemctl reload pled`")
    if name == protocol.PERMISSION_DENIED:
        return PermissionDenied(f"pled at {path} refused uid {params.get('uid', os.geteuid())}: run it in pled's group "
                                f"(SupplementaryGroups=pled), or ask the operator to add it or one of its groups to "
                                f"allow_uids / allow_groups in /etc/pled/pled.toml")
    if name == protocol.NO_SUCH_TABLE:
        return NoSuchTable(f"pled at {path} serves no table {params.get('table')!r} (it serves: "
                           f"{_names(params.get('tables')) or 'none'}); check the name and `pled status`")
    if name == protocol.NOT_READY:
        return NotReady(f"table {params.get('table')!r} is still being staged ({params.get('shards_done')}/"
                        f"{params.get('shards')} shards); attach with wait=True or try again", progress)
    if name == protocol.RELOAD_FAILED:
        return ReloadFailed(f"reload failed, pled serves what it served before: {params.get('reason')}")
    return ProtocolError(f"pled at {path} answered {clip(name, 80)}: {clip(params)}")


def _names(names) -> str:
    return clip(", ".join(map(str, names))) if isinstance(names, list) else ""


def call(method: str, socket: str | None = None, timeout: float = 10.0, **parameters) -> dict:
    """One call on a fresh connection (Status, Ping)."""
    conn = Connection(socket, timeout)
    try:
        params, fds = conn.call(method, **parameters)
        close_all(fds)
        return params
    finally:
        conn.close()


def connect_error(path: str, err: OSError) -> ClientError:
    """What connecting to ``path`` failed with, as one line that names the path and the real cause (issue 47): a
    directory on the way this user may not search, no socket, a socket nobody listens at, a file that is not a
    socket, a full queue. PermissionDenied for a permission, else DaemonUnavailable (`pled status` exits 3)."""
    where = f"pled's socket {path}"
    if isinstance(err, PermissionError):
        blocked = _unsearchable(path)
        if blocked is not None:
            what, st = blocked
            return PermissionDenied(f"permission denied: {where}: uid {os.geteuid()} may not {what} "
                                    f"(mode {st.st_mode & 0o7777:04o}, owner {_user(st.st_uid)}, group "
                                    f"{_group(st.st_gid)}): add this user to group {_group(st.st_gid)} "
                                    f"(usermod -aG {_group(st.st_gid)} USER, then log in again; a unit: "
                                    f"SupplementaryGroups={_group(st.st_gid)}), or run as root")
        return PermissionDenied(f"permission denied: {where} refuses uid {os.geteuid()}: run as a member of the "
                                "socket's group, or ask the operator")
    kind = _kind(path)
    if kind is not None and kind != "socket":
        return DaemonUnavailable(f"{where} is not a socket but a {kind}: is `socket` in the config, --socket or "
                                 f"$PLED_SOCKET the path pled serves at? {_HINT}")
    if isinstance(err, FileNotFoundError):
        parent = os.path.dirname(path) or "."
        if not os.path.isdir(parent):
            return DaemonUnavailable(f"pled is not running: {where} does not exist, nor its directory {parent} "
                                     f"(pled.service makes it at start); start pled with `systemctl start pled`, "
                                     f"or {_HINT}")
        return DaemonUnavailable(f"pled is not running: no socket at {path}; start it with `systemctl start pled`, "
                                 f"or {_HINT}")
    if isinstance(err, ConnectionRefusedError):
        return DaemonUnavailable(f"pled is not running: nothing listens at {where} (a socket left by a pled that "
                                 f"stopped); start it with `systemctl start pled`, or {_HINT}")
    if isinstance(err, BlockingIOError) or err.errno == errno.EAGAIN:
        return DaemonUnavailable(f"pled at {path} accepts no more connections now (its queue is full: "
                                 f"{err.strerror}); it is overloaded or hung: try again, or {_HINT}")
    if isinstance(err, TimeoutError):
        return DaemonUnavailable(f"pled at {path} did not accept the connection in time; it is overloaded or hung: "
                                 f"{_HINT}")
    return DaemonUnavailable(f"cannot connect to {where}: {err.strerror or err}; {_HINT}")


def _unsearchable(path: str) -> tuple[str, os.stat_result] | None:
    """The first directory on the way to ``path`` this process may not search, or the socket it may not write: what
    it may not do, and that file's stat; None where neither (another cause, such as a security module)."""
    parts = os.path.abspath(path).split("/")
    for i in range(1, len(parts)):
        d = "/".join(parts[:i]) or "/"
        try:
            st = os.stat(d)
        except OSError:
            return None
        if not os.access(d, os.X_OK):
            return f"search the directory {d}", st
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (f"write to the socket {path}", st) if not os.access(path, os.W_OK) else None


def _kind(path: str) -> str | None:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    for test, name in ((stat.S_ISSOCK, "socket"), (stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "file of another kind"


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
