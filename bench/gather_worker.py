"""One fresh process, one way of reading the table, a run of gather requests: JSON lines out.

    python -m bench.gather_worker mmap DIR --requests 60 --ids 8192
    python -m bench.gather_worker pled TABLE --socket S [--no-populate]

A request is ``ids`` random global row ids (16 ids per token, 512 tokens), gathered and dequantized
with numpy (pled.shared.dequant), the way a CPU dequant worker would. Each request's rows/s is timed alone.
"""
from __future__ import annotations

import argparse
import json
import mmap
import sys
import time

import numpy as np

from pled.daemon.sources.sidecar import open_table
from pled.shared import dequant


def shard_tensors_from_files(directory: str) -> tuple[list[dict], list[int], str]:
    """Each shard file mapped MAP_SHARED read-only, as safetensors' own mmap does, with numpy views."""
    sidecar = open_table(directory)
    views, rows = [], []
    for shard in sidecar.shards:
        with open(shard.path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        views.append({t.name: dequant.view(m, t.begin, t.dtype, t.shape) for t in shard.header.tensors})
        rows.append(shard.rows)
    return views, rows, sidecar.layout


def shard_tensors_from_pled(table: str, socket: str, populate: bool) -> tuple[list[dict], list[int], str, float]:
    from pled.client import attach

    t = attach(table, socket=socket, populate=populate, timeout=600)
    m = t.manifest
    views = [{} for _ in m.shards]
    for e in m.tensors:
        views[e.shard][e.name] = dequant.view(t.buffer, e.offset, e.dtype, e.shape)
    shard_tensors_from_pled.keep = t  # the mapping lives as long as the process
    return views, [s.rows for s in m.shards], m.layout, t.populate_seconds


def gather(views: list[dict], starts: np.ndarray, layout: str, ids: np.ndarray) -> np.ndarray:
    shard = np.searchsorted(starts, ids, side="right") - 1
    out = np.empty((len(ids), 160), dtype=np.float32)
    order = np.argsort(shard, kind="stable")
    bounds = np.searchsorted(shard[order], np.arange(len(views) + 1))
    for s in range(len(views)):
        where = order[bounds[s] : bounds[s + 1]]
        if len(where):
            out[where] = dequant.dequant_rows(layout, views[s], ids[where] - starts[s])
    return out


def warm_up_code(views: list[dict], layout: str, n: int) -> None:
    """Run the gather code a few times over a small copy in anonymous memory, never touching the table:
    the first request then measures the table's pages, not numpy's and Python's first-call costs."""
    small = 4096
    dummy = [{k: np.zeros((small, *v.shape[1:]) if v.ndim else (), dtype=v.dtype) for k, v in shard.items()}
             for shard in views]
    starts = np.arange(len(dummy), dtype=np.int64) * small
    rng = np.random.default_rng(0)
    for _ in range(3):
        gather(dummy, starts, layout, rng.integers(0, small * len(dummy), size=n, dtype=np.int64))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("source", choices=["mmap", "pled"])
    p.add_argument("target", help="sidecar directory (mmap) or table name (pled)")
    p.add_argument("--socket")
    p.add_argument("--no-populate", action="store_true")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--ids", type=int, default=8192)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    t0 = time.perf_counter()
    populate = 0.0
    if a.source == "mmap":
        views, rows, layout = shard_tensors_from_files(a.target)
    else:
        views, rows, layout, populate = shard_tensors_from_pled(a.target, a.socket, not a.no_populate)
    setup = time.perf_counter() - t0
    starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    total = int(sum(rows))
    warm_up_code(views, layout, a.ids)
    rng = np.random.default_rng(a.seed)
    rates = []
    for _ in range(a.requests):
        ids = rng.integers(0, total, size=a.ids, dtype=np.int64)
        t = time.perf_counter()
        gather(views, starts, layout, ids)
        rates.append(a.ids / (time.perf_counter() - t))
    json.dump({"setup_s": setup, "populate_s": populate, "rows_per_s": rates}, sys.stdout)


if __name__ == "__main__":
    main()
