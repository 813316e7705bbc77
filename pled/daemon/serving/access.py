"""Who is on the other end of a connection, and may they have the tables.

Everything a decision rests on comes from the kernel at connect time: SO_PEERCRED (pid, uid, gid)
and SO_PEERGROUPS (the supplementary groups). /proc is read only for the command line shown in logs;
the peer may have exited, or /proc may hide it (ProtectProc=), and that changes no decision.
"""
from __future__ import annotations

import array
import bisect
import errno
import logging
import os
import socket
import struct
from dataclasses import dataclass

from pled.shared.boundary import printable

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+; Python's socket module may lack the name
_GID_SIZE = 4  # gid_t
_PY_MAX_BUFLEN = 1024  # socket.getsockopt refuses larger buffers: 256 groups
NGROUPS_MAX = 65536
COMMAND_READ = 4096  # bytes of a peer's /proc/PID/cmdline read for the 120 characters a log line shows


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]  # primary and supplementary
    command: str

    def describe(self) -> str:
        return f"pid {self.pid} uid {self.uid} ({self.command})"


def _gids(raw: bytes) -> set[int]:
    a = array.array("I")
    a.frombytes(raw[: len(raw) - len(raw) % _GID_SIZE])
    return set(a)


def peer_groups(sock: socket.socket) -> set[int]:
    """SO_PEERGROUPS: the peer's supplementary groups as they were when it connected.

    The kernel answers ERANGE when the buffer is too small; we retry with a larger one. Python's
    getsockopt takes at most 1024 bytes (256 groups), so a peer in more groups than that is read
    with libc's getsockopt, which also tells us the size needed.
    """
    size = 64 * _GID_SIZE
    while size <= _PY_MAX_BUFLEN:
        try:
            return _gids(sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size))
        except OSError as err:
            if err.errno != errno.ERANGE:
                raise
            size *= 4
    return _peer_groups_libc(sock.fileno())


def _peer_groups_libc(fd: int) -> set[int]:
    import ctypes  # only for a peer in more than 256 groups

    libc = ctypes.CDLL(None, use_errno=True)
    length = ctypes.c_uint32(NGROUPS_MAX * _GID_SIZE)
    while True:
        buf = ctypes.create_string_buffer(length.value)
        if libc.getsockopt(fd, socket.SOL_SOCKET, SO_PEERGROUPS, buf, ctypes.byref(length)) == 0:
            return _gids(buf.raw[: length.value])
        err = ctypes.get_errno()
        if err != errno.ERANGE:
            raise OSError(err, os.strerror(err))
        # ERANGE: the kernel wrote the length it needs into `length`; try again with that


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(COMMAND_READ).split(b"\0")  # a prefix: an argv of megabytes costs the loop nothing
        # one line, every control character escaped (ESC, BEL, U+2028...): a process title is the peer's to set
        text = printable(" ".join(" ".join(a.decode(errors="replace").split()) for a in argv if a))
        return (text[:117] + "...") if len(text) > 120 else (text or "?")
    except OSError:
        return "?"


def peer_of(sock: socket.socket) -> Peer:
    """SO_PEERCRED and SO_PEERGROUPS: the kernel's word on who connected, not the peer's."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return Peer(pid, uid, gid, frozenset(peer_groups(sock) | {gid}), _command(pid))


def unmapped_ids(kind: str, ids, proc: str = "/proc/self") -> set[int]:
    """Those of ``ids`` (uids or gids) that this process's user namespace does not map: a peer with one of
    them shows as the overflow id 65534 in SO_PEERCRED/SO_PEERGROUPS. Sorted once, each of the map's few ranges
    then a slice found by bisection: a reload's 110,000 allow_uids cost the loop 100 ms one at a time."""
    try:
        with open(f"{proc}/{kind}_map", encoding="ascii") as f:
            ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
    except (OSError, ValueError):
        return set()
    left = sorted(set(ids))
    for inside, _, count in ranges:
        lo, hi = bisect.bisect_left(left, inside), bisect.bisect_left(left, inside + count)
        if lo < hi:
            del left[lo:hi]
    return set(left)


@dataclass(frozen=True)
class Policy:
    """Root, pled's own user, and members of pled's own group (the socket's group, which its 0660 mode
    already lets in) may attach; allow_uids and allow_gids widen that."""
    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()
    own_uid: int = -1
    own_gid: int = -1

    @classmethod
    def for_this_process(cls, allow_uids, allow_gids) -> Policy:
        for kind, ids in (("uid", allow_uids), ("gid", allow_gids)):
            unmapped = sorted(unmapped_ids(kind, ids))
            if unmapped:
                log.warning("allow_%ss %s: not mapped in pled's user namespace (PrivateUsers=yes), so such "
                            "clients show as 65534 and cannot be admitted; put them in group %d, or set "
                            "PrivateUsers=no in a drop-in",
                            "group" if kind == "gid" else kind, ", ".join(map(str, unmapped)), os.getegid())
        return cls(frozenset(allow_uids), frozenset(allow_gids), os.geteuid(), os.getegid())

    def allows(self, peer: Peer) -> bool:
        return (
            peer.uid == 0
            or peer.uid == self.own_uid
            or peer.uid in self.allow_uids
            or self.own_gid in peer.groups
            or bool(peer.groups & self.allow_gids)
        )
