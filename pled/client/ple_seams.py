"""vLLM 0.33's own PLE path on pled's pages: each rank's pinned PLE table a view of one sealed region.

vLLM 0.33's default PLE path (``Qwen4ExpPLEPinnedHostEmbedding``, ``EngramConfig.cpu_offload``) gives every rank of
its embedding group a private pinned copy of its rows and copies the checkpoint's rows into it at every start. With
pled serving the checkpoint's PLE tables as arrays (a ``checkpoint`` table), three seams make that copy a view:

- ``allocate_embedding_weight(self, num_embeddings, embedding_dim, dtype)`` of ``Qwen4ExpPLEPinnedHostEmbedding``:
  where pled holds the array for ``self.prefix`` (its parameter told by dtype and width) with
  ``self.num_embeddings_padded`` rows, a tensor whose storage starts at this rank's rows
  ``[org_vocab_start_index, org_vocab_end_index)``, made readable by the GPU through the route pled.client.gpu
  chooses for the table and device (``gpu.device_view``) before vLLM builds its UVA view; else vLLM's own allocation.
- ``PLEVocabParallelEmbedding.weight_loader`` (never ``VocabParallelEmbedding``'s, which every embedding uses): where
  the destination lies in pled's mapping (by address: vLLM's parameter wrappers drop attributes), upstream's checks,
  then a comparison instead of the copy; a difference or a cast is refused naming the tensor; nothing is written.
  The checkpoint's shard tensors come from pled too (the loader seams serve a file's tensors, as copy-on-write
  views of the same pages: pled.client.private_views), so the comparison is an identity check (the same table and
  offset, and no page of them written in this process) and no PLE byte is read from disk.
- The module's own ``get_accelerator_view_from_cpu_tensor`` (``gpu.guard_uva``): for a pled tensor, the view its
  route allows (pinned: the helper's own zero-copy view; pageable: a device tensor at the host address), and never
  the helper's silent private copy (a pled tensor that is not pinned is refused).

Each seam is found by attribute and signature, never by version string. One that does not fit, while pled serves
arrays to this process, fails the import of the model's module with the reason (or, with ``fallback = "disk"``, warns
once and leaves vLLM's own path). Without pled configured, or left out by ``VLLM_PLUGINS``, everything here calls
vLLM's original. No torch or vLLM import until vLLM imports these modules.
"""
from __future__ import annotations

import inspect

from pled.client import held_files
from pled.client.held_files import PledUnavailable

PINNED = "vllm.models.qwen4_exp.common.ngram_embedding"
PLE = "vllm.models.qwen4_exp.common.ple"
PINNED_CLASS = "Qwen4ExpPLEPinnedHostEmbedding"
PLE_CLASS = "PLEVocabParallelEmbedding"
NVFP4_CLASS = "Qwen4ExpPLENvFp4EmbeddingMethod"
UVA = "get_accelerator_view_from_cpu_tensor"
ALLOCATE_PARAMS = ("self", "num_embeddings", "embedding_dim", "dtype")
LOADER_PARAMS = ("self", "param", "loaded_weight", "checkpoint_start")
# torch dtype name -> the safetensors dtype pled's arrays are recorded in
_CODES = {"uint8": "U8", "int8": "I8", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "bfloat16": "BF16",
          "float16": "F16", "float32": "F32"}


class SeamUnfit(PledUnavailable):
    """A seam pled needs does not fit this vLLM, and pled serves arrays here: the import fails with the reason."""

    fatal_to_import = True  # pled.client.import_hook lets it through


def _params(function) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()


def _unfit(module, why: str) -> None:
    """A seam that does not fit: nothing to do without pled's arrays here; else the load fails (or warns, with the
    disk fallback) instead of quietly giving vLLM's private copy."""
    try:
        st = held_files.state()  # attaches (once a process): whether pled serves arrays here is the tables' to say
        if st is None or not st.arrays:
            return
        st.refuse(f"vLLM's {module.__name__} does not fit pled's seam: {why}", once=f"unfit:{module.__name__}",
                  instead="vLLM's own PLE path is used, a private pinned copy per rank")
    except PledUnavailable as err:
        raise SeamUnfit(str(err)) from None


def patch_pinned(module) -> None:
    """Wrap the pinned allocation and guard the UVA helper of vLLM's ngram_embedding module."""
    cls = getattr(module, PINNED_CLASS, None)
    original = getattr(cls, "allocate_embedding_weight", None)
    uva = getattr(module, UVA, None)
    if getattr(original, "__pled__", False):
        return
    if original is None or _params(original) != ALLOCATE_PARAMS:
        return _unfit(module, f"{PINNED_CLASS}.allocate_embedding_weight is "
                              f"({', '.join(_params(original)) or 'missing'}), not ({', '.join(ALLOCATE_PARAMS)})")
    if not callable(uva):
        return _unfit(module, f"it has no {UVA}")
    setattr(cls, "allocate_embedding_weight", _wrap_allocate(original))  # noqa: B010 (cls is found by name)
    from pled.client import gpu

    setattr(module, UVA, gpu.guard_uva(uva))
    nvfp4 = getattr(module, NVFP4_CLASS, None)
    create = getattr(nvfp4, "create_weights", None)
    if callable(create) and not getattr(create, "__pled__", False):
        setattr(nvfp4, "create_weights", _wrap_create(module, create))  # noqa: B010 (found by name)


def _wrap_create(module, original):
    """NVFP4's create_weights takes the UVA view of its block scales only where they are pinned (C:447): on the
    pageable route nothing is registered, so for pled's scales the view is taken here, through the guarded helper
    (a device tensor at the host address), instead of being left missing for the lookup to fail on."""
    def create_weights(self, layer, *args, **kwargs):
        original(self, layer, *args, **kwargs)
        scale = getattr(layer, "weight_scale", None)
        st = held_files.current()
        if (scale is not None and not hasattr(self, "_uva_weight_scale") and st is not None
                and st.holding(scale.data_ptr()) is not None):
            self._uva_weight_scale = getattr(module, UVA)(scale)

    create_weights.__wrapped__ = original
    create_weights.__pled__ = True
    return create_weights


def patch_ple(module) -> None:
    """Wrap PLEVocabParallelEmbedding.weight_loader of vLLM's ple module."""
    cls = getattr(module, PLE_CLASS, None)
    original = getattr(cls, "weight_loader", None)
    if getattr(original, "__pled__", False):
        return
    if original is None or _params(original) != LOADER_PARAMS or not callable(getattr(cls, "_compute_shard_overlap",
                                                                                          None)):
        return _unfit(module, f"{PLE_CLASS}.weight_loader is ({', '.join(_params(original)) or 'missing'}), not "
                              f"({', '.join(LOADER_PARAMS)}), or it has no _compute_shard_overlap")
    setattr(cls, "weight_loader", _wrap_loader(original))  # noqa: B010 (cls is found by name)


# -- allocation ------------------------------------------------------------------------------------------------


def _find(st, layer, dtype, width: int):
    """(table, ArrayEntry) pled holds for ``layer``'s prefix, of this dtype, width and row count; None where it holds
    no array for the layer; PledUnavailable (or None after a fallback warning) where it holds one vLLM cannot view as
    it is (a cast, another row count, two tables)."""
    from pled.shared.arrays import layer_key

    prefix, rows = layer.prefix, layer.num_embeddings_padded
    candidates = [(t, a) for t, a in st.arrays.get(layer_key(prefix), []) if a.prefix == prefix or
                  not a.prefix.startswith("mtp.")]
    if not candidates:
        return None
    code = _CODES.get(str(dtype).removeprefix("torch."))
    fits = [(t, a) for t, a in candidates if a.shape[1] == width and a.shape[0] == rows]
    exact = [(t, a) for t, a in fits if a.dtype == code]
    if len(exact) == 1:
        return exact[0]
    what = f"{prefix} ({dtype}, width {width}, {rows} rows)"

    def held(found) -> str:
        return ", ".join(f"{a.param} {a.dtype} width {a.shape[1]} (table {t.name})" for t, a in found)

    if exact:
        why = f"vLLM's {what} is held by more than one table ({held(exact)}): serve the checkpoint once, or name " \
              "one table with PLED_TABLES"
    elif fits:
        why = f"vLLM asks for {what}, but pled holds {held(fits)}: a cast, and pled serves a PLE table only in " \
              "its checkpoint's dtype (vLLM's --dtype or quantization differs)"
    else:
        same = [f"{a.prefix}.{a.param} with {a.shape[0]} rows (table {t.name})" for t, a in candidates
                if a.shape[1] == width and a.dtype == code] or [held(candidates)]
        why = f"pled holds {', '.join(same)}, but vLLM's {prefix} has {rows}: not this model's checkpoint"
    st.refuse(why, once=f"find:{prefix}:{dtype}", instead="vLLM's own PLE path is used for it, a private pinned copy")
    return None


def _wrap_allocate(original):
    def allocate_embedding_weight(self, num_embeddings, embedding_dim, dtype):
        st = held_files.state()
        found = _find(st, self, dtype, embedding_dim) if st is not None else None
        if found is None:
            return original(self, num_embeddings, embedding_dim, dtype)
        table, array = found
        lo, hi = self.shard_indices.org_vocab_start_index, self.shard_indices.org_vocab_end_index
        if hi - lo != num_embeddings:
            raise PledUnavailable(f"pled: vLLM asks for {num_embeddings} rows of {array.prefix}.{array.param}, but "
                                  f"this rank's range is rows {lo}..{hi}")
        return _pinned_view(st, original, self, table, array, lo, hi, (num_embeddings, embedding_dim, dtype))

    allocate_embedding_weight.__wrapped__ = original
    allocate_embedding_weight.__pled__ = True
    return allocate_embedding_weight


def _pinned_view(st, original, layer, table, array, lo: int, hi: int, args):
    """Rows ``[lo, hi)`` of ``array`` as a tensor whose storage starts at row ``lo``, readable by the GPU through
    the route pled.client.gpu chooses for the table and device; vLLM's own allocation where none works and the
    fallback allows it."""
    from pled.client import gpu

    what = f"{array.prefix}.{array.param} rows {lo}..{hi} (table {table.name})"
    try:
        return gpu.device_view(table, array, lo, hi, what=what)
    except gpu.NoRoute as err:
        st.refuse(str(err).removeprefix("pled: "), once="register",
                  instead="vLLM's own PLE path is used, a private pinned copy per rank")
        return original(layer, *args)


# -- the loader --------------------------------------------------------------------------------------------------


def _wrap_loader(original):
    def weight_loader(self, param, loaded_weight, checkpoint_start=None):
        st = held_files.current()
        table = st.holding(param.data_ptr()) if st is not None else None
        if table is None:
            return original(self, param, loaded_weight, checkpoint_start)
        return _compare(self, table, param, loaded_weight, checkpoint_start)

    weight_loader.__wrapped__ = original
    weight_loader.__pled__ = True
    return weight_loader


def _source_name(table, param, start: int | None) -> str:
    """The checkpoint tensor whose rows begin at ``start`` in the array ``param`` views (for errors)."""
    for a in table.manifest.arrays:
        row = a.row_bytes
        if row and a.offset <= param.data_ptr() - table.address < a.offset + a.nbytes:
            for src in a.sources:
                if start is None or src.rows[0] == start:
                    return table.manifest.tensors[src.tensor].name
            return f"{a.prefix}.{a.param} rows from {start}"
    return f"a tensor of table {table.name}"


def _compare(layer, table, param, loaded, checkpoint_start) -> None:
    """Upstream's checks (PLEVocabParallelEmbedding._copy_embedding_shard_, or VocabParallelEmbedding's for the
    unsharded form), then the rows compared, never copied."""
    import torch

    def name() -> str:  # for an error only: finding it walks the manifest
        return _source_name(table, param, checkpoint_start)

    if loaded.dtype != param.dtype:
        raise PledUnavailable(f"pled: {name()} is {loaded.dtype}, and vLLM's table {param.dtype}: a cast, which pled's "
                              "sealed table cannot take; serve a checkpoint in the model's dtype")
    start, end = layer.shard_indices.org_vocab_start_index, layer.shard_indices.org_vocab_end_index
    if checkpoint_start is None:  # the unsharded ngram_embedding.weight: this rank's rows of the whole table
        if loaded.ndim != param.ndim or loaded.shape[0] < end or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"{name()}: {tuple(loaded.shape)} does not hold rows {start}..{end} of "
                             f"{tuple(param.shape)}")
        source, target = loaded.narrow(0, start, end - start), param.narrow(0, 0, end - start)
    else:
        if param.ndim == 0 or loaded.ndim != param.ndim:
            raise ValueError("destination and loaded weight must have matching ranks")
        if param.shape[1:] != loaded.shape[1:]:
            raise ValueError("embedding shard dimensions do not match: "
                             f"{tuple(param.shape[1:])} != {tuple(loaded.shape[1:])}")
        if param.shape[0] < end - start:
            raise ValueError("destination does not cover the requested TP range")
        overlap = layer._compute_shard_overlap(checkpoint_start=checkpoint_start, checkpoint_rows=loaded.shape[0])
        if overlap is None:
            return
        source = loaded.narrow(0, overlap.source_start, overlap.row_count)
        target = param.narrow(0, overlap.destination_start, overlap.row_count)
    from pled.client import private_views  # numpy: only once vLLM loads weights

    if private_views.same_rows(table, source, target):
        return  # pled served the checkpoint's tensor from the same array: the same bytes
    if not torch.equal(source.contiguous().view(torch.uint8), target.view(torch.uint8)):
        raise PledUnavailable(f"pled: {name()} differs from the rows pled's region holds for it (table {table.name} "
                              "generation "f"{table.generation}): the checkpoint changed since pled staged it; run "
                              "`pled reload`, then start vLLM again")

