"""A container made with unshare(2), the way a rootless runtime makes one, running a pled client.

    python nscontainer.py --uid-base 100000 --groups 4242 --socket-dir DIR --table NAME --rows 0,7,...

No runtime and no image: this script is the runtime. As host root it forks a child that
unshares user, mount, network and PID namespaces at once (the user namespace owns the
others, as with podman rootless); this process then writes the child's uid_map and
gid_map ("0 BASE 65536", what newuidmap writes from /etc/subuid), so the container's
root is host uid BASE. The child opens DIR while still host root, becomes the container's
root, mounts a tmpfs on /run and binds DIR read-only at /run/pled (the socket directory
mounted into the container), and forks the container's PID 1, which mounts
its own /proc and runs the client with PLED_SOCKET=/run/pled/pled.sock.

Supplementary groups given with --groups are set before unshare and kept across it (they
are not mapped inside, where they show as 65534, but the host's permission checks and
pled still see them): podman's --group-add keep-groups, crun's keep_original_groups.

Everything is imported before the uid changes: the interpreter lives under /root, which
the container's host uid may not read. Each fact is one JSON line on stdout; the client
stays attached until a line arrives on stdin.
"""
from __future__ import annotations

import argparse
import ctypes
import encodings.ascii  # noqa: F401  (codecs are imported lazily; the container's uid could not)
import errno
import hashlib
import json
import os
import socket
import struct
import sys

import torch

from pled import client
from pled.client import gather as _gather  # noqa: F401  (imported now, while the interpreter is readable)

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 16384, 1 << 18, 1 << 21
ST_RELATIME = 4096  # statvfs's flag for relatime (the others share MS_ values)
IN_CONTAINER_SOCKET = "/run/pled/pled.sock"

_libc = ctypes.CDLL(None, use_errno=True)


def say(**fact) -> None:
    sys.stdout.write(json.dumps(fact) + "\n")
    sys.stdout.flush()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _bind_readonly(source_fd: int, target: str) -> None:
    _mount(f"/proc/self/fd/{source_fd}", target, None, MS_BIND)
    # A remount in a user namespace must keep the flags it inherited locked from the host's mount.
    f = os.fstatvfs(source_fd).f_flag
    kept = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME) | (MS_RELATIME if f & ST_RELATIME else 0)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def _peer_of_daemon(path: str) -> dict:
    """What SO_PEERCRED says about pled, seen from inside the container's namespaces."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        pid, uid, gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return {"pid": pid, "uid": uid, "gid": gid}
    finally:
        s.close()


def container_main(args) -> int:
    """PID 1 of the container: report what it is, attach, gather, hold until told."""
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    try:
        open("/run/pled/probe", "w").close()
        writable = "yes"
    except OSError as err:
        writable = errno.errorcode.get(err.errno, str(err.errno))
    say(container={
        "pid": os.getpid(), "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
        "uid_map": " ".join(open("/proc/self/uid_map").read().split()),
        "interfaces": [name for _, name in socket.if_nameindex()],
        "socket_dir_write": writable, "processes": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    })
    os.environ[client.ENV_SOCKET] = IN_CONTAINER_SOCKET  # as the deploy recipes set it
    try:
        table = client.attach(args.table)  # the socket from $PLED_SOCKET, pre-faulted
    except client.PermissionDenied as err:
        say(refused=str(err))
        return 0
    with table:
        torch.set_num_threads(1)
        rows = torch.tensor([int(r) for r in args.rows.split(",")])
        out = table.gather(rows)
        say(attached={
            "generation": table.generation, "residency": table.residency(),
            "gathered": hashlib.sha256(out.float().numpy().tobytes()).hexdigest(),
            "daemon_seen_as": _peer_of_daemon(IN_CONTAINER_SOCKET),
        })
        sys.stdin.readline()  # attached until the test has looked at `pled status`
    return 0


def runtime_child(args, ready_w: int, go_r: int) -> int:
    """The runtime's side inside the new namespaces: mounts, then become the container's root, then PID 1."""
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare")
    os.write(ready_w, b"u")
    if os.read(go_r, 1) != b"m":
        return 1  # the maps could not be written
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    # The socket directory is opened (in this mount namespace) while this process is still host root
    # for the file system: the container's uid may not walk the host path to it (pytest's is 0700 root).
    source_fd = os.open(args.socket_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)  # container root: host uid BASE from here on, with every capability in its namespaces
    # (after which the container's own files get an owner mapped inside; made before, they would not)
    _mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
    os.mkdir("/run/pled")
    _bind_readonly(source_fd, "/run/pled")
    os.close(source_fd)
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(container_main(args))
        except BaseException as err:  # the test reads this line; the traceback goes to stderr
            say(error=f"{type(err).__name__}: {err}")
            raise
    say(host_pid=pid)  # fork() answers in the PID namespace this process is in: the host's
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--uid-base", type=int, required=True)
    p.add_argument("--groups", default="", help="supplementary gids kept across the user namespace")
    p.add_argument("--socket-dir", required=True)
    p.add_argument("--table", required=True)
    p.add_argument("--rows", default="0")
    args = p.parse_args()
    os.setgroups([int(g) for g in args.groups.split(",") if g])
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r), os.close(go_w)
        try:
            os._exit(runtime_child(args, ready_w, go_r))
        except BaseException as err:
            say(error=f"{type(err).__name__}: {err}")
            os._exit(1)
    os.close(ready_w), os.close(go_r)
    if os.read(ready_r, 1) != b"u":
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) or 1
    mapping = f"0 {args.uid_base} 65536\n"
    try:
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(mapping)
    except OSError as err:
        say(error=f"cannot write the container's id maps: {err}")
        os.close(go_w)
    else:
        os.write(go_w, b"m")
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
