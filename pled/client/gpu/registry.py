"""This process's host registrations: pled's pages registered with the GPU, and released with their last owner.

Each route that registers (read-only: ``Mapped | ReadOnly`` over a PROT_READ mapping; writable: ``Mapped`` over the
writer's read-write mapping) registers the page-rounded range that holds a slice, in chunks of at most 64 GiB,
released by a finalizer on the tensor's owner (``weakref.finalize(owner, release, ...)`` with ``atexit = False``, as
vLLM's DPSharedEngramStorage does). The bookkeeping is the point (issue 48, class 1):

- one registration per range whatever the number of tensors over it (a second ``cudaHostRegister`` of the same pages
  fails with cudaErrorHostMemoryAlreadyRegistered), and a range inside one already held is not registered again;
- a registration that fails part-way unregisters every chunk it registered before, and leaves nothing held;
- a range released by its last owner leaves the table, so the same pages registered again (a second model in this
  process, a reload) are really registered.
"""
from __future__ import annotations

import mmap
import threading
import weakref
from dataclasses import dataclass, field

from pled.client.gpu.cuda import ALREADY_REGISTERED, MAPPED, READ_ONLY, RegistrationError

FLAGS = MAPPED | READ_ONLY
# (the read-only route's flags; the writable route registers with MAPPED alone)
MAX_CHUNK = 64 << 30  # larger registrations fail or cost driver metadata (LMCache #5177, sglang #36798)
PAGE = mmap.PAGESIZE

_lock = threading.Lock()


@dataclass
class _Held:
    chunks: list[tuple[int, int]]
    flags: int
    users: int = 0


@dataclass
class Registrations:
    """This process's registered ranges, by (start, length)."""

    held: dict[tuple[int, int], _Held] = field(default_factory=dict)
    calls: int = 0  # cudaHostRegister calls made (one per chunk)

    def covering(self, start: int, length: int) -> tuple[int, int] | None:
        """The held range that holds all of ``[start, start + length)``, if any."""
        for (s, n) in self.held:
            if s <= start and start + length <= s + n:
                return (s, n)
        return None


registrations = Registrations()


def page_range(ptr: int, nbytes: int) -> tuple[int, int]:
    """The whole pages that hold ``[ptr, ptr + nbytes)``: (start, length)."""
    start = ptr - ptr % PAGE
    end = -(-(ptr + max(nbytes, 1)) // PAGE) * PAGE
    return start, end - start


def register(rt, owner: object, mapping: object, ptr: int, nbytes: int, what: str,
             flags: int = FLAGS) -> tuple[int, int]:
    """Register the pages under ``[ptr, ptr + nbytes)`` with ``rt`` (``what`` names them in errors) for as long as
    ``owner`` lives (``mapping`` is kept alive until they are unregistered). Returns the registered range (the one
    held already where it covers these pages). RegistrationError (with the CUDA code) where CUDA refuses."""
    start, length = page_range(ptr, nbytes)
    with _lock:
        key = registrations.covering(start, length)
        if key is None:
            key = (start, length)
            registrations.held[key] = _Held(_register_chunks(rt, start, length, what, flags), flags)
        registrations.held[key].users += 1
    finalizer = weakref.finalize(owner, _release, rt, mapping, key)
    finalizer.atexit = False  # at exit the process's registrations go with its CUDA context
    return key


def _register_chunks(rt, start: int, length: int, what: str, flags: int) -> list[tuple[int, int]]:
    done: list[tuple[int, int]] = []
    for at in range(start, start + length, MAX_CHUNK):
        n = min(MAX_CHUNK, start + length - at)
        code = rt.register(at, n, flags)
        registrations.calls += 1
        if code:
            for p, _ in done:  # every chunk registered before this one: nothing is left half-registered
                rt.unregister(p)
            hint = (" (these pages are registered already, by another tensor of this process)"
                    if code == ALREADY_REGISTERED else "")
            how = "Mapped|ReadOnly" if flags & READ_ONLY else "Mapped"
            raise RegistrationError(f"cudaHostRegister({how}) of {what} ({n} bytes at {at:#x}) failed: "
                                    f"{rt.error(code)}{hint}", code)
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
        del registrations.held[key]  # the last owner: the same pages registered again are really registered
    for p, n in held.chunks:
        code = rt.unregister(p)
        if code:
            from pled.client import held_files

            held_files.emit(held_files.logging.WARNING, "pled: cudaHostUnregister of %d bytes at %#x failed: %s", n,
                            p, rt.error(code))
