"""vLLM 0.33's DeepSeek V4.1 Engram tables on pled's pages: each rank's host table a view of one sealed region.

vLLM 0.33 holds each Engram layer's table in host memory (``EngramConfig.cpu_offload``, the default) and fills it at
every start: a private pinned copy per rank (rounded up to a power of two), or with DP > 1 a writable ``/dev/shm``
file per layer and TP rank refilled from the checkpoint (``DPSharedEngramStorage``), or, where ``/dev/shm`` cannot
hold the tables, heads split over DP ranks with collectives on every step. With pled serving the checkpoint's Engram
tables as arrays (a ``checkpoint`` table: per layer ``weight`` F8_E4M3 and ``scale`` F8_E8M0, checkpoint order),
four seams in ``vllm.models.deepseek_v41.common.engram`` (and the name the model modules import) make every rank's
table a view of the one sealed copy, for any TP, Engram-DP and sharing choice:

- ``ParallelEngramEmbedding._allocate_weights(self)``: for a host table (``cpu_offload``, no GPU peer rows, not on
  the meta device), the array pled holds with ``self.num_embeddings`` rows of ``self.dim`` values (the layer has no
  prefix; its row count is its own, primes are never reused across layers) and its scales: rows
  ``[vocab_start_idx, vocab_end_idx)`` of both through ``pled.client.gpu.device_view`` (no ``/dev/shm`` file, no
  pinned allocation, no THP memory). It sets ``self._weight_loader`` to a comparison, which ``__init__`` attaches to
  both parameters next.
- that loader: upstream's own steps (the e8m0 scale viewed as bytes, ``narrow`` at ``engram_vocab_start``, its shape
  assertion), then a comparison instead of ``copy_``: identity where pled served the checkpoint's tensor from the
  same array (the safetensors seam), else ``torch.equal``; a difference or a cast is refused naming the tensor.
- the module's ``get_accelerator_view_from_cpu_tensor`` (``gpu.guard_uva``): never a private copy of pled's pages.
- ``can_share_engram_tables(layout, block_size)`` (in the model modules, which import it by name): True where pled
  holds every layer's table and the Engram DP group has more than one rank, without looking at ``/dev/shm``: so TP-only
  sharding, one copy, no per-step DP collectives, even in a container with the default 64 MiB ``/dev/shm``.

``load_format=dummy`` with pled serving the layer is refused in one line (it would write vLLM's dummy values into
the sealed table). GPU tables (``cpu_offload=False``, GPU peer rows) are left to vLLM, said once. Every seam is found
by attribute and signature; one that does not fit, while pled serves arrays here, fails the import with the reason.
Without pled configured, or left out by ``VLLM_PLUGINS``, everything calls vLLM's original.
"""
from __future__ import annotations

import logging
from typing import Any

from pled.client import held_files
from pled.client.held_files import PledUnavailable
from pled.client.ple_seams import SeamUnfit, _params, _unfit

ENGRAM = "vllm.models.deepseek_v41.common.engram"
MODELS = ("vllm.models.deepseek_v41.nvidia.model", "vllm.models.deepseek_v41.amd.model")
CLASS = "ParallelEngramEmbedding"
UVA = "get_accelerator_view_from_cpu_tensor"
SHARE = "can_share_engram_tables"
ALLOCATE_PARAMS = ("self",)
LOADER_PARAMS = ("param", "loaded_weight")
SHARE_PARAMS = ("layout", "block_size")
NEEDS = ("num_embeddings", "dim", "block_size", "vocab_start_idx", "vocab_end_idx", "cpu_offload", "peer_rows")
__all__ = ["SeamUnfit", "patch_engram", "patch_model"]


def patch_engram(module) -> None:
    """Wrap ``_allocate_weights``, guard the UVA helper and ``can_share_engram_tables`` of vLLM's engram module."""
    cls = getattr(module, CLASS, None)
    original = getattr(cls, "_allocate_weights", None)
    if getattr(original, "__pled__", False):
        return
    loader = getattr(cls, "_weight_loader", None)
    uva, share = getattr(module, UVA, None), getattr(module, SHARE, None)
    if original is None or _params(original) != ALLOCATE_PARAMS:
        return _unfit(module, f"{CLASS}._allocate_weights is ({', '.join(_params(original)) or 'missing'}), not "
                              f"({', '.join(ALLOCATE_PARAMS)})")
    if loader is None or _params(loader) != LOADER_PARAMS:
        return _unfit(module, f"{CLASS}._weight_loader is ({', '.join(_params(loader)) or 'missing'}), not "
                              f"({', '.join(LOADER_PARAMS)})")
    if not callable(uva) or not callable(share) or _params(share) != SHARE_PARAMS:
        return _unfit(module, f"it has no {UVA}, or no {SHARE}({', '.join(SHARE_PARAMS)})")
    from pled.client import gpu

    setattr(cls, "_allocate_weights", _wrap_allocate(original))  # noqa: B010 (cls is found by name)
    setattr(module, UVA, gpu.guard_uva(uva))
    setattr(module, SHARE, _wrap_share(share, module))


def patch_model(module) -> None:
    """Point the model module's own ``can_share_engram_tables`` (imported by name) at pled's wrapper."""
    engram = __import__(ENGRAM, fromlist=["_"])
    wrapped = getattr(engram, SHARE, None)
    if wrapped is not None and getattr(wrapped, "__pled__", False) and \
            getattr(module, SHARE, None) is getattr(wrapped, "__wrapped__", None):
        setattr(module, SHARE, wrapped)


def _once(st, key: str, line: str) -> None:
    """An INFO line said once a process per ``key``."""
    if key not in st.said:
        st.said.add(key)
        held_files.emit(logging.INFO, "%s", line)


# -- which table ---------------------------------------------------------------------------------------------------


def _engram_arrays(st) -> list:
    """[(table, weight ArrayEntry, scale ArrayEntry)] of every Engram table pled holds here."""
    from pled.shared.arrays import is_engram

    found: dict = {}
    for entries in st.arrays.values():
        for t, a in entries:
            if is_engram(a.prefix):
                found.setdefault((id(t), a.prefix), [t, None, None])[1 if a.param == "weight" else 2] = a
    return [(t, w, s) for t, w, s in found.values() if w is not None and s is not None]


def _find(st, layer):
    """(table, weight, scale) pled holds for this layer: ``num_embeddings`` rows of ``dim`` values; None where pled
    holds no Engram table here; PledUnavailable (or None after the fallback's warning) where it holds another."""
    held = _engram_arrays(st)
    if not held:
        return None
    rows, dim = layer.num_embeddings, layer.dim
    fits = [(t, w, s) for t, w, s in held if w.shape == (rows, dim) and s.shape == (rows, dim // layer.block_size)]
    if len(fits) == 1:
        return fits[0]
    if fits:
        why = f"vLLM's Engram layer of {rows} rows is held by more than one table " \
              f"({', '.join(t.name for t, _, _ in fits)}): serve the checkpoint once, or name one with PLED_TABLES"
    else:
        shown = ", ".join(f"{w.prefix} [{w.shape[0]}, {w.shape[1]}] (table {t.name})" for t, w, _ in held[:4])
        why = f"vLLM builds an Engram layer of {rows} rows x {dim} (engram_num_embeddings, engram_head_dim of the " \
              f"model's config), but pled holds {shown}: not this model's checkpoint"
    st.refuse(why, once=f"engram:{rows}", instead="vLLM's own Engram path is used for it, a private copy per rank")
    return None


# -- allocation ------------------------------------------------------------------------------------------------


def _wrap_allocate(original):
    def _allocate_weights(self):
        import torch

        st = held_files.state()
        if st is None or any(not hasattr(self, n) for n in NEEDS):
            return original(self)
        if torch.get_default_device().type == "meta":
            return original(self)
        if not self.cpu_offload or self.peer_rows:
            if _engram_arrays(st):
                _once(st, "engram:gpu", "pled: vLLM's Engram tables are on the GPU here (cpu_offload=False or GPU "
                      "peer tables): left to vLLM; pled serves host tables only")
            return original(self)
        found = _find(st, self)
        if found is None:
            return original(self)
        table, weight, scale = found
        _refuse_dummy(weight, table)
        lo, hi = self.vocab_start_idx, self.vocab_end_idx
        if hi - lo != getattr(self, "part_num_embeddings", hi - lo):
            raise PledUnavailable(f"pled: vLLM's Engram layer {weight.prefix} holds {self.part_num_embeddings} rows "
                                  f"a rank, not its heads' rows {lo}..{hi}")
        views = _views(st, original, self, table, weight, scale, lo, hi)
        if views is not None:
            self._weight_loader = _compare
        return views if views is not None else original(self)

    _allocate_weights.__wrapped__ = original
    _allocate_weights.__pled__ = True
    return _allocate_weights


def _refuse_dummy(weight, table) -> None:
    try:
        import importlib

        config = importlib.import_module("vllm.config").get_current_vllm_config()
        load_format = str(config.load_config.load_format)
    except Exception:  # noqa: BLE001 (no current config: vLLM's loader is not running)
        return
    if load_format == "dummies":
        raise PledUnavailable("pled: load_format=dummy would write vLLM's dummy values into pled's sealed Engram "
                              f"table {weight.prefix} (table {table.name}); load the checkpoint, or start this vLLM "
                              "without pled (unset PLED_SOCKET)")


def _views(st, original, layer, table, weight, scale, lo: int, hi: int):
    """(values as float8_e4m3fn, scales as uint8) of rows [lo, hi), readable by the GPU; None where no route works
    and the fallback allows vLLM's own allocation."""
    import torch

    from pled.client import gpu

    out = []
    for a in (weight, scale):
        try:
            t = gpu.device_view(table, a, lo, hi, what=f"{a.prefix}.{a.param} rows {lo}..{hi} (table {table.name})")
        except gpu.NoRoute as err:
            st.refuse(str(err).removeprefix("pled: "), once="engram:register",
                      instead="vLLM's own Engram path is used, a private copy per rank")
            return None
        out.append(t.view(torch.float8_e4m3fn) if a is weight else t.view(torch.uint8))
    return tuple(out)


# -- the loader ----------------------------------------------------------------------------------------------------


def _name(table, param) -> str:
    """The checkpoint tensor of the array ``param`` views (for errors)."""
    for a in table.manifest.arrays:
        if a.offset <= param.data_ptr() - table.address < a.offset + max(a.nbytes, 1):
            return ", ".join(table.manifest.tensors[s.tensor].name for s in a.sources)
    return f"a tensor of table {table.name}"


def _compare(param, loaded_weight) -> None:
    """Upstream's ``_engram_head_shard_weight_loader`` with its ``copy_`` a comparison: nothing is written."""
    import torch

    st = held_files.current()
    table: Any = st.holding(param.data_ptr()) if st is not None else None
    part_rows = param.shape[0]
    if loaded_weight.dtype == torch.float8_e8m0fnu:
        loaded_weight = loaded_weight.view(torch.uint8)
    shard = loaded_weight.narrow(0, param.engram_vocab_start, part_rows)
    assert shard.shape == param.shape, (  # upstream's own assertion, word for word
        f"engram shard {tuple(shard.shape)} does not fit param {tuple(param.shape)}"
    )
    if table is None:  # not a view of pled's (cannot be: this loader is set with the views); upstream's copy
        param.data.copy_(shard)
        return
    if shard.dtype != param.dtype:
        raise PledUnavailable(f"pled: {_name(table, param)} is {loaded_weight.dtype}, and vLLM's Engram parameter "
                              f"{param.dtype}: a cast, which pled's sealed table cannot take; serve the checkpoint's "
                              "own bytes (F8_E4M3 values, F8_E8M0 scales)")
    from pled.client import private_views  # numpy: only once vLLM loads weights

    if private_views.same_rows(table, shard, param):
        return  # pled served the checkpoint's tensor from the same array (a copy-on-write view of it): the same bytes
    if not torch.equal(shard.contiguous().view(torch.uint8), param.data.view(torch.uint8)):
        raise PledUnavailable(f"pled: {_name(table, param)} differs from the rows pled's region holds for it (table "
                              f"{table.name} generation {table.generation}): the checkpoint changed since pled "
                              "staged it; run `pled reload`, then start vLLM again")


# -- sharing without /dev/shm --------------------------------------------------------------------------------------


def _wrap_share(original, module):
    def can_share_engram_tables(layout, block_size=32):
        st = held_files.state()
        held = _engram_arrays(st) if st is not None else []
        rows = {w.shape[0] for _, w, _ in held}
        size = module.get_engram_dp_size() if callable(getattr(module, "get_engram_dp_size", None)) else 1
        if not held or size <= 1 or not set(getattr(layout, "num_embeddings", ())) <= rows:
            return original(layout, block_size)
        _once(st, "engram:share", f"pled: Engram tables shared across the {size} DP replicas of this node from "
              "pled's one sealed copy (no /dev/shm file, no per-step DP collectives)")
        return True

    can_share_engram_tables.__wrapped__ = original
    can_share_engram_tables.__pled__ = True
    return can_share_engram_tables
