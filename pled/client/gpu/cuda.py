"""The CUDA runtime pled's GPU side calls, and the seam that lets a process without a GPU install another.

The calls go through a ``Runtime``: torch's ``torch.cuda.cudart()`` for registration, and libcudart by ctypes for
what torch does not bind (device attributes, versions). A process without a GPU can install another one with
``use()`` (a context manager as well as a call): pled's tests do, and say so. ``runtime()`` is None where this
process has no CUDA at all and nothing was installed (this machine): the views are then plain CPU views.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading

MAPPED = 0x02  # cudaHostRegisterMapped
READ_ONLY = 0x08  # cudaHostRegisterReadOnly
# cudaDeviceAttr values the probe reads (pled.client.gpu.probe)
ATTR_PAGEABLE = 88  # cudaDevAttrPageableMemoryAccess
ATTR_CAN_USE_HOST_POINTER = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem
ATTR_REGISTER_SUPPORTED = 99  # cudaDevAttrHostRegisterSupported
ATTR_PAGEABLE_HOST_TABLES = 100  # cudaDevAttrPageableMemoryAccessUsesHostPageTables
ATTR_READ_ONLY_SUPPORTED = 113  # cudaDevAttrHostRegisterReadOnlySupported
NOT_SUPPORTED = 801  # cudaErrorNotSupported
INVALID_VALUE = 1  # cudaErrorInvalidValue ("invalid argument")
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


class RegistrationError(RuntimeError):
    """The GPU would not take a table's pages; the message names the range and the device, and what to do.
    ``code`` is the CUDA error (0 where none came from CUDA)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class Runtime:
    """The CUDA runtime calls pled makes, through torch (register, unregister) and libcudart (the rest)."""

    name = "CUDA"

    def __init__(self) -> None:
        import torch

        self._cudart = torch.cuda.cudart()
        self._torch = torch
        self._lib: ctypes.CDLL | None = None

    def device(self) -> int:
        return int(self._torch.cuda.current_device())

    def device_count(self) -> int:
        return int(self._torch.cuda.device_count())

    def set_device(self, device: int) -> None:
        self._torch.cuda.set_device(device)

    def device_name(self, device: int) -> str:
        return str(self._torch.cuda.get_device_name(device))

    def attribute(self, device: int, attr: int) -> int:
        value = ctypes.c_int(0)
        code = self.libcudart().cudaDeviceGetAttribute(ctypes.byref(value), attr, device)
        if code:
            raise RegistrationError(f"cudaDeviceGetAttribute({attr}) failed on device {device}: {self.error(code)}",
                                    code)
        return int(value.value)

    def versions(self) -> tuple[int, int]:
        """(driver, runtime) as CUDA numbers them (12080: 12.8)."""
        driver, runtime = ctypes.c_int(0), ctypes.c_int(0)
        self.libcudart().cudaDriverGetVersion(ctypes.byref(driver))
        self.libcudart().cudaRuntimeGetVersion(ctypes.byref(runtime))
        return int(driver.value), int(runtime.value)

    def device_alias(self, tensor):
        """A tensor on the current device at ``tensor``'s own address (pageable access: the host address is the
        device address), made through ``__cuda_array_interface__``: no allocation, no copy; it keeps ``tensor``
        (and so pled's mapping under it) alive."""
        torch = self._torch
        nbytes = tensor.numel() * tensor.element_size()

        class _At:
            def __init__(self) -> None:
                self.keep = tensor
                self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                                 "data": (tensor.data_ptr(), True), "strides": None}

        flat = torch.as_tensor(_At(), device=f"cuda:{self.device()}")
        if flat.data_ptr() != tensor.data_ptr():
            raise RegistrationError(f"the device view of {nbytes} bytes at {tensor.data_ptr():#x} was made at "
                                    f"{flat.data_ptr():#x}: a copy, refused")
        return flat.view(tensor.dtype).view(tensor.shape)

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
                raise RegistrationError("cannot load libcudart to ask the device what it supports")
        return self._lib


_lock = threading.Lock()
_runtime: object | None = None
_probed = False  # whether this process looked for CUDA already (None found: _runtime stays None)
_on_use: list = []  # what use() calls: the probe's and the routes' forget (they register it; this imports neither)


def on_use(forget) -> None:
    """Have ``use()`` call ``forget`` (a cache of what the runtime said) whenever it installs a runtime."""
    _on_use.append(forget)


class use(contextlib.AbstractContextManager):  # noqa: N801 (a function to its callers, a context manager too)
    """Make ``runtime`` the one this process registers with (tests without a GPU install a fake, and say so).
    ``use(fake)`` installs it at once (``previous`` is the one it replaced); ``with use(fake):`` puts that back at
    the end."""

    def __init__(self, runtime: object | None) -> None:
        global _runtime, _probed
        with _lock:
            self.previous, _runtime = _runtime, runtime
            _probed = runtime is not None
        for forget in list(_on_use):  # another runtime: its devices are asked anew, and the routes chosen anew
            forget()

    def __exit__(self, *exc) -> None:
        use(self.previous)


def available() -> bool:
    """Whether this process has CUDA (torch built with it and a device present)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 (no torch, a broken driver: no CUDA here either way)
        return False


def runtime():
    """The runtime installed, else CUDA's through torch; None where this process has no CUDA."""
    global _runtime, _probed
    with _lock:
        if _runtime is None and not _probed:
            _probed = True
            if available():
                _runtime = Runtime()
        return _runtime
