"""DeepSeek V4.1's Engram tables in a model checkpoint (issue 46), beside the PLE tables of checkpoint.py.

Each Engram layer's table is one unsharded tensor pair, ``<head>.engram.embed.weight`` ``[N_L, W]`` F8_E4M3 and
``<head>.engram.embed.scale`` ``[N_L, W/32]`` F8_E8M0 (W = ``engram_head_dim``, 256 in V4.1), rows in bucket order.
vLLM 0.33's ``ParallelEngramEmbedding`` gives each rank rows ``[vocab_start_idx, vocab_end_idx)`` of both for every
TP, Engram-DP and sharing choice, so pled holds them as two arrays in checkpoint order, each on a 2 MiB boundary
(pled.shared.arrays): every rank's slice is then a view. This module names the tensors and checks a pair; a
refusal is a SidecarError naming the file and the tensor.
"""
from __future__ import annotations

from pled.shared import arrays
from pled.shared.boundary import clip
from pled.shared.errors import SidecarError


def engram_name(name: str) -> tuple[str, None, str] | None:
    """(prefix, None, parameter) of an Engram table tensor's name (``layers.1.engram.embed.weight`` ->
    ("layers.1.engram.embed", None, "weight")); None for any other tensor. Total, linear in the name's length."""
    head, sep, param = name.rpartition(arrays.ENGRAM_SUFFIX + ".")
    if not sep or not head or param not in arrays.ENGRAM_PARAMS:
        return None
    return head + arrays.ENGRAM_SUFFIX, None, param


def check_pairs(built: list, shards: tuple) -> None:
    """Each Engram layer's ``weight`` and ``scale`` (PleArray entries of checkpoint.py): both present, F8_E4M3 and
    F8_E8M0 (vLLM keeps the scale's bytes only from float8_e8m0fnu: any other dtype it would convert numerically),
    one scale byte for each 32 values, the same rows."""
    tables: dict[str, dict] = {}
    for a in built:
        if arrays.is_engram(a.prefix):
            tables.setdefault(a.prefix, {})[a.param] = a
    for prefix, pair in tables.items():
        where = shards[next(iter(pair.values())).tensors[0][0]].path
        missing = [p for p in arrays.ENGRAM_PARAMS if p not in pair]
        if missing:
            raise SidecarError(where, f"Engram table {clip(prefix, 160)} has no {missing[0]} tensor "
                                      f"({clip(prefix, 160)}.{missing[0]}): the checkpoint is incomplete")
        for param, dtype in arrays.ENGRAM_DTYPES.items():
            a = pair[param]
            if a.dtype != dtype:
                raise SidecarError(shards[a.tensors[0][0]].path,
                                   f"tensor {clip(a.tensors[0][1].name, 200)!r} is {a.dtype}[{a.rows}, {a.width}]; "
                                   f"an Engram table's {param} is {dtype} (vLLM 0.33 would convert another dtype, and "
                                   "pled serves the checkpoint's bytes): this is not a DeepSeek V4.1 checkpoint")
        weight, scale = pair["weight"], pair["scale"]
        if weight.width % arrays.ENGRAM_BLOCK or scale.width * arrays.ENGRAM_BLOCK != weight.width \
                or weight.rows != scale.rows:
            raise SidecarError(shards[scale.tensors[0][0]].path,
                               f"Engram table {clip(prefix, 160)}: weight [{weight.rows}, {weight.width}] and scale "
                               f"[{scale.rows}, {scale.width}] disagree; the scale has the weight's rows and one "
                               f"byte for each {arrays.ENGRAM_BLOCK} values ([{weight.rows}, "
                               f"{weight.width // arrays.ENGRAM_BLOCK}])")


def pow2(n: int) -> int:
    """What torch's caching host allocator reserves for a pinned ``torch.empty`` of ``n`` bytes: the next power of
    two (vLLM 0.33 says so at engram.py's ``_allocate_weights``)."""
    return 1 << max(0, n - 1).bit_length() if n > 0 else 0


def private_copies(weight_rows: int, width: int, shards: tuple[int, ...] = (1, 2, 4, 8)) -> list[dict]:
    """Per head-shard count (TP, or TP x Engram-DP without sharing): about how many rows a rank holds (vLLM splits
    by whole hash heads, nearly evenly) and what its private pinned copy takes, values and scales each rounded up to
    a power of two."""
    out = []
    for n in shards:
        rows = -(-weight_rows // n)
        values, scales = rows * width, rows * (width // arrays.ENGRAM_BLOCK)
        out.append({"shards": n, "rows": rows, "bytes": values + scales, "pinned_bytes": pow2(values) + pow2(scales)})
    return out
