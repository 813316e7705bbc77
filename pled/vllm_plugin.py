"""The vLLM plugin: every vLLM process reads the tables pled holds from shared memory.

Registered as the ``pled`` entry point of ``vllm.general_plugins``; vLLM calls ``register()`` in each
of its processes (front end, engine core, workers), possibly more than once. Inert unless enabled:
by ``PLED_SOCKET`` in the environment (the vLLM unit drop-in sets it), or by
``--additional-config '{"pled": {"socket": "...", "tables": ["ples_int4"], "fallback": "disk"}}'``,
which is read when weights are loaded, since vLLM's config is not set yet when plugins load.

When enabled, a ``.safetensors`` file that a pled table holds (same real path, size and mtime as
the manifest records) is served from the attached region, zero copy and read-only, both through
vLLM's own weight iterator and through ``safetensors.safe_open`` (for code such as a PLE offload
worker that maps sidecar shards itself). Other files are untouched. If pled is configured but
cannot serve (unreachable, a table missing, a file changed since staging) the load fails with
what to do, unless ``fallback`` is ``"disk"``: then a warning, and the file is read as usual.

This module imports neither torch nor vLLM until vLLM itself has imported its loader.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from dataclasses import dataclass, field

log = logging.getLogger("vllm.pled")  # under vLLM's own logger, so its handlers print our lines

TESTED_VLLM = ("0.32.",)  # internals this plugin knows how to wrap
WEIGHT_UTILS = "vllm.model_executor.model_loader.weight_utils"
DEFAULT_LOADER = "vllm.model_executor.model_loader.default_loader"
HINT = "check `systemctl status pled` and `pled status`"

_registered = False
_lock = threading.RLock()


class PledUnavailable(RuntimeError):
    """pled is configured for this vLLM but cannot serve what it should."""


@dataclass
class Settings:
    socket: str
    tables: list[str] | None
    fallback: str | None  # "disk", or None: fail the load
    populate: bool = True
    source: str = "PLED_SOCKET"


def settings() -> Settings | None:
    """pled's settings for this process, from vLLM's additional config or the environment; None: inert."""
    extra: dict = {}
    try:
        from vllm.config.vllm import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
        if cfg is not None and isinstance(cfg.additional_config, dict):
            extra = cfg.additional_config.get("pled") or {}
    except ImportError:
        pass
    socket = extra.get("socket") or os.environ.get("PLED_SOCKET")
    if not socket:
        return None
    tables = extra.get("tables")
    if tables is None and os.environ.get("PLED_TABLES"):
        tables = [t for t in os.environ["PLED_TABLES"].split(",") if t]
    fallback = extra.get("fallback") or os.environ.get("PLED_FALLBACK") or None
    if fallback not in (None, "disk"):
        raise PledUnavailable(f'pled: fallback must be "disk" or unset, not {fallback!r}')
    return Settings(socket, tables, fallback, bool(extra.get("populate", True)),
                    "--additional-config" if extra.get("socket") else "PLED_SOCKET")


@dataclass
class Held:
    table: object  # pled.client.Table
    shard: object  # pled.region.ShardEntry


@dataclass
class State:
    """What this process has attached: tables, and each held file by real path."""

    settings: Settings
    tables: dict = field(default_factory=dict)
    files: dict[str, Held] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)  # table -> files served from memory
    error: str | None = None

    def lookup(self, path: str) -> Held | None:
        """The region holding ``path``, if it is a file pled staged and it is unchanged; else None or an error."""
        real = os.path.realpath(path)
        held = self.files.get(real)
        if held is None:
            return None
        st = os.stat(real)
        if (st.st_size, st.st_mtime_ns) != (held.shard.size, held.shard.mtime_ns):
            self.refuse(f"{real} changed since pled staged it into table {held.table.name} "
                        f"(size {st.st_size}, was {held.shard.size}); restart pled to stage it anew, then vLLM")
            return None
        return held

    def refuse(self, problem: str) -> None:
        if self.settings.fallback == "disk":
            log.warning("pled: %s; reading from disk instead (fallback = \"disk\")", problem)
            return
        raise PledUnavailable(f"pled: {problem}; {HINT}, or set \"fallback\": \"disk\" to read from disk")


_state: State | None = None


def state() -> State | None:
    """Attach (once per process) the tables pled serves; None when the plugin is not enabled."""
    global _state
    with _lock:
        s = settings()
        if s is None:
            return None
        if _state is not None and _state.settings.socket == s.socket:
            return _state
        st = State(s)
        _attach_all(st)  # raises where pled cannot serve and there is no fallback: the next load tries again
        _state = st
        return st


def _attach_all(st: State) -> None:
    from pled import client, protocol

    s = st.settings
    try:
        names = s.tables
        if names is None:
            names = [t["table"] for t in client.call(protocol.STATUS, socket=s.socket)["tables"]]
        for name in names:
            table = client.attach(name, socket=s.socket, populate=s.populate, wait=True, timeout=600)
            st.tables[name] = table
            for shard in table.shards:
                st.files[shard.path] = Held(table, shard)
    except client.NoSuchTable as err:
        st.refuse(f"a configured table is not served: {err}")
    except client.ClientError as err:
        st.refuse(f"configured by {s.source} ({s.socket}) but cannot attach: {err}")


def _report(st: State) -> None:
    from pled.sizes import gib

    for name, count in st.served.items():
        t = st.tables[name]
        log.info("pled: pid %d mapped table %s (generation %d): %d of %d files, %s from shared memory, "
                 "0 bytes read from disk for them (pre-fault %.0f ms)", os.getpid(), name, t.generation, count,
                 len(t.shards), gib(t.manifest.source_bytes), t.populate_seconds * 1000)
    st.served.clear()


# -- what a held file looks like to safetensors' callers ---------------------------------------------

def _tensors_of(held: Held) -> dict:
    return held.table.shard_tensors(held.shard.index)


def _metadata_of(held: Held) -> dict | None:
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

    def __init__(self, held: Held, framework: str) -> None:
        self._held = held
        self._tensors = _tensors_of(held)
        self._framework = framework
        st = _state
        if st is not None:
            st.served[held.table.name] = st.served.get(held.table.name, 0) + 1

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


def _wrap_safe_open(original):
    def safe_open(filename, framework, device="cpu", *args, **kwargs):
        st = state()
        if st is not None and framework in ("pt", "torch", "np", "numpy") and str(device) == "cpu":
            held = st.lookup(os.fspath(filename))
            if held is not None:
                return PledSafeOpen(held, framework)
        return original(filename, framework, device, *args, **kwargs)

    safe_open.__wrapped__ = original
    safe_open.__pled__ = True
    return safe_open


def _wrap_iterator(original):
    def safetensors_weights_iterator(hf_weights_files, use_tqdm_on_load, *args, **kwargs):
        st = state()
        if st is None:
            yield from original(hf_weights_files, use_tqdm_on_load, *args, **kwargs)
            return
        from vllm.model_executor.model_loader.weight_utils import _natural_sort_key, should_skip_weight

        local_expert_ids = kwargs.get("local_expert_ids", args[1] if len(args) > 1 else None)
        for path in sorted(hf_weights_files, key=_natural_sort_key):
            held = st.lookup(path)
            if held is None:
                yield from original([path], use_tqdm_on_load, *args, **kwargs)
                continue
            st.served[held.table.name] = st.served.get(held.table.name, 0) + 1
            for name, tensor in _tensors_of(held).items():
                if not should_skip_weight(name, local_expert_ids):
                    yield name, tensor
        _report(st)

    safetensors_weights_iterator.__wrapped__ = original
    safetensors_weights_iterator.__pled__ = True
    return safetensors_weights_iterator


# -- patching, when vLLM imports its loader -----------------------------------------------------------

def _patch(module) -> None:
    import vllm

    version = getattr(vllm, "__version__", "?")
    name = module.__name__
    target = getattr(module, "safetensors_weights_iterator", None)
    if not version.startswith(TESTED_VLLM) or not callable(target):
        log.warning("pled: vLLM %s has a loader layout this plugin does not know (%s.safetensors_weights_iterator); "
                    "not patching it: tables are read from disk", version, name)
        return
    if getattr(target, "__pled__", False):
        return
    if name == WEIGHT_UTILS:
        module.safetensors_weights_iterator = _wrap_iterator(target)
        if hasattr(module, "safe_open") and not getattr(module.safe_open, "__pled__", False):
            module.safe_open = _wrap_safe_open(module.safe_open)
    else:  # default_loader imported the name: wrap it where it is used
        wu = sys.modules.get(WEIGHT_UTILS)
        wrapped = getattr(wu, "safetensors_weights_iterator", None)
        module.safetensors_weights_iterator = wrapped if getattr(wrapped, "__pled__", False) else _wrap_iterator(target)


def _patch_safetensors() -> None:
    import safetensors

    for mod in (safetensors, sys.modules.get("safetensors.torch"), sys.modules.get("safetensors.numpy")):
        if mod is not None and hasattr(mod, "safe_open") and not getattr(mod.safe_open, "__pled__", False):
            mod.safe_open = _wrap_safe_open(mod.safe_open)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches vLLM's loader modules, and safetensors, right after they are first imported."""

    TARGETS = (WEIGHT_UTILS, DEFAULT_LOADER, "safetensors", "safetensors.torch", "safetensors.numpy")

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _after_import(module.__name__)


def _after_import(name: str) -> None:
    if name.startswith("safetensors"):
        _patch_safetensors()
    elif name in (WEIGHT_UTILS, DEFAULT_LOADER):
        _patch(sys.modules[name])


def register() -> None:
    """vLLM's entry point. Cheap and idempotent: it only arranges for the loader to be wrapped when
    vLLM imports it; the wrappers do nothing unless PLED_SOCKET or the additional config enables pled."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
        for name in _Finder.TARGETS:  # already imported: patch now
            if name in sys.modules:
                _after_import(name)
        sys.meta_path.insert(0, _Finder())
