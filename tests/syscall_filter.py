"""Run a command with some system calls refused with EPERM, as systemd's ``SystemCallFilter=`` (with
``SystemCallErrorNumber=EPERM``) or a container runtime's seccomp profile refuses them: a seccomp filter installed in
this process, kept across exec and by every thread and child of the command.

    python tests/syscall_filter.py mbind,set_mempolicy -- COMMAND ARG...
    Daemon(cfg, prefix=syscall_filter.prefix(["mbind", "set_mempolicy"]))    # in a test (tests/harness.py)

Standard library only: ``prctl(PR_SET_NO_NEW_PRIVS)`` (no root needed), then ``prctl(PR_SET_SECCOMP,
SECCOMP_MODE_FILTER)`` with a classic BPF program built here (linux/seccomp.h, linux/filter.h), no libseccomp.
The program: a call of another architecture (audit arch) is allowed, a call named here answers EPERM, every other
call is allowed.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys

# (audit arch, {name: number}) per machine: linux/audit.h, and the syscall tables (x86-64's own; the generic one).
TABLES = {
    "x86_64": (0xC000003E, {"mbind": 237, "set_mempolicy": 238, "get_mempolicy": 239}),
    "aarch64": (0xC00000B7, {"mbind": 235, "get_mempolicy": 236, "set_mempolicy": 237}),
}
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
OFFSET_NR, OFFSET_ARCH = 0, 4  # struct seccomp_data: int nr; __u32 arch; ...


class Unsupported(Exception):
    """This machine's system call numbers are not in TABLES."""


def numbers(names: list[str]) -> tuple[int, list[int]]:
    machine = platform.machine()
    if machine not in TABLES:
        raise Unsupported(f"no system call table here for {machine}")
    arch, table = TABLES[machine]
    return arch, [table[n] for n in names]


def program(arch: int, refused: list[int]) -> bytes:
    """The filter, one ``struct sock_filter`` (u16 code, u8 jt, u8 jf, u32 k) after another."""
    n = len(refused)
    ops = [(BPF_LD_W_ABS, 0, 0, OFFSET_ARCH),
           (BPF_JEQ_K, 0, n + 1, arch),  # another architecture: to ALLOW
           (BPF_LD_W_ABS, 0, 0, OFFSET_NR)]
    ops += [(BPF_JEQ_K, n - i, 0, nr) for i, nr in enumerate(refused)]  # a refused one: to ERRNO
    ops += [(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW), (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM)]
    return b"".join(struct.pack("=HBBI", *op) for op in ops)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(names: list[str]) -> None:
    """From now on, in this process and all it starts, the calls ``names`` fail with EPERM."""
    arch, refused = numbers(names)
    code = program(arch, refused)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    calls = ((PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), (PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0))
    for args in calls:
        if libc.prctl(*[ctypes.c_ulong(a) for a in args]) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl({args[0]}): {os.strerror(err)}")


def prefix(names: list[str]) -> list[str]:
    """An argv prefix that runs the rest under the filter (tests/harness.py's ``prefix=``)."""
    numbers(names)  # Unsupported here, not in the child
    return [sys.executable, os.path.abspath(__file__), ",".join(names), "--"]


if __name__ == "__main__":
    names, sep, *command = sys.argv[1:]
    if sep != "--" or not command:
        sys.exit("usage: syscall_filter.py NAME[,NAME...] -- COMMAND [ARG...]")
    install(names.split(","))
    os.execvp(command[0], command)
