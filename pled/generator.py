"""A synthetic sidecar in the exact shipped format, deterministic from a seed, with a META.json in the
published form (fp8's layout string is pled's own: the published one is not known; see
pled.daemon.sources.sidecar_meta).

Values are real quantized data: every code dequantizes to a finite number
(fp8 codes skip the NaN patterns, scales are positive), so tests and benchmarks
can check rows end to end against pled.shared.dequant.

Each shard's tensors are written in the layout's order with no padding between them, as the safetensors
format allows: a tensor starts at a multiple of its dtype's size only when the ones before it end there
(nvfp4's float32 ``weight_scale_2`` does not when the shard's rows are not a multiple of 4).
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from pled.daemon.sources.safetensors_file import write
from pled.daemon.sources.sidecar_meta import META_LAYOUT
from pled.shared import layouts


def _fp8_codes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    codes = rng.integers(0, 254, size=shape, dtype=np.uint16)
    return (codes + (codes >= 0x7F)).astype(np.uint8)  # skip 0x7F and 0xFF, the NaNs


def _positive_fp8_scale(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    # Exponent fields 4..10: scales from 2**-3 to about 15, normal numbers only.
    return rng.integers(4 << 3, 11 << 3, size=shape, dtype=np.uint8)


def shard_tensors(layout: str, rows: int, width: int,
                  rng: np.random.Generator) -> list[tuple[str, str, tuple[int, ...], np.ndarray]]:
    if layout == "ples_fp8":
        return [
            ("weight_fp8", "F8_E4M3", (rows, width), _fp8_codes(rng, (rows, width))),
            ("weight_scale", "F32", (rows,), rng.uniform(1e-3, 2e-2, size=rows).astype(np.float32)),
        ]
    if layout == "ples_int4":
        return [
            ("weight_i4", "U8", (rows, width // 2), rng.integers(0, 256, size=(rows, width // 2), dtype=np.uint8)),
            ("weight_scale", "F16", (rows, width // 16),
             rng.uniform(1e-3, 5e-2, size=(rows, width // 16)).astype(np.float16)),
        ]
    if layout == "ples_nvfp4":
        return [
            ("weight_e2m1", "U8", (rows, width // 2), rng.integers(0, 256, size=(rows, width // 2), dtype=np.uint8)),
            ("weight_scale", "F8_E4M3", (rows, width // 16), _positive_fp8_scale(rng, (rows, width // 16))),
            ("weight_scale_2", "F32", (), np.array(rng.uniform(1e-3, 1e-2), dtype=np.float32)),
        ]
    raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(layouts.LAYOUTS)}")


def make_sidecar(directory: str, layout: str = "ples_int4", shards: int | None = None, rows: int | Sequence[int] = 1024,
                 width: int = 160, seed: int = 0) -> list[str]:
    """Write ``shard_0..shard_{N-1}.safetensors`` and META.json; return the shard paths.

    ``rows``: every shard's rows (``shards`` of them, 4 when not given), or a list of each shard's rows for
    uneven shards (``shards``, if given, must be its length). Shard i's values depend on ``seed`` and i alone,
    so a shard with the same rows is the same file whatever the other shards are."""
    if layout not in layouts.LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(layouts.LAYOUTS)}")
    if isinstance(rows, (int, np.integer)):
        per_shard = [int(rows)] * (4 if shards is None else shards)
    else:
        per_shard = [int(r) for r in rows]
        if shards is not None and shards != len(per_shard):
            raise ValueError(f"rows lists {len(per_shard)} shards' rows but shards = {shards}")
    if not per_shard or min(per_shard) < 1 or width < 16 or width % 16:
        raise ValueError("need shards >= 1, rows >= 1 and a width that is a positive multiple of 16")
    os.makedirs(directory, exist_ok=True)
    paths, digests = [], {}
    for i, count in enumerate(per_shard):
        rng = np.random.default_rng([seed, i])
        path = os.path.join(directory, f"shard_{i}.safetensors")
        digests[os.path.basename(path)] = write(
            path, [(n, d, s, a.tobytes() if a.ndim == 0 else memoryview(np.ascontiguousarray(a)).cast("B"))
                   for n, d, s, a in shard_tensors(layout, count, width, rng)],
            metadata={"format": "pt", "layout": layout})
        paths.append(path)
    # The published form (pled.daemon.sources.sidecar_meta): its layout string, shards, rows in all, width; then ours.
    even = len(set(per_shard)) == 1
    meta = {"layout": META_LAYOUT[layout], "shards": len(per_shard), "rows": sum(per_shard), "width": width,
            "rows_per_shard": per_shard[0] if even else per_shard, "seed": seed, "generator": "pled make-sidecar",
            "digests": digests}
    with open(os.path.join(directory, "META.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    return paths


# -- a model checkpoint's PLE tables (the arrays form: pled.daemon.sources.checkpoint) -------------------------------

CHECKPOINT_DTYPES = ("bf16", "fp8", "nvfp4")
PLE_PREFIX = "model.language_model.layers.{layer}.ple.ple_embedding"  # as Qwen4Exp checkpoints name them


def shard_rows(rows: int, parts: int) -> list[int]:
    """vLLM 0.33's split of ``rows`` into ``parts`` checkpoint shards: ceil(rows / parts) each, then the rest, then
    empty ones (nvidia/ngram_embedding.py, load_weights)."""
    size = -(-rows // parts)
    return [max(0, min(size, rows - i * size)) for i in range(parts)]


def _ple_tensors(dtype: str, prefix: str, rows: int, width: int, parts: int,
                 rng: np.random.Generator) -> list[tuple[str, str, tuple[int, ...], np.ndarray]]:
    out: list[tuple[str, str, tuple[int, ...], np.ndarray]] = []
    for i, count in enumerate(shard_rows(rows, parts)):
        shard = f"{prefix}.ngram_embedding.shard_{i}"
        if dtype == "bf16":
            bits = rng.standard_normal((count, width), dtype=np.float32).view(np.uint32) >> 16
            out.append((f"{shard}.weight", "BF16", (count, width), bits.astype(np.uint16)))
        elif dtype == "fp8":
            out.append((f"{shard}.weight", "F8_E4M3", (count, width), _fp8_codes(rng, (count, width))))
        else:
            out.append((f"{shard}.weight", "U8", (count, width // 2),
                        rng.integers(0, 256, size=(count, width // 2), dtype=np.uint8)))
            out.append((f"{shard}.weight_scale", "F8_E4M3", (count, width // 16),
                        _positive_fp8_scale(rng, (count, width // 16))))
    scale = np.array([rng.uniform(1e-3, 1e-2)], dtype=np.float32)
    if dtype == "fp8":
        out.append((f"{prefix}.ngram_embedding.weight_scale", "F32", (1,), scale))
    elif dtype == "nvfp4":
        out.append((f"{prefix}.ngram_embedding.weight_scale_2", "F32", (1,), scale))
    return out


def make_checkpoint(directory: str, dtype: str = "nvfp4", rows: dict[int, int] | None = None, width: int = 64,
                    parts: int = 7, files: int = 3, seed: int = 0, index: bool = True,
                    extra: Sequence[tuple[str, str, tuple[int, ...], np.ndarray]] = ()) -> list[str]:
    """Write a model checkpoint whose PLE tables are ``rows`` (layer id -> padded rows; each layer's differ), each
    split into ``parts`` shard tensors as vLLM 0.33 reads them, beside other tensors (a norm per layer, and
    ``extra``: (name, dtype, shape, array), file K getting ``extra[K::files]``), over ``files`` files
    ``model-0000K-of-0000N.safetensors`` and, with ``index``, model.safetensors.index.json.
    Tensors follow each other with no alignment, as the format allows. Returns the file paths."""
    if dtype not in CHECKPOINT_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(CHECKPOINT_DTYPES)}")
    rows = rows or {0: 1000, 1: 1234}
    rng = np.random.default_rng(seed)
    tensors: list[tuple[str, str, tuple[int, ...], np.ndarray]] = []
    for layer, count in sorted(rows.items()):
        prefix = PLE_PREFIX.format(layer=layer)
        tensors.append((f"model.language_model.layers.{layer}.input_layernorm.weight", "F32", (width,),
                        rng.standard_normal(width, dtype=np.float32)))
        tensors += _ple_tensors(dtype, prefix, count, width, parts, rng)
    os.makedirs(directory, exist_ok=True)
    per_file = -(-len(tensors) // files)
    paths, weight_map = [], {}
    for k in range(files):
        chunk = tensors[k * per_file:(k + 1) * per_file] + list(extra[k::files])
        path = os.path.join(directory, f"model-{k + 1:05d}-of-{files:05d}.safetensors")
        write(path, [(n, d, s, np.ascontiguousarray(a).reshape(-1).view(np.uint8).data) for n, d, s, a in chunk],
              metadata={"format": "pt"})
        weight_map.update({n: os.path.basename(path) for n, _, _, _ in chunk})
        paths.append(path)
    if index:
        with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            total = sum(a.nbytes for *_, a in [*tensors, *extra])
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return paths


# -- DeepSeek V4.1's Engram tables (pled.daemon.sources.engram) --------------------------------------------------------

ENGRAM = {"engram_layer_ids": [1, 3], "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 256,
          "engram_vocab_size": 50}  # the smallest real head structure: 4 hash heads a layer, 2 layers


def _is_prime(n: int) -> bool:
    """vLLM 0.33's own test (deepseek_v41 engram.py ``_is_prime``), kept as it is: trial division by the primes to 37,
    then Miller-Rabin with bases 2, 7 and 61, which also calls 61 itself composite. Its layouts skip 61, so a
    checkpoint made with any other test would not match vLLM's row counts (vocab 50: 250 and 324 rows, not 240)."""
    if n < 2:
        return False
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in (2, 7, 61):
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_head_sizes(config: dict) -> list[list[int]]:
    """Each Engram layer's hash-head sizes as vLLM 0.33's EngramLayout draws them: per layer, n-gram order and head,
    the next prime above ``engram_vocab_size - 1`` not yet taken, across layers in order (deepseek_v41 engram.py)."""
    seen: set[int] = set()
    out = []
    for _ in config["engram_layer_ids"]:
        layer = []
        for _ in range(config["engram_max_ngram_size"] - 1):
            current = config["engram_vocab_size"] - 1
            for _ in range(config["engram_n_heads"]):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                layer.append(current)
        out.append(layer)
    return out


def engram_config(config: dict | None = None) -> dict:
    """The text config keys of a synthetic DeepSeek V4.1 Engram model: ``config`` (default ENGRAM) with
    ``engram_num_embeddings`` the sums of each layer's head sizes (no padding rows, as in V4.1)."""
    c = dict(ENGRAM if config is None else config)
    c.setdefault("engram_compressed_vocab_size", 1000)
    c.setdefault("engram_pad_token_id", 0)
    c["engram_num_embeddings"] = [sum(h) for h in engram_head_sizes(c)]
    return c


def make_engram_checkpoint(directory: str, config: dict | None = None, files: int = 2, seed: int = 0,
                           index: bool = True) -> tuple[list[str], dict]:
    """Write a DeepSeek V4.1-style checkpoint whose Engram layers (``engram_config(config)``) each have
    ``layers.L.engram.embed.weight`` [N_L, head_dim] F8_E4M3 and ``….scale`` [N_L, head_dim/32] F8_E8M0, beside other
    tensors (per layer a norm and the Engram's own small projection; the token embedding), over ``files`` files
    ``model-0000K-of-0000N.safetensors`` with, with ``index``, model.safetensors.index.json, and config.json (its
    ``text_config``). One layer's table is drawn a million rows at a time (a checkpoint of many GiB is written in
    bounded memory). Returns (the file paths, the config)."""
    c = engram_config(config)
    dim = c["engram_head_dim"]
    rng = np.random.default_rng(seed)
    small = 64
    tensors: list = [("embed.weight", "BF16", (small, small), rng.integers(0, 1 << 15, (small, small), np.uint16))]
    for layer, rows in zip(c["engram_layer_ids"], c["engram_num_embeddings"], strict=True):
        tensors.append((f"layers.{layer}.attn_norm.weight", "F32", (small,), rng.standard_normal(small, np.float32)))
        tensors.append((f"layers.{layer}.engram.embed.weight", "F8_E4M3", (rows, dim), ("codes", rows, dim, layer)))
        tensors.append((f"layers.{layer}.engram.embed.scale", "F8_E8M0", (rows, dim // 32),
                        ("scales", rows, dim // 32, layer)))
        tensors.append((f"layers.{layer}.engram.value_proj.weight", "BF16", (small, dim),
                        rng.integers(0, 1 << 15, (small, dim), np.uint16)))
    os.makedirs(directory, exist_ok=True)
    per_file = -(-len(tensors) // files)
    paths, weight_map = [], {}
    for k in range(files):
        chunk = tensors[k * per_file:(k + 1) * per_file]
        path = os.path.join(directory, f"model-{k + 1:05d}-of-{files:05d}.safetensors")
        _write_chunked(path, [(n, d, s, _engram_data(a, seed)) for n, d, s, a in chunk])
        weight_map.update({n: os.path.basename(path) for n, _, _, _ in chunk})
        paths.append(path)
    if index:
        with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump({"architectures": ["DeepseekV41ForCausalLM"], "text_config": c}, f, indent=2)
    return paths, c


CHUNK_ROWS = 1 << 18


def _engram_data(a, seed: int):
    """A tensor's bytes: an array's, or (codes|scales, rows, width, layer) drawn a chunk of rows at a time."""
    if not isinstance(a, tuple):
        return np.ascontiguousarray(a).reshape(-1).view(np.uint8).data
    kind, rows, width, layer = a

    def chunks():
        for i, lo in enumerate(range(0, rows, CHUNK_ROWS)):
            n = min(CHUNK_ROWS, rows - lo)
            rng = np.random.default_rng([seed, layer, kind == "scales", i])
            # e4m3 codes without the NaNs; ue8m0 exponents 120..134 (scales 2**-7 .. 2**7, never the NaN 0xFF)
            block = _fp8_codes(rng, (n, width)) if kind == "codes" else rng.integers(120, 135, (n, width), np.uint8)
            yield memoryview(block).cast("B")

    return chunks()


def _write_chunked(path: str, tensors: list) -> None:
    """A safetensors file whose tensors' bytes are a buffer or an iterator of buffers (of 1-byte dtypes: their size
    is their shape's), written in order and synced (clean pages, droppable from the page cache)."""
    import struct

    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, data in tensors:
        n = memoryview(data).nbytes if not hasattr(data, "__next__") else int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, _, _, data in tensors:
            for part in (data if hasattr(data, "__next__") else (data,)):
                f.write(part)
        f.flush()
        os.fsync(f.fileno())
