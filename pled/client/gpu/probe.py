"""What a device can do with host memory, asked once per process and device before any registration.

Through the runtime (pled.client.gpu.cuda): ``HostRegisterSupported`` (99), ``HostRegisterReadOnlySupported`` (113),
``PageableMemoryAccess`` (88), ``PageableMemoryAccessUsesHostPageTables`` (100), ``CanUseHostPointerForRegistered
Mem`` (91), the driver and runtime versions; from ``/proc/driver/nvidia/version``, whether the kernel module is the
open one (HMM needs it). An attribute that says yes is not proof: a registration that still fails moves on
(pled.client.gpu.routes).
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

from pled.client.gpu import cuda

NVIDIA_VERSION = "/proc/driver/nvidia/version"
_ATTRS = {"register_supported": cuda.ATTR_REGISTER_SUPPORTED, "read_only_supported": cuda.ATTR_READ_ONLY_SUPPORTED,
          "pageable": cuda.ATTR_PAGEABLE, "pageable_uses_host_page_tables": cuda.ATTR_PAGEABLE_HOST_TABLES,
          "host_pointer_for_registered": cuda.ATTR_CAN_USE_HOST_POINTER}


@dataclass(frozen=True)
class Probe:
    device: int
    name: str
    register_supported: bool  # 99
    read_only_supported: bool  # 113
    pageable: bool  # 88
    pageable_uses_host_page_tables: bool  # 100
    host_pointer_for_registered: bool  # 91
    driver: int
    runtime: int
    open_module: bool | None  # None: no /proc/driver/nvidia/version (no driver, or a fake runtime)
    unknown: tuple[str, ...] = ()  # attributes the runtime would not say (taken as 0), with why

    @property
    def ats(self) -> bool:
        """Pageable memory through the host's page tables (Grace, GB10): the pageable route's default."""
        return self.pageable and self.pageable_uses_host_page_tables

    @property
    def hmm(self) -> bool:
        """Pageable memory through the driver's mirror of the page tables (x86 with the open modules): opt-in."""
        return self.pageable and not self.pageable_uses_host_page_tables

    def describe(self) -> dict:
        return {**asdict(self), "ats": self.ats, "hmm": self.hmm, "unknown": list(self.unknown)}


def open_kernel_module(path: str = NVIDIA_VERSION) -> bool | None:
    """Whether the loaded NVIDIA kernel module is the open one ("Open Kernel Module" in its version line)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(4096)
    except OSError:
        return None
    return "open kernel module" in text.lower()


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}" if v else "unknown"


def versions_text(p: Probe) -> str:
    return f"driver {_version(p.driver)}, runtime {_version(p.runtime)}"


_lock = threading.Lock()
_cache: dict[tuple[int, int], Probe] = {}


def probe(rt, device: int) -> Probe:
    """The device's answers (cached per runtime and device for this process)."""
    with _lock:
        found = _cache.get((id(rt), device))
    if found is not None:
        return found
    values, unknown = {}, []
    for key, attr in _ATTRS.items():
        try:
            values[key] = bool(rt.attribute(device, attr))
        except RuntimeError as err:  # an old driver without the attribute: taken as no, and said
            values[key] = False
            unknown.append(f"{key} ({attr}): {err}")
    try:
        driver, runtime = rt.versions()
    except RuntimeError:
        driver, runtime = 0, 0
    found = Probe(device, rt.device_name(device), driver=driver, runtime=runtime, open_module=open_kernel_module(),
                  unknown=tuple(unknown), **values)
    with _lock:
        _cache[(id(rt), device)] = found
    return found


def forget() -> None:
    """Ask again next time (a runtime installed anew)."""
    with _lock:
        _cache.clear()


cuda.on_use(forget)
