"""CUDA for bench/device/check.py and its children: pled's registration seam over a mapped table, the device
pointer of registered (or pinned) host memory, a torch tensor over it, and vLLM's private pinned copy.

- Registration goes through pled's one seam, ``pled.client.gpu.registry.register`` (cudaHostRegister with
  Mapped|ReadOnly over the page-rounded range, released by a finalizer when the owner goes), exactly as the vLLM
  plugin's ``_pinned_view`` uses it: a numpy owner over the read-only mapping, a CPU tensor over that, registered,
  ``is_pinned()`` checked.
- The device pointer is ``cudaHostGetDevicePointer`` through libcudart by ctypes (the libcudart torch loaded, as
  pled.client.gpu.cuda finds it), as vLLM's ``get_accelerator_view_from_cpu_tensor`` takes it for a pinned tensor; the
  tensor over it is made by ``torch.as_tensor`` from a ``__cuda_array_interface__`` (no copy: its data_ptr is
  checked to be the device pointer), and holds the host owner alive.
- Upstream's private copy: ``torch.empty(n, pin_memory=True)`` and ``copy_`` from the mapping, then its device
  pointer the same way (what vLLM 0.33's ``allocate_embedding_weight`` and loader do at every start).
"""
from __future__ import annotations

import ctypes
import gc
import time
import warnings

import numpy as np

from pled.client import gpu
from pled.client.gpu import registry

ATTR_CAN_USE_HOST_POINTER = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem


class CudaError(RuntimeError):
    pass


class Cuda:
    """This process's CUDA: torch, its libcudart, the current device (a context made on construction)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        torch.zeros(1, device="cuda")  # the primary context, before anything is timed
        self.rt = gpu.runtime()
        self.lib = self.rt.libcudart()  # the libcudart torch loaded (pled.client.gpu.cuda's lookup)
        self.lib.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                                      ctypes.c_uint]
        self.lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.lib.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        self.device = self.rt.device()
        self.views: dict[str, int] = {}  # how the CUDA views were made, and how many

    def attribute(self, attr: int) -> int:
        value = ctypes.c_int(0)
        code = self.lib.cudaDeviceGetAttribute(ctypes.byref(value), attr, self.device)
        if code:
            raise CudaError(f"cudaDeviceGetAttribute({attr}) failed: {self.rt.error(code)}")
        return value.value

    def versions(self) -> dict:
        driver, runtime = ctypes.c_int(0), ctypes.c_int(0)
        self.lib.cudaDriverGetVersion(ctypes.byref(driver))
        self.lib.cudaRuntimeGetVersion(ctypes.byref(runtime))
        props = self.torch.cuda.get_device_properties(self.device)
        out = {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "gpu_memory": props.total_memory,
               "cuda_driver": driver.value, "cuda_runtime": runtime.value}
        asks = {"read_only_registration_supported": lambda: bool(self.rt.attribute(self.device, 113)),
                "can_use_host_pointer_for_registered_mem": lambda: self.attribute(ATTR_CAN_USE_HOST_POINTER)}
        for key, ask in asks.items():
            try:
                out[key] = ask()
            except RuntimeError as err:  # gpu.RegistrationError, CudaError: said, not fatal
                out[key] = f"unknown: {err}"
        return out

    def device_pointer(self, host: int) -> int:
        out = ctypes.c_void_p()
        code = self.lib.cudaHostGetDevicePointer(ctypes.byref(out), ctypes.c_void_p(host), 0)
        if code:
            raise CudaError(f"cudaHostGetDevicePointer({host:#x}) failed: {self.rt.error(code)}")
        return int(out.value or 0)

    def device_tensor(self, host: int, nbytes: int, keep: object):
        """A uint8 CUDA tensor of ``nbytes`` over registered or pinned host memory at ``host``; ``keep`` lives
        as long as it does. By ``__cuda_array_interface__``; where torch will not view it so, by CuPy and DLPack
        (``self.views`` counts which)."""
        ptr = self.device_pointer(host)
        try:
            t = self.torch.as_tensor(_Interface(ptr, nbytes, keep), device=f"cuda:{self.device}")  # its own: no copy
            why = "" if t.data_ptr() == ptr else "torch.as_tensor copied it"
        except (RuntimeError, TypeError, ValueError) as err:
            why = f"torch.as_tensor refused it: {err}"
        if why:
            import cupy

            memory = cupy.cuda.UnownedMemory(ptr, nbytes, keep, self.device)
            array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
            t = self.torch.from_dlpack(array)
        how = f"cupy and DLPack ({why})" if why else "__cuda_array_interface__"
        self.views[how] = self.views.get(how, 0) + 1
        if t.data_ptr() != ptr:
            raise CudaError(f"the CUDA view of {ptr:#x} is a copy at {t.data_ptr():#x} ({how})")
        return t

    def sync(self) -> None:
        self.torch.cuda.synchronize()


class _Interface:
    """A ``__cuda_array_interface__`` (version 3) over ``nbytes`` bytes at device pointer ``ptr``."""

    def __init__(self, ptr: int, nbytes: int, keep: object) -> None:
        self.keep = keep
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


class Registered:
    """``nbytes`` of a read-only mapping from ``offset``, registered through pled's seam for as long as this
    object (its ``owner`` and ``cpu`` tensor) lives; ``seconds``: the register call's time; ``device()``: the CUDA
    view. ``release()`` drops it and returns the seconds the unregistering took."""

    def __init__(self, cuda: Cuda, mapping, offset: int, nbytes: int, what: str) -> None:
        self.cuda, self.mapping, self.nbytes = cuda, mapping, nbytes
        self.owner = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset)
        with warnings.catch_warnings():  # the buffer is read-only on purpose: the mapping is PROT_READ
            warnings.simplefilter("ignore", UserWarning)
            self.cpu = cuda.torch.from_numpy(self.owner)
        self.host = self.cpu.data_ptr()
        start = time.perf_counter()
        self.key = registry.register(self.cuda.rt, self.owner, mapping, self.host, nbytes, what)
        self.seconds = time.perf_counter() - start
        self.pinned = bool(self.cpu.is_pinned())
        self._device = None

    def device(self):
        if self._device is None:
            self._device = self.cuda.device_tensor(self.host, self.nbytes, self.owner)
        return self._device

    def release(self) -> float:
        """Unregister (the seam's finalizer runs when the owner's last reference goes); the seconds it took, or
        NaN where the owner outlived its last plain reference (a CUDA view in a reference cycle: collected here)
        or something still holds it (then it stays registered)."""
        self._device = None
        start = time.perf_counter()
        del self.cpu, self.owner
        seconds = time.perf_counter() - start
        if self.key in registry.registrations.held:
            gc.collect()
            return float("nan")
        return seconds


def try_register(cuda: Cuda, host: int, nbytes: int, flags: int) -> dict:
    """One raw cudaHostRegister with ``flags`` (undone at once where it succeeds): its code and message."""
    start, length = registry.page_range(host, nbytes)
    code = cuda.rt.register(start, length, flags)
    if code == 0:
        cuda.rt.unregister(start)
        return {"flags": flags, "code": 0, "result": "registered (then unregistered)"}
    cuda.lib.cudaGetLastError()  # clear it, as vLLM's registration does
    return {"flags": flags, "code": code, "result": cuda.rt.error(code)}


class PinnedCopy:
    """vLLM 0.33's private copy of ``nbytes`` of the mapping from ``offset``: torch.empty(pin_memory=True), copy_,
    its device pointer (``alloc_seconds``, ``copy_seconds``)."""

    def __init__(self, cuda: Cuda, mapping, offset: int, nbytes: int) -> None:
        torch = cuda.torch
        source = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset)
        start = time.perf_counter()
        self.cpu = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.alloc_seconds = time.perf_counter() - start
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            start = time.perf_counter()
            self.cpu.copy_(torch.from_numpy(source))
            self.copy_seconds = time.perf_counter() - start
        self.nbytes = nbytes
        self.pinned = bool(self.cpu.is_pinned())
        self._device = cuda.device_tensor(self.cpu.data_ptr(), nbytes, self.cpu)

    def device(self):
        return self._device
