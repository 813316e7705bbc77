"""A synthetic sidecar in the exact shipped format, deterministic from a seed, with a META.json in the
published form (fp8's layout string is pled's own: the published one is not known; see
pled.daemon.sidecar_meta).

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

from pled.daemon.safetensors_file import write
from pled.daemon.sidecar_meta import META_LAYOUT
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
    # The published form (see pled.daemon.sidecar_meta): its layout string, shards, rows in all, width; then ours.
    even = len(set(per_shard)) == 1
    meta = {"layout": META_LAYOUT[layout], "shards": len(per_shard), "rows": sum(per_shard), "width": width,
            "rows_per_shard": per_shard[0] if even else per_shard, "seed": seed, "generator": "pled make-sidecar",
            "digests": digests}
    with open(os.path.join(directory, "META.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    return paths
