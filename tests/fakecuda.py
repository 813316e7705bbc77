"""FAKED, because this machine has no GPU: the CUDA runtime pled.client.gpu calls (installed with
``pled.client.gpu.use(FakeCuda(...))``), and nothing else.

It answers the device attributes a test gives (99, 113, 88, 100, 91), returns the registration results a test gives
(by flags, or on the n-th call), records every register and unregister call, knows which ranges are registered
(``pinned``), and makes the pageable route's device view at a host address as the tensor itself (recorded).
"""
from __future__ import annotations

NOT_SUPPORTED = 801  # cudaErrorNotSupported
INVALID_VALUE = 1  # cudaErrorInvalidValue ("invalid argument")
RO_OK = {99: 1, 113: 1, 88: 0, 100: 0, 91: 1}  # a Hopper: read-only registration, no pageable access


class FakeCuda:
    """FAKED (no GPU here): a CUDA runtime whose device says ``attrs`` and whose registrations fail with
    ``fail[flags]`` (a CUDA error code) where given, or on call number ``fail_call`` (1-based) with ``fail_code``."""

    def __init__(self, attrs: dict[int, int] | None = None, fail: dict[int, int] | None = None,
                 fail_call: int | None = None, fail_code: int = INVALID_VALUE, name: str = "FakeGPU") -> None:
        self.attrs = dict(RO_OK if attrs is None else attrs)
        self.fail, self.fail_call, self.fail_code, self.name = dict(fail or {}), fail_call, fail_code, name
        self.calls: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []
        self.ranges: dict[int, int] = {}
        self.aliases: list[tuple[int, int]] = []

    def device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device: int) -> None:
        assert device == 0

    def device_name(self, device: int) -> str:
        return self.name

    def attribute(self, device: int, attr: int) -> int:
        return self.attrs.get(attr, 0)

    def versions(self) -> tuple[int, int]:
        return 13000, 12080

    def register(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append((ptr, nbytes, flags))
        if self.fail_call is not None and len(self.calls) == self.fail_call:
            return self.fail_code
        if flags in self.fail:
            return self.fail[flags]
        if ptr in self.ranges:
            return 712  # cudaErrorHostMemoryAlreadyRegistered, as CUDA says
        self.ranges[ptr] = nbytes
        return 0

    def unregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0 if self.ranges.pop(ptr, None) is not None else 1

    def error(self, code: int) -> str:
        return {801: "operation not supported", 1: "invalid argument"}.get(code, "error") + f" (error {code})"

    def pinned(self, ptr: int) -> bool:
        return any(p <= ptr < p + n for p, n in self.ranges.items())

    def device_alias(self, tensor):
        self.aliases.append((tensor.data_ptr(), tensor.numel() * tensor.element_size()))
        return tensor
