"""Writable tensors over a table's sealed pages, as safetensors hands them out: copy-on-write, never a copy up front.

safetensors' ``get_tensor`` returns a tensor the caller may write into: for "pt" with its "mmap" backend, a view
of the file mapped privately (one mapping per handle: a write shows in that handle's later tensors, in no other
handle, never in the file); otherwise a copy of its own. pled's stand-in (pled.client.safe_open_seam) and vLLM's
weight iterator (pled.client.vllm_plugin) give the same: each view lies in a ``PrivateMapping``, a MAP_PRIVATE
mapping (read and write) of part of the table's memfd. Reading maps pled's pages (no copy: the memfd is sealed,
and a private mapping of it reads the same pages every client shares); a write gives that page, and only it, a
private copy in this process: pled's pages, and every other process's, stay as they were (the kernel's
copy-on-write; a sealed memfd refuses only shared writable mappings).

``unwritten(ptr, nbytes)`` tells, from /proc/self/pagemap, whether any page of a range of a private mapping was
written here (its page then is this process's own, not the memfd's): pled.client.ple_seams' compare-only loader
takes an unwritten view of the same rows of the same table as the rows themselves, without reading them.

On reserved huge pages (hugetlb) a private mapping reserves nothing (MAP_NORESERVE): a write into it needs a free
huge page for its copy, and without one the kernel ends the process with SIGBUS.
"""
from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np

MAP_NORESERVE = 0x4000  # Linux's, on every architecture pled runs on; Python's mmap module does not name it
PAGEMAP = "/proc/self/pagemap"
_PRESENT, _SWAPPED, _FILE = 1 << 63, 1 << 62, 1 << 61  # pagemap's flags (Documentation/admin-guide/mm/pagemap.rst)
_lock = threading.Lock()
_live: dict[int, tuple[int, int, Any, int]] = {}  # key -> (address, length, table, offset in the region)
_keys = itertools.count()


class PrivateMapping:
    """Bytes ``[lo, hi)`` of ``table``'s region (page-rounded outward), mapped copy-on-write in this process."""

    def __init__(self, table, lo: int, hi: int) -> None:
        page = _alignment(table)
        start = lo - lo % page
        end = min(-(-max(hi, lo + 1) // page) * page, os.fstat(table.fd).st_size)
        self.table, self.start = table, start
        self._map = mmap.mmap(table.fd, end - start, flags=mmap.MAP_PRIVATE | MAP_NORESERVE,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        self.address = int(np.frombuffer(self._map, dtype=np.uint8, count=1).ctypes.data)
        key = next(_keys)
        with _lock:
            _live[key] = (self.address, end - start, table, start)
        # the mapping lives while a view does (each view's numpy array holds it): so does what origin() knows of it
        weakref.finalize(self._map, _forget, key)

    def bytes(self, offset: int, nbytes: int) -> np.ndarray:
        """``nbytes`` at region offset ``offset``: a writable uint8 array that keeps the mapping while it lives."""
        return np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=offset - self.start)

    def tensor(self, entry, file_shape: bool = False):
        """``entry`` (a region.TensorEntry) as a writable tensor in this mapping: shaped as Table.view shapes it,
        or with ``file_shape`` as Table.file_view does (an F4 tensor in the file's shape, which torch refuses)."""
        import torch

        from pled.client.tensor_views import torch_dtype

        dtype = torch_dtype(entry.dtype)
        shape = tuple(entry.shape)
        if entry.dtype == "F4" and not file_shape:  # two values a byte: safetensors halves the last dimension
            shape = shape[:-1] + (shape[-1] // 2,)
        if not entry.nbytes:
            return torch.empty(0, dtype=torch.uint8).view(dtype).reshape(shape) if file_shape else \
                torch.empty(shape, dtype=dtype)
        return torch.from_numpy(self.bytes(entry.offset, entry.nbytes)).view(dtype).reshape(shape)

    def array(self, entry) -> np.ndarray:
        """``entry`` as a writable numpy array in this mapping (Table.array's dtype and shape)."""
        from pled.client.tensor_views import numpy_dtype

        dtype = numpy_dtype(entry.dtype)
        if not entry.nbytes:
            return np.zeros(entry.shape, dtype=dtype)
        return self.bytes(entry.offset, entry.nbytes).view(dtype).reshape(entry.shape)


def _alignment(table) -> int:
    """The offset a mapping of the table's memfd must start at a multiple of: its huge page size for hugetlb."""
    from pled.shared.pagecache import is_hugetlb, page_size

    return page_size(table.fd) if is_hugetlb(table.fd) else mmap.ALLOCATIONGRANULARITY


def _forget(key: int) -> None:
    with _lock:
        _live.pop(key, None)


def origin(ptr: int) -> tuple[Any, int] | None:
    """(table, offset in its region) of an address in a live private mapping; None elsewhere."""
    with _lock:
        for address, length, table, start in _live.values():
            if address <= ptr < address + length:
                return table, start + ptr - address
    return None


def same_rows(table, source, target) -> bool:
    """Whether tensor ``source`` is tensor ``target``'s own bytes in ``table``, without reading them: the same address
    (a view of pled's shared mapping), or a view in a private mapping of the same table at the same offset (what
    pled's safe_open and vLLM's iterator hand out) none of whose pages this process has written. The compare-only
    loaders (pled.client.ple_seams, engram_seams) read the rows only where this says no."""
    if source.stride() != target.stride():
        return False
    if source.data_ptr() == target.data_ptr():
        return True
    found = origin(source.data_ptr())
    if found is None or found[0] is not table or found[1] != target.data_ptr() - table.address:
        return False
    return source.is_contiguous() and unwritten(source.data_ptr(), source.numel() * source.element_size())


def unwritten(ptr: int, nbytes: int) -> bool:
    """Whether no page of ``[ptr, ptr + nbytes)`` is this process's own copy (written, or swapped out: only a
    written page of a private mapping is anonymous memory); False where the kernel does not say (no pagemap)."""
    if nbytes <= 0:
        return True
    page = mmap.PAGESIZE
    first, last = ptr // page, (ptr + nbytes - 1) // page
    try:
        fd = os.open(PAGEMAP, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        want = (last - first + 1) * 8
        raw = os.pread(fd, want, first * 8)
    except OSError:
        return False
    finally:
        os.close(fd)
    if len(raw) != want:
        return False
    flags = np.frombuffer(raw, dtype=np.uint64)
    own = ((flags & np.uint64(_PRESENT)) != 0) & ((flags & np.uint64(_FILE)) == 0) | \
        ((flags & np.uint64(_SWAPPED)) != 0)
    return not bool(own.any())
