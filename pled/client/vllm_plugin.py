"""The vLLM plugin: every process of a vLLM environment reads the tables pled holds from shared memory.

Registered as the ``pled`` entry point of ``vllm.general_plugins``; vLLM calls ``register()`` in each of
its processes (front end, engine core, workers), possibly more than once. Processes that never load
vLLM's plugins (a PLE offload worker started with multiprocessing's spawn) get the same ``register()``
from pled's start-up hook (pled.autoload, run by ``pled-autoload.pth`` when ``PLED_SOCKET`` is set).
Inert unless enabled (see pled.client.held_files).

Seams are chosen by what vLLM's functions are, not by its version string: a function is wrapped where it
exists and takes the parameters the wrapper relies on; keyword arguments the wrapper does not know
(``safetensors_prefetch_num_threads``, say) pass through to vLLM for the files pled does not hold. Each
process logs which seams it wrapped and which loader functions it left alone and why, and one line per
table it served, naming the seam that served it.

This module imports neither torch nor vLLM until vLLM itself has imported its loader.
"""
from __future__ import annotations

import sys
import threading

# Only what register() needs: this runs at every interpreter's start-up where PLED_SOCKET is set. The rest
# (pled.client.held_files, logging, inspect) is imported when vLLM's loader or safetensors is used.
from pled.client import import_hook, safe_open_seam

ITERATOR = "safetensors_weights_iterator"
PLE_MODULE = "vllm.models.qwen4_exp.common.ple"  # vLLM 0.33's PLE path: pled.client.ple_seams (its names there)
PINNED_MODULE = "vllm.models.qwen4_exp.common.ngram_embedding"
# vLLM 0.33's DeepSeek V4.1 Engram tables: pled.client.engram_seams (the model modules import can_share_… by name)
ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"
ENGRAM_MODELS = ("vllm.models.deepseek_v41.nvidia.model", "vllm.models.deepseek_v41.amd.model")
WEIGHT_UTILS = "vllm.model_executor.model_loader.weight_utils"
DEFAULT_LOADER = "vllm.model_executor.model_loader.default_loader"
# What the iterator wrapper relies on: the iterator's first two parameters, and two helpers beside it.
ITERATOR_PARAMS = ("hf_weights_files", "use_tqdm_on_load")
HELPERS = ("_natural_sort_key", "should_skip_weight")
# vLLM's other loaders, left to read from disk, and why.
LEFT_ALONE = {
    "multi_thread_safetensors_weights_iterator": "reads whole files with load_file into private memory",
    "fastsafetensors_weights_iterator": "reads files straight to the GPU",
    "runai_safetensors_weights_iterator": "streams files with its own reader",
    "instanttensor_weights_iterator": "reads files with its own reader",
    "np_cache_weights_iterator": "reads its own .npy cache",
}

_registered = False
_lock = threading.RLock()


def _fits(module, target) -> str | None:
    """Why the iterator wrapper cannot serve through ``target``, or None when it can."""
    import inspect  # here, not at start-up: only a process that imports vLLM's loader pays for it

    missing = [h for h in HELPERS if not callable(getattr(module, h, None))]
    if missing:
        return f"{module.__name__} has no {', '.join(missing)}"
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError) as err:
        return f"its signature cannot be read ({err})"
    names = tuple(p.name for p in params[:2])
    positional = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params[:2])
    if names != ITERATOR_PARAMS or not positional:
        return f"its parameters are ({', '.join(p.name for p in params)}), not ({', '.join(ITERATOR_PARAMS)}, ...)"
    return None


def _wrap_iterator(original, module):
    """vLLM's iterator, called once per call with every file pled does not hold and every argument it was
    given (its prefetch shards by rank over that whole list, sizes it against RAM, draws one progress bar);
    the files pled holds are yielded from the region, in vLLM's order, after the original's: whole files from the
    region (writable, as vLLM's own are: copy-on-write, pled.client.private_views), and a checkpoint file pled
    holds the PLE tensors of (an arrays table) through safe_open, as vLLM's own iterator reads it, its PLE tensors
    from the region (outside vLLM's prefetch, which would read them)."""
    import inspect

    from pled.client import held_files

    signature = inspect.signature(original)

    def safetensors_weights_iterator(hf_weights_files, use_tqdm_on_load, *args, **kwargs):
        st = held_files.state()
        try:
            bound = signature.bind(hf_weights_files, use_tqdm_on_load, *args, **kwargs)
        except TypeError:
            bound = None  # arguments vLLM's own iterator refuses: let it refuse them, with its own error
        if st is None or bound is None or bound.arguments.get("safetensors_load_strategy") == "torchao":
            # torchao rebuilds tensors across files from state it carries: every file goes through the original,
            # which opens them with safe_open, where the files pled holds are still served from memory.
            yield from original(hf_weights_files, use_tqdm_on_load, *args, **kwargs)
            return
        files = list(hf_weights_files)
        held = {path: st.lookup(path) for path in files}
        others = [path for path in files if held[path] is None]
        yield from original(others, use_tqdm_on_load, *args, **kwargs)
        experts = bound.arguments.get("local_expert_ids")
        served = sorted((path for path in files if held[path] is not None), key=module._natural_sort_key)
        for path in served:
            h = held[path]
            st.count(h, ITERATOR)
            if h.partial:  # a checkpoint file pled holds the PLE tensors of: read as vLLM reads it, through safe_open
                with module.safe_open(path, framework="pt") as f:  # pled's seam: the PLE tensors from the region
                    for name in f.keys():  # noqa: SIM118 (a safe_open handle, as vLLM iterates it)
                        if not module.should_skip_weight(name, experts):
                            yield name, f.get_tensor(name)
                continue
            entries = h.table.shard_entries(h.shard.index)
            tensors = h.table.manifest.tensors
            if entries:  # as vLLM's own (safe_open "pt"): writable tensors over one private mapping of the file
                from pled.client.private_views import PrivateMapping

                mapping = PrivateMapping(h.table, min(tensors[i].offset for i in entries.values()),
                                         max(tensors[i].offset + tensors[i].nbytes for i in entries.values()))
            for name, index in entries.items():
                if not module.should_skip_weight(name, experts):
                    yield name, mapping.tensor(tensors[index])
        if served:
            st.report(ITERATOR)

    safetensors_weights_iterator.__wrapped__ = original
    safetensors_weights_iterator.__pled__ = True
    safetensors_weights_iterator.__signature__ = signature
    return safetensors_weights_iterator


def _vllm_version() -> str:
    vllm = sys.modules.get("vllm")
    return getattr(vllm, "__version__", "?")


def _patch_weight_utils(module) -> None:
    import logging

    from pled.client.held_files import emit

    target = getattr(module, ITERATOR, None)
    wrapped, left = [], []
    if getattr(target, "__pled__", False):
        return
    if not callable(target):
        left.append(f"{ITERATOR} (not defined here)")
    elif (why := _fits(module, target)) is not None:
        left.append(f"{ITERATOR} ({why}; its files are still served where it opens them with safe_open)")
    else:
        module.safetensors_weights_iterator = _wrap_iterator(target, module)
        wrapped.append(ITERATOR)
    if callable(getattr(module, "safe_open", None)):
        safe_open_seam.patch(module)
        wrapped.append("safe_open")
    left += [f"{name} ({why})" for name, why in LEFT_ALONE.items() if callable(getattr(module, name, None))]
    emit(logging.INFO if wrapped else logging.WARNING,
         "pled: vLLM %s: files pled holds are served through %s; left alone, reading from disk: %s",
         _vllm_version(), " and ".join(wrapped) or "nothing (no seam fits: tables are read from disk)",
         "; ".join(left) or "nothing")
    _patch_default_loader(sys.modules.get(DEFAULT_LOADER))


def _patch_default_loader(module) -> None:
    """default_loader imported the iterator by name: point that name at the wrapper too."""
    if module is None:
        return
    wu = sys.modules.get(WEIGHT_UTILS)
    wrapped = getattr(wu, ITERATOR, None)
    current = getattr(module, ITERATOR, None)
    if getattr(wrapped, "__pled__", False) and current is wrapped.__wrapped__:
        module.safetensors_weights_iterator = wrapped


def register() -> None:
    """vLLM's entry point, and the start-up hook's. Cheap and idempotent: it only arranges for
    safetensors and vLLM's loader to be wrapped when they are imported; the wrappers do nothing unless
    PLED_SOCKET or the additional config enables pled."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
        safe_open_seam.install()
        import_hook.after_import(WEIGHT_UTILS, _patch_weight_utils)
        import_hook.after_import(DEFAULT_LOADER, _patch_default_loader)
        # vLLM 0.33's own PLE path (pled.client.ple_seams): ple first, as ngram_embedding imports it
        import_hook.after_import(PLE_MODULE, _patch_ple)
        import_hook.after_import(PINNED_MODULE, _patch_pinned)
        # and its DeepSeek V4.1 Engram path (pled.client.engram_seams): the engram module before the models
        import_hook.after_import(ENGRAM_MODULE, _patch_engram)
        for name in ENGRAM_MODELS:
            import_hook.after_import(name, _patch_engram_model)


def _patch_ple(module) -> None:
    from pled.client import ple_seams

    ple_seams.patch_ple(module)


def _patch_pinned(module) -> None:
    from pled.client import ple_seams

    ple_seams.patch_pinned(module)


def _patch_engram(module) -> None:
    from pled.client import engram_seams

    engram_seams.patch_engram(module)


def _patch_engram_model(module) -> None:
    from pled.client import engram_seams

    engram_seams.patch_model(module)
