"""Who is on the other end of a connection, and may they have the tables."""
from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]  # primary and supplementary
    command: str

    def describe(self) -> str:
        return f"pid {self.pid} uid {self.uid} ({self.command})"


def _proc_groups(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass  # the peer has exited; its primary gid is still known from SO_PEERCRED
    return set()


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        text = " ".join(" ".join(a.decode(errors="replace").split()) for a in argv if a)  # one line, for logs
        return (text[:117] + "...") if len(text) > 120 else (text or "?")
    except OSError:
        return "?"


def peer_of(sock: socket.socket) -> Peer:
    """SO_PEERCRED: the kernel's word on who connected, not the peer's."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return Peer(pid, uid, gid, frozenset(_proc_groups(pid) | {gid}), _command(pid))


@dataclass(frozen=True)
class Policy:
    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()
    own_uid: int = -1

    @classmethod
    def for_this_process(cls, allow_uids, allow_gids) -> "Policy":
        return cls(frozenset(allow_uids), frozenset(allow_gids), os.geteuid())

    def allows(self, peer: Peer) -> bool:
        return (
            peer.uid == 0
            or peer.uid == self.own_uid
            or peer.uid in self.allow_uids
            or bool(peer.groups & self.allow_gids)
        )
