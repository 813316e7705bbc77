"""``safetensors.safe_open`` served from pled for the files a table holds.

Code that reads a sidecar itself (the PLE offload worker: ``from safetensors import safe_open``,
``safe_open(shard, framework="pt")``, ``get_tensor()``) gets the same object it would from disk, with
tensors that are read-only views of pled's region: zero copy, and the file is not read. Files pled does
not hold, and loads to a device other than the CPU, go to the real ``safe_open`` untouched.
"""
from __future__ import annotations

import os
import sys

from pled.client import import_hook  # and pled.client.held_files, once safe_open is called: start-up stays cheap

SEAM = "safe_open"
MODULES = ("safetensors", "safetensors.torch", "safetensors.numpy")


def _metadata_of(held) -> dict | None:
    import json
    import struct

    buf = held.table.buffer
    off = held.shard.offset
    (n,) = struct.unpack_from("<Q", buf, off)
    return json.loads(bytes(buf[off + 8 : off + 8 + n])).get("__metadata__")


class _Slice:
    def __init__(self, tensor):
        self._t = tensor

    def __getitem__(self, index):
        return self._t[index]

    def get_shape(self):
        return list(self._t.shape)

    def get_dtype(self):
        return str(self._t.dtype)


class PledSafeOpen:
    """Stands in for safetensors.safe_open on a file pled holds: the same methods, tensors from memory."""

    def __init__(self, held, framework: str) -> None:  # held: a pled.client.held_files.Held
        self._held = held
        self._tensors = held.table.shard_tensors(held.shard.index)
        self._framework = framework

    def keys(self):
        return sorted(self._tensors)

    def offset_keys(self):
        return list(self._tensors)

    def metadata(self):
        return _metadata_of(self._held)

    def get_tensor(self, name: str):
        t = self._tensors[name]
        return t.numpy() if self._framework in ("np", "numpy") else t

    def get_slice(self, name: str):
        return _Slice(self._tensors[name])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def wrap(original):
    def safe_open(filename, framework, device="cpu", *args, **kwargs):
        from pled.client import held_files

        st = held_files.state()
        if st is not None and framework in ("pt", "torch", "np", "numpy") and str(device) == "cpu":
            held = st.lookup(os.fspath(filename))
            if held is not None:
                opened = PledSafeOpen(held, framework)
                st.count(held, SEAM)
                st.report(SEAM, complete_only=True)
                return opened
        return original(filename, framework, device, *args, **kwargs)

    safe_open.__wrapped__ = original
    safe_open.__pled__ = True
    safe_open.__doc__ = getattr(original, "__doc__", None)
    return safe_open


def patch(module) -> None:
    """Wrap ``module.safe_open`` (once), sharing the package's wrapper where it has one."""
    target = getattr(module, "safe_open", None)
    if callable(target) and not getattr(target, "__pled__", False):
        module.safe_open = wrap(target)
    # safetensors.torch imported the name from the package before this ran for it: share one wrapper
    pkg = sys.modules.get("safetensors")
    if module.__name__ != "safetensors" and pkg is not None and getattr(pkg.safe_open, "__pled__", False):
        module.safe_open = pkg.safe_open


def install() -> None:
    """Wrap ``safe_open`` in safetensors and its torch/numpy modules, now or when they are imported."""
    for name in MODULES:
        import_hook.after_import(name, patch)
