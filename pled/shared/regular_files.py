"""Opening what must be a regular file on disk, and reading a small one whole, without ever blocking on a FIFO,
opening a device or reading /proc and /sys (pled.shared.boundary's docstring: ``open_regular``, ``read_bounded``)."""
from __future__ import annotations

import os
import stat

from pled.shared.boundary_error import BoundaryError

_SPECIAL_ROOTS = ("/proc", "/sys")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a Unix socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _special_devs() -> set[int]:
    devs = set()
    for root in _SPECIAL_ROOTS:
        try:
            devs.add(os.stat(root).st_dev)
        except OSError:
            pass
    return devs


def check_regular(st: os.stat_result) -> None:
    """Refuse anything but a regular file on a real file system."""
    if not stat.S_ISREG(st.st_mode):
        raise BoundaryError(f"is {_kind(st.st_mode)}, not a regular file")
    if st.st_dev in _special_devs():
        raise BoundaryError("is a /proc or /sys file, not a file on disk")


def describe_os_error(err: OSError) -> str:
    return {
        "ELOOP": "is a symlink loop (too many levels of symbolic links)",
        "ENOENT": "no such file",
        "EACCES": "cannot be read (permission denied); give pled's user read access",
        "EPERM": "cannot be read (operation not permitted); give pled's user read access",
        "ENXIO": "is a Unix socket or a device without a reader, not a regular file",
        "ENOTDIR": "a component of its path is not a directory",
        "ENAMETOOLONG": "its path is too long",
        "EISDIR": "is a directory, not a regular file",
    }.get(_errno_name(err), f"cannot be opened ({err.strerror or err})")


def _errno_name(err: OSError) -> str:
    import errno

    return errno.errorcode.get(err.errno or 0, "")


def open_regular(path: str) -> int:
    """An fd (O_RDONLY, O_CLOEXEC) of the regular file at ``path``; BoundaryError says why not.
    The caller closes it. Never blocks: FIFOs, sockets and devices are refused before or without waiting."""
    if "\0" in path:
        raise BoundaryError("its path contains a NUL byte")
    try:
        check_regular(os.stat(path))  # never open a device or a FIFO at all: opening some has effects
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as err:
        raise BoundaryError(describe_os_error(err)) from err
    try:
        check_regular(os.fstat(fd))  # swapped between the stat and the open
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(path: str, limit: int, what: str = "file") -> bytes:
    """The whole of a small regular file, refused if it holds more than ``limit`` bytes."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise BoundaryError(f"is {size} bytes; a {what} may have at most {limit}")
        chunks, total = [], 0
        while True:
            try:
                chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            except OSError as err:
                raise BoundaryError(f"cannot be read ({err.strerror or err})") from err
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise BoundaryError(f"holds more than {limit} bytes; a {what} may have at most {limit}")
        return b"".join(chunks)
    finally:
        os.close(fd)
