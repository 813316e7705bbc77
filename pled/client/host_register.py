"""A table's pages registered with the GPU: the one seam between pled's mapping and CUDA.

vLLM 0.33 looks its pinned PLE tables up from the GPU through a UVA view (``get_accelerator_view_from_cpu_tensor``),
which takes ``cudaHostGetDevicePointer`` of a pinned tensor and makes a private ``cudaHostAlloc`` copy of any other.
So each rank's slice of a pled region is registered before vLLM sees it: ``cudaHostRegister(ptr, n,
cudaHostRegisterMapped | cudaHostRegisterReadOnly)`` over the page-rounded range that holds it (ReadOnly: the
mapping is PROT_READ), in chunks of at most 64 GiB, released by a finalizer on the tensor's owner
(``weakref.finalize(owner, unregister, mapping, ptr)`` with ``atexit = False``, as vLLM's DPSharedEngramStorage
does), and ``is_pinned()`` checked. A device without read-only registration
(``cudaDevAttrHostRegisterReadOnlySupported`` = 0) gets one clear error; never a silent private copy.

The CUDA calls go through a ``Runtime`` (torch's ``torch.cuda.cudart()``, and libcudart by ctypes for what torch
does not bind). A process without a GPU can install another one with ``use()``: pled's tests do, and say so.
"""
from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
from dataclasses import dataclass, field

MAPPED = 0x02  # cudaHostRegisterMapped
READ_ONLY = 0x08  # cudaHostRegisterReadOnly
FLAGS = MAPPED | READ_ONLY
ATTR_READ_ONLY_SUPPORTED = 113  # cudaDevAttrHostRegisterReadOnlySupported
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
MAX_CHUNK = 64 << 30  # larger registrations fail or cost driver metadata (LMCache #5177, sglang #36798)
PAGE = mmap.PAGESIZE


class RegistrationError(RuntimeError):
    """The GPU would not take a table's pages; the message names the range and the device, and what to do."""


class Runtime:
    """The CUDA runtime calls pled makes, through torch (register, unregister) and libcudart (attributes)."""

    name = "CUDA"

    def __init__(self) -> None:
        import torch

        self._cudart = torch.cuda.cudart()
        self._torch = torch
        self._lib: ctypes.CDLL | None = None

    def device(self) -> int:
        return int(self._torch.cuda.current_device())

    def device_name(self, device: int) -> str:
        return str(self._torch.cuda.get_device_name(device))

    def read_only_supported(self, device: int) -> bool:
        value = ctypes.c_int(0)
        code = self.libcudart().cudaDeviceGetAttribute(ctypes.byref(value), ATTR_READ_ONLY_SUPPORTED, device)
        if code:
            raise RegistrationError(f"cudaDeviceGetAttribute(cudaDevAttrHostRegisterReadOnlySupported) failed on "
                                    f"device {device}: {self.error(code)}")
        return bool(value.value)

    def register(self, ptr: int, nbytes: int, flags: int) -> int:
        return int(self._cudart.cudaHostRegister(ptr, nbytes, flags).value)

    def unregister(self, ptr: int) -> int:
        return int(self._cudart.cudaHostUnregister(ptr).value)

    def error(self, code: int) -> str:
        return f"{self._cudart.cudaGetErrorString(code)} (error {code})"

    def libcudart(self) -> ctypes.CDLL:
        """The libcudart torch loaded (found in /proc/self/maps), else one on the library path."""
        if self._lib is None:
            paths = []
            try:
                with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
                    paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
            except OSError:
                pass
            for candidate in [*paths, "libcudart.so", "libcudart.so.13", "libcudart.so.12"]:
                try:
                    self._lib = ctypes.CDLL(candidate)
                    break
                except OSError:
                    continue
            else:
                raise RegistrationError("cannot load libcudart to ask the device whether it supports read-only host "
                                        "registration")
        return self._lib


_lock = threading.Lock()
_runtime: Runtime | None = None


def use(runtime) -> object:
    """Make ``runtime`` the one this process registers with (tests without a GPU install a fake, and say so);
    returns the one it replaces."""
    global _runtime
    with _lock:
        previous, _runtime = _runtime, runtime
    return previous


def runtime():
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = Runtime()
        return _runtime


@dataclass
class _Held:
    chunks: list[tuple[int, int]]
    users: int = 0


@dataclass
class Registrations:
    """This process's registered ranges, by (start, length): one registration per range whatever the number of
    tensors over it (a second cudaHostRegister of the same pages fails with cudaErrorHostMemoryAlreadyRegistered)."""

    held: dict[tuple[int, int], _Held] = field(default_factory=dict)
    calls: int = 0  # cudaHostRegister calls made (one per chunk)


registrations = Registrations()


def page_range(ptr: int, nbytes: int) -> tuple[int, int]:
    """The whole pages that hold ``[ptr, ptr + nbytes)``: (start, length)."""
    start = ptr - ptr % PAGE
    end = -(-(ptr + max(nbytes, 1)) // PAGE) * PAGE
    return start, end - start


def register(owner: object, mapping: object, ptr: int, nbytes: int, what: str) -> tuple[int, int]:
    """Register the pages under ``[ptr, ptr + nbytes)`` (``what`` names them in errors) for as long as ``owner`` lives
    (``mapping`` is kept alive until they are unregistered). Returns the registered range."""
    rt = runtime()
    device = rt.device()
    if not rt.read_only_supported(device):
        raise RegistrationError(
            f"device {device} ({rt.device_name(device)}) does not support read-only host registration "
            "(cudaDevAttrHostRegisterReadOnlySupported = 0), which pled's sealed, read-only table needs: vLLM would "
            f"make a private pinned copy of {what}; set PLED_FALLBACK=disk (\"fallback\": \"disk\") to let it, or "
            "run on a GPU and driver that support it")
    key = page_range(ptr, nbytes)
    with _lock:
        held = registrations.held.get(key)
        if held is None:
            held = registrations.held[key] = _Held(_register_chunks(rt, *key, what))
        held.users += 1
    finalizer = weakref.finalize(owner, _release, rt, mapping, key)
    finalizer.atexit = False  # at exit the process's registrations go with its CUDA context
    return key


def _register_chunks(rt, start: int, length: int, what: str) -> list[tuple[int, int]]:
    done: list[tuple[int, int]] = []
    for at in range(start, start + length, MAX_CHUNK):
        n = min(MAX_CHUNK, start + length - at)
        code = rt.register(at, n, FLAGS)
        registrations.calls += 1
        if code:
            for p, _ in done:
                rt.unregister(p)
            hint = (" (these pages are registered already, by another tensor of this process)"
                    if code == ALREADY_REGISTERED else "")
            raise RegistrationError(f"cudaHostRegister(Mapped|ReadOnly) of {what} ({n} bytes at {at:#x}) failed: "
                                    f"{rt.error(code)}{hint}")
        done.append((at, n))
    return done


def _release(rt, mapping: object, key: tuple[int, int]) -> None:
    del mapping  # kept alive until here: the pages must stay mapped while the GPU may read them
    with _lock:
        held = registrations.held.get(key)
        if held is None:
            return
        held.users -= 1
        if held.users:
            return
        del registrations.held[key]
    for p, n in held.chunks:
        code = rt.unregister(p)
        if code:
            from pled.client import held_files

            held_files.emit(held_files.logging.WARNING, "pled: cudaHostUnregister of %d bytes at %#x failed: %s", n,
                            p, rt.error(code))
