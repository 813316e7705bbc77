"""The listening socket: where it may live, and taking its path over from a daemon that is gone.

A client trusts whatever answers at the socket's path, so the directory that holds it must be one that
only pled's user (and its group) can write: in a world-writable directory another user could put their
own socket there while pled is down and answer pled's clients. That is refused; a directory other users
or another group can write to is warned about.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import stat

from pled.daemon.serving.access import peer_of
from pled.shared.errors import EX_CONFIG, PledError

log = logging.getLogger(__name__)


class SocketInUse(PledError):
    exit_status = EX_CONFIG


class UnsafeSocketDirectory(PledError):
    exit_status = EX_CONFIG


class SocketRefused(PledError):
    """The socket (or its directory) cannot be made there, which a restart does not change (permissions, a
    read-only or missing place): a refusal, 78. Running out of space, inodes or fds is an error (1): it may pass."""
    exit_status = EX_CONFIG


TRANSIENT = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EINTR, errno.EAGAIN)


def _cannot(err: OSError, message: str) -> PledError:
    return (PledError if err.errno in TRANSIENT else SocketRefused)(message)


def check_directory(parent: str) -> None:
    """Refuse a world-writable socket directory; warn about one another user or group can write."""
    try:
        st = os.stat(parent)
    except OSError as err:
        raise PledError(f"cannot check the socket's directory {parent}: {err.strerror or err}") from err
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        raise UnsafeSocketDirectory(
            f"{parent}: the socket's directory is writable by every user (mode {mode:04o}), so another user could "
            "put their own socket where clients look for pled's; use a directory only pled's user and group can "
            "write (chmod o-w, or the unit's RuntimeDirectory=pled, /run/pled, 0750)")
    me = os.geteuid()
    if st.st_uid not in (0, me):
        log.warning("the socket's directory %s belongs to uid %d, neither root nor uid %d that this pled runs as, "
                    "so uid %d could replace this pled's socket; use a directory owned by root or uid %d",
                    parent, st.st_uid, me, st.st_uid, me)
    if mode & stat.S_IWGRP and st.st_gid != os.getegid() and st.st_gid not in os.getgroups():
        log.warning("the socket's directory %s is writable by group %d, which pled is not in; its members could "
                    "replace pled's socket: chmod g-w %s", parent, st.st_gid, parent)


def bind(path: str) -> socket.socket:
    """Listen at ``path``: parent created 0750, socket 0660, a stale socket replaced, a live one refused."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        try:
            os.makedirs(parent, exist_ok=True)
            os.chmod(parent, 0o750)
        except OSError as err:
            raise _cannot(err, f"cannot create the socket's directory {parent}: {err.strerror}; create it, or set "
                               "socket in the config to a path under a writable directory "
                               "(pled.service uses /run/pled)") from err
    check_directory(parent)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise SocketInUse(f"{path} exists and is not a socket; remove it or set another socket in the config")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale socket %s left by a daemon that is gone", path)
            os.unlink(path)
        except OSError as err:
            raise SocketInUse(f"{path} exists and cannot be probed ({err}); remove it if no pled is running") from err
        else:
            who = peer_of(probe)
            raise SocketInUse(f"another pled is serving at {path} (pid {who.pid}); stop it first or set another socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
    old = os.umask(0o117)  # 0660 from the start: no window in which anyone else could connect
    try:
        sock.bind(path)
    except OSError as err:
        sock.close()
        hint = ("free space (or inodes) there" if err.errno in (errno.ENOSPC, errno.EDQUOT)
                else f"check that uid {os.geteuid()} may write {parent}")
        raise _cannot(err, f"cannot create socket {path}: {err.strerror or err}; {hint}, "
                           "or set socket elsewhere in the config") from err
    finally:
        os.umask(old)
    sock.listen(socket.SOMAXCONN)
    return sock
