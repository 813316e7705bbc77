"""The fifth attack on the writable route: more ways a non-writer (a uid in pled's group, not in `writers`) might
write a writable table, beyond tests/test_writable_route.py's nine: through /proc/self/mem (the kernel's forced
write, which breaks copy-on-write for ptrace), process_vm_writev into its own read-only mapping, MADV_REMOVE (a hole
punched through the mapping), fallocate's PUNCH_HOLE through the fd, and a MAP_PRIVATE writable mapping (a private
copy: the table itself must not change). Each attempt in a real process of that uid; the table's bytes compared
before and after by root's own attach. These held: regression tests."""
import ctypes
import encodings.ascii  # noqa: F401 (a forked child that dropped root cannot import from root's Python any more)
import mmap
import os

import pytest

from pled import client
from test_writable_route import as_other, offset_of, served  # noqa: F401 (served: the fixture)

pytestmark = [pytest.mark.root, pytest.mark.daemon]
libc = ctypes.CDLL(None, use_errno=True)


def proc_self_mem(t):
    libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: as a process started as this uid is (the fork dropped root)
    fd = os.open("/proc/self/mem", os.O_RDWR)
    try:
        return os.pwrite(fd, b"\x55", t.address + offset_of(t))
    finally:
        os.close(fd)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def process_vm_writev(t):
    byte = ctypes.create_string_buffer(b"\x55", 1)
    local, remote = _IoVec(ctypes.addressof(byte), 1), _IoVec(t.address + offset_of(t), 1)
    libc.process_vm_writev.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                                       ctypes.c_ulong, ctypes.c_ulong)
    n = libc.process_vm_writev(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if n < 0:
        raise OSError(ctypes.get_errno(), "process_vm_writev")
    return n


def madv_remove(t):
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(t.address, mmap.PAGESIZE, 9) != 0:  # MADV_REMOVE
        raise OSError(ctypes.get_errno(), "madvise")


def punch_hole(t):
    libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
    if libc.fallocate(t.fd, 0x02 | 0x01, 0, mmap.PAGESIZE) != 0:  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        raise OSError(ctypes.get_errno(), "fallocate")


def private_copy(t):
    m = mmap.mmap(t.fd, len(t.buffer), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    m[offset_of(t)] = (m[offset_of(t)] + 1) % 256  # its own copy of the page
    m.close()
    return "private"


ROUTES = {"/proc/self/mem": (proc_self_mem, ("refused EIO", "refused EFAULT")),
          "process_vm_writev": (process_vm_writev, ("refused EFAULT",)),
          "MADV_REMOVE": (madv_remove, ("refused EACCES",)),
          "PUNCH_HOLE": (punch_hole, ("refused EBADF",)),
          "MAP_PRIVATE": (private_copy, ("done: private",))}


@pytest.mark.parametrize("route", ROUTES)
def test_a_non_writer_cannot_change_the_table_by_these_routes_either(served, route):  # noqa: F811
    attempt, expected = ROUTES[route]
    before = client.attach("t", socket=served, populate=False)
    data = bytes(before.buffer)
    said = as_other(served, attempt)
    assert said in expected, said
    after = client.attach("t", socket=served, populate=False)
    assert bytes(after.buffer) == data and os.fstat(after.fd).st_size == len(data)
    before.close(), after.close()
