"""The routes by which a GPU reads a slice of pled's one copy, tried in the table's ``gpu_routes`` order.

- ``read-only``: ``cudaHostRegister(Mapped | ReadOnly)`` of the slice's pages (the mapping is PROT_READ over a
  write-sealed memfd); needs attributes 99 and 113; the tensor is pinned, vLLM's UVA helper takes its device pointer.
- ``pageable``: nothing registered; the device reads the host address itself (pageable memory access, attribute 88).
  Taken by default where the device uses the host's page tables (ATS, 100 = 1: Grace, GB10); on HMM (100 = 0, x86
  with the open modules) only where the operator opts in with ``PLED_PAGEABLE_HMM=1``, until the device check has
  shown a shared memfd mapping read that way is sound and fast on that device.
- ``writable``: the table is ``gpu_access = "writable"`` and this process one of its writers (its mapping is
  read-write): the whole mapping registered with ``Mapped`` (no ReadOnly), then ``Table.protect()`` makes it
  read-only in this process; needs attribute 99.
A route whose attributes say no is skipped with the reason; one whose registration still fails (801, invalid
argument) moves on, logged. Where none works: ``NoRoute``, one line naming the device, what it lacks, the options.
The route a table took on a device is kept for the process: its other slices take the same one.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass

from pled.client.gpu import cuda, registry
from pled.client.gpu.cuda import MAPPED, RegistrationError
from pled.client.gpu.probe import Probe

ROUTES = ("read-only", "pageable", "writable")
NAMES = {"read-only": "read-only registration", "pageable": "pageable access", "writable": "writable registration"}
HMM_OPT_IN = "PLED_PAGEABLE_HMM"


class NoRoute(RuntimeError):
    """No route lets this device read the slice; str() is the one line to show."""


@dataclass
class Taken:
    route: str
    registered: tuple[int, int] | None  # the page range registered for it (None: pageable, nothing registered)
    skipped: list[str]  # the routes tried or passed over before it, each with why


_lock = threading.Lock()
_chosen: dict[tuple[int, int], tuple[weakref.ref, str]] = {}  # (id(table), device) -> (the table, its route)


def forget() -> None:
    with _lock:
        _chosen.clear()


cuda.on_use(forget)


def hmm_opted_in() -> bool:
    return os.environ.get(HMM_OPT_IN, "") in ("1", "yes", "true")


def unfit(route: str, p: Probe, table) -> str | None:
    """Why ``route`` cannot be taken on this device for this table, from what the probe and the table say (None:
    try it)."""
    if route == "read-only":
        if not p.register_supported:
            return "host registration unsupported (cudaDevAttrHostRegisterSupported = 0)"
        if not p.read_only_supported:
            return "no read-only host registration (cudaDevAttrHostRegisterReadOnlySupported = 0)"
    elif route == "pageable":
        if not p.pageable:
            return "no pageable memory access (cudaDevAttrPageableMemoryAccess = 0)"
        if not p.ats and not hmm_opted_in():
            return (f"pageable access is HMM here (PageableMemoryAccessUsesHostPageTables = 0), opt-in until the "
                    f"device check has shown it: {HMM_OPT_IN}=1")
    elif route == "writable":
        if getattr(table, "gpu_access", "read-only") != "writable":
            return "the table is not gpu_access = \"writable\" in pled's config"
        if not getattr(table, "writer", False):
            return f"uid {os.geteuid()} is not one of the table's writers (writers = [...] in pled's config)"
        if not p.register_supported:
            return "host registration unsupported (cudaDevAttrHostRegisterSupported = 0)"
    else:
        return f"unknown route {route!r}"
    return None


def take(rt, p: Probe, table, owner: object, ptr: int, nbytes: int, what: str) -> Taken:
    """Make ``[ptr, ptr + nbytes)`` of ``table``'s mapping readable by device ``p.device`` for as long as ``owner``
    lives, by the first route that works; NoRoute where none does."""
    key = (id(table), p.device)
    routes = tuple(getattr(table, "gpu_routes", ROUTES))
    with _lock:
        chosen = _chosen.get(key)
    if chosen is not None and chosen[0]() is table:  # its route first: the routes that failed are not tried again
        routes = (chosen[1], *(r for r in routes if r != chosen[1]))
    skipped: list[str] = []
    for route in routes:
        why = unfit(route, p, table)
        if why is None:
            try:
                registered = _try(route, rt, table, owner, ptr, nbytes, what)
            except RegistrationError as err:
                why = f"{err}"
                from pled.client import held_files

                held_files.emit(logging.WARNING, "pled: %s: %s on device %d (%s) failed, trying the next route: %s",
                                what, NAMES[route], p.device, p.name, why)
            else:
                with _lock:
                    _chosen[key] = (weakref.ref(table), route)
                return Taken(route, registered, skipped)
        skipped.append(f"{NAMES.get(route, route)}: {why}")
    raise NoRoute(refusal(p, table, what, skipped))


def refusal(p: Probe, table, what: str, skipped: list[str]) -> str:
    options = []
    if getattr(table, "gpu_access", "read-only") != "writable":
        options.append(f"gpu_access = \"writable\" with writers = [...] for table {table.name} in pled's config "
                       "(/usr/share/doc/pled/operations.md, \"What a GPU must support\": the writable route's trade)")
    if p.hmm and not hmm_opted_in():
        options.append(f"{HMM_OPT_IN}=1 (pageable access over HMM)")
    options.append("PLED_FALLBACK=disk (vLLM's private pinned copy per rank)")
    return (f"pled: device {p.device} ({p.name}) cannot read {what} from pled's one copy: " + "; ".join(skipped) +
            "; options: " + ", or ".join(options) + "; `pled gpu-check` shows every table's route")


def _try(route: str, rt, table, owner: object, ptr: int, nbytes: int, what: str) -> tuple[int, int] | None:
    if route == "read-only":
        return registry.register(rt, owner, table.buffer, ptr, nbytes, what)
    if route == "pageable":
        return None  # the host address is the device address: nothing to register
    # writable: the whole mapping, while it is still read-write here, then read-only in this process
    try:
        return registry.register(rt, owner, table.buffer, table.address, len(table.buffer), f"table {table.name}",
                                 flags=MAPPED)
    finally:
        table.protect()  # registered or not, this process writes nothing through it from here on
