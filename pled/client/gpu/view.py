"""``device_view``: a slice of pled's mapping as the CPU tensor a seam hands vLLM, readable by the GPU through the
route chosen for its table and device; ``guard_uva``: vLLM's UVA helper kept from copying pled's pages.

Both seams (PLE: pled.client.ple_seams, Engram: pled.client.engram_seams) call these and nothing else of the GPU
side. The tensor's storage is pled's mapping at the slice's first row (no copy); its owner (a numpy array over the
mapping) carries the registration, released by a finalizer when the tensor is collected.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import warnings
import weakref

from pled.client import held_files
from pled.client.gpu import cuda, routes
from pled.client.gpu.probe import probe
from pled.client.gpu.routes import NAMES, NoRoute
from pled.client.held_files import PledUnavailable

_lock = threading.Lock()
_views: dict[int, tuple[int, int, str]] = {}  # id(owner) -> (start, end, route) of each live view
_said_no_cuda = False


def rank() -> str:
    """This process's rank in torch.distributed where it is set up, else its RANK, else its pid."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except Exception:  # noqa: BLE001 (a rank is only for the log line)
        pass
    return os.environ.get("RANK") or f"pid {os.getpid()}"


def cpu_view(table, array, lo: int, hi: int):
    """(tensor, owner): rows [lo, hi) of ``array`` as a CPU tensor whose storage starts at row lo of the mapping."""
    import numpy as np
    import torch

    from pled.client.mapped_table import torch_dtype

    row = array.row_bytes
    if not 0 <= lo <= hi <= array.shape[0]:
        raise PledUnavailable(f"pled: rows {lo}..{hi} are outside {array.prefix}.{array.param}'s {array.shape[0]} "
                              f"rows (table {table.name})")
    owner = np.frombuffer(table.buffer, dtype=np.uint8, count=(hi - lo) * row, offset=array.offset + lo * row)
    with warnings.catch_warnings():  # the buffer is read-only on purpose: the mapping is PROT_READ
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(owner).view(torch_dtype(array.dtype)).reshape(hi - lo, *array.shape[1:])
    return tensor, owner


def device_view(table, array, lo: int, hi: int, *, what: str):
    """Rows [lo, hi) of ``array`` (of ``table``) as the CPU tensor the seam hands vLLM, made readable by the GPU;
    NoRoute where no route works (see pled.client.gpu.routes)."""
    global _said_no_cuda
    tensor, owner = cpu_view(table, array, lo, hi)
    rt = cuda.runtime()
    nbytes = (hi - lo) * array.row_bytes
    if rt is None:
        if not _said_no_cuda:
            _said_no_cuda = True
            held_files.emit(logging.INFO, "pled: no CUDA in this process (pid %d): pled's tables are handed over as "
                            "plain CPU views, nothing registered", os.getpid())
        return tensor
    device = rt.device()
    p = probe(rt, device)
    start = time.perf_counter()
    taken = routes.take(rt, p, table, owner, tensor.data_ptr(), nbytes, what)
    if getattr(table, "writer", False):
        table.protect()  # a writer reads through the GPU like everyone else: read-only here from now on
    if taken.registered is not None and not tensor.is_pinned():
        del tensor, owner  # the finalizer unregisters what was registered
        raise NoRoute(f"pled: {what} is not pinned after cudaHostRegister ({NAMES[taken.route]}) on device {device} "
                      f"({p.name}); PLED_FALLBACK=disk lets vLLM make its private pinned copy")
    seconds = time.perf_counter() - start
    with _lock:
        _views[id(owner)] = (tensor.data_ptr(), tensor.data_ptr() + nbytes, taken.route)
    weakref.finalize(owner, _forget, id(owner)).atexit = False
    from pled.shared.sizes import gib

    writable = " (the table is writable by its writers: gpu_access = \"writable\")" \
        if getattr(table, "gpu_access", "read-only") == "writable" else ""
    held_files.emit(logging.INFO, "pled: rank %s: %s: %s on device %d (%s), %s (%d bytes) in %.3f s, no copy%s",
                    rank(), what, NAMES[taken.route], device, p.name, gib(nbytes), nbytes, seconds, writable)
    return tensor


def _forget(key: int) -> None:
    with _lock:
        _views.pop(key, None)


def route_of(ptr: int) -> str | None:
    """The route of the live device view that holds ``ptr`` (None: none does)."""
    with _lock:
        for start, end, route in _views.values():
            if start <= ptr < end:
                return route
    return None


def guard_uva(original):
    """Wrap a module's ``get_accelerator_view_from_cpu_tensor``: for a view of pled's pages, what its route allows
    (registered: the original's zero-copy view of the pinned tensor; pageable: a device tensor at the same address);
    never the helper's private copy of pled's pages (PledUnavailable naming the slice instead)."""
    if getattr(original, "__pled__", False):
        return original

    def get_accelerator_view_from_cpu_tensor(tensor, *args, **kwargs):
        st = held_files.current()
        if st is None or st.holding(tensor.data_ptr()) is None:
            return original(tensor, *args, **kwargs)
        route = route_of(tensor.data_ptr())
        if route == "pageable":
            return cuda.runtime().device_alias(tensor)  # the host address is the device address: no copy
        if not tensor.is_pinned():
            raise PledUnavailable(f"pled: refusing vLLM's UVA view of a pled table's {tuple(tensor.shape)} "
                                  f"{tensor.dtype} slice that is not pinned: the helper would make a private pinned "
                                  "copy of it (was its registration released?)")
        return original(tensor, *args, **kwargs)

    get_accelerator_view_from_cpu_tensor.__wrapped__ = original
    get_accelerator_view_from_cpu_tensor.__pled__ = True
    return get_accelerator_view_from_cpu_tensor
