"""vLLM's PLE offload worker ("CPU dequant worker"), played as the Flash-Next builds run it (their
``_PleQuantTable``). Imports nothing of pled.

    python bench/ple_offload_worker.py SIDECAR_DIR [--model-rows 320001536] [--model-width 160] [--workers 2]
                                       [--requests N] [--ids 8192] [--check ID,ID] [--hold]

The parent (a GPU worker, in vLLM) starts each worker with multiprocessing's spawn method: a fresh
interpreter that never loads vLLM's plugins. A worker is given the model's PLE parameter shape (``--model-rows``,
``--model-width``: by default the published model's, 128 shards x 2,500,012 rows, width 160). It reads META.json
(the published form: layout, shards, rows, width) and checks it as the published worker does, with its rows per
shard hard-coded (2,500,012, never taken from META.json):

    assert n_shards * 2_500_012 == META rows;  assert META rows == model rows;  assert META width == model width

so a sidecar of any other shape is refused (the worker fails with that AssertionError). Then for every shard
``from safetensors import safe_open``, ``f = safe_open(shard, framework="pt")`` without ``with`` (the handles
are kept in a list for the worker's lifetime), ``get_tensor()`` of the main tensor and ``weight_scale``, and,
where ``"weight_scale_2" in f.keys()``, ``get_tensor("weight_scale_2").item()`` (a Python float); it keeps the
tensors. Each request gathers ``ids`` random rows by global id (shard = id // 2,500,012) and dequantizes them
with torch ops. Whatever pled does, it does through the environment (its start-up hook, PLED_SOCKET): nothing
here knows of it.

Each worker reports one JSON line on stdout: pid, seconds to load the table, the seconds of each
request, the rows of ``--check`` ids, and what /proc/self/maps says its tensors are mappings of.
With ``--hold`` the parent prints ``HOLDING`` once all workers loaded and waits for a line on stdin
(a test looks at the workers meanwhile). A worker that fails prints its error (``"error"``: type and message)
and exits 1.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import traceback

ROWS_PER_SHARD = 2_500_012  # hard-coded in the published worker, as in the published sidecar
PUBLISHED_SHARDS = 128
MODEL_ROWS = PUBLISHED_SHARDS * ROWS_PER_SHARD  # 320,001,536: the published model's PLE rows
MODEL_WIDTH = 160
MAIN = {"ples_nvfp4": "weight_e2m1", "ples_fp8": "weight_fp8", "ples_int4": "weight_i4"}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def family(layout: str) -> str:
    """The readers' rule: e2m1 -> nvfp4, then e4m3 -> fp8, otherwise int4."""
    return "ples_nvfp4" if "e2m1" in layout else "ples_fp8" if "e4m3" in layout else "ples_int4"


def load(directory: str, model_rows: int, model_width: int) -> tuple[dict, list[dict], list]:
    """META.json checked against the model, then every shard opened and its tensors kept: (table, shards, handles)."""
    with open(os.path.join(directory, "META.json"), encoding="utf-8") as f:
        meta = json.load(f)
    n_shards, total_rows, width = meta["shards"], meta["rows"], meta["width"]
    assert n_shards * ROWS_PER_SHARD == total_rows, \
        f"PLE sidecar: {n_shards} shards x {ROWS_PER_SHARD} rows != {total_rows} rows in META.json"
    assert total_rows == model_rows, f"PLE sidecar: META.json rows {total_rows} != model rows {model_rows}"
    assert width == model_width, f"PLE sidecar: META.json width {width} != model width {model_width}"
    table = {"family": family(meta["layout"]), "rows": total_rows, "width": width, "rows_per_shard": ROWS_PER_SHARD}

    handles, shards = [], []
    for n in range(n_shards):
        from safetensors import safe_open

        f = safe_open(os.path.join(directory, f"shard_{n}.safetensors"), framework="pt")
        handles.append(f)  # kept open for the worker's lifetime, as the published worker keeps its handles
        t = {"main": f.get_tensor(MAIN[table["family"]]), "scale": f.get_tensor("weight_scale")}
        if "weight_scale_2" in f.keys():
            t["scale_2"] = f.get_tensor("weight_scale_2").item()
        t["opened_as"] = type(f).__name__
        shards.append(t)
    return table, shards, handles


def tensors_of(t: dict) -> dict:
    """A shard's kept tensors (not its opener's name, nor the float weight_scale_2)."""
    return {k: v for k, v in t.items() if k in ("main", "scale")}


def gather(meta: dict, shards: list[dict], ids, out):
    """Rows ``ids`` (global) dequantized into ``out`` [len(ids), width] float32, with torch ops."""
    import torch

    per = meta["rows_per_shard"]
    which, local = ids // per, ids % per
    for s in torch.unique(which).tolist():
        where = (which == s).nonzero().squeeze(1)
        rows = local[where]
        t = shards[s]
        if meta["family"] == "ples_fp8":
            deq = t["main"].index_select(0, rows).float() * t["scale"].index_select(0, rows)[:, None]
        else:
            packed = t["main"].index_select(0, rows)
            codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(len(rows), -1)
            scale = t["scale"].index_select(0, rows).float().repeat_interleave(16, dim=1)
            if meta["family"] == "ples_int4":
                deq = (codes.float() - 8) * scale
            else:
                deq = torch.tensor(E2M1)[codes.long()] * scale * t["scale_2"]  # a float: weight_scale_2's .item()
        out.index_copy_(0, where, deq)
    return out


def warm_up(meta: dict, shards: list[dict], n_ids: int) -> None:
    """Run the gather code over small zero tensors of the same dtypes, never touching the table: the first
    request then measures the table's pages, not torch's first-call costs."""
    import torch

    small = {**meta, "rows_per_shard": 256}
    dummy = [{k: torch.zeros((256, *v.shape[1:]), dtype=v.dtype) for k, v in tensors_of(t).items()}
             | ({"scale_2": 1.0} if "scale_2" in t else {}) for t in shards]
    for _ in range(3):
        ids = torch.randint(0, 256 * len(dummy), (n_ids,))
        gather(small, dummy, ids, torch.empty(n_ids, meta["width"]))


def mappings() -> list[tuple[int, int, str]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, parts[5].strip() if len(parts) > 5 else ""))
    return out


def where_is(ptr: int, maps) -> str:
    return next((name for lo, hi, name in maps if lo <= ptr < hi), "?")


def worker(directory: str, model_rows: int, model_width: int, requests: int, n_ids: int, check: list[int], seed: int,
           results, release) -> None:
    try:
        import torch  # the worker's own start-up, before the table is asked for

        t0 = time.perf_counter()
        meta, shards, handles = load(directory, model_rows, model_width)
        load_s = time.perf_counter() - t0

        maps = mappings()
        tensors = [v for t in shards for v in tensors_of(t).values()]
        backing = sorted({where_is(v.data_ptr(), maps) for v in tensors})
        report = {"pid": os.getpid(), "load_s": load_s, "opened_as": sorted({t["opened_as"] for t in shards}),
                  "tensors_backed_by": backing,
                  "shard_files_mapped": sorted({name for _, _, name in maps if name.endswith(".safetensors")})}
        if check:
            ids = torch.tensor(check, dtype=torch.int64)
            report["rows"] = gather(meta, shards, ids, torch.empty(len(check), meta["width"])).tolist()
        if requests:
            warm_up(meta, shards, n_ids)
        gen = torch.Generator().manual_seed(seed)
        out = torch.empty(n_ids, meta["width"])
        seconds = []
        for _ in range(requests):
            ids = torch.randint(0, meta["rows"], (n_ids,), generator=gen)
            t = time.perf_counter()
            gather(meta, shards, ids, out)
            seconds.append(time.perf_counter() - t)
        report["request_s"] = seconds
        results.put(report)
        release.wait(600)  # the real worker keeps its tensors and its safe_open handles (``handles``) for its lifetime
    except BaseException as err:
        results.put({"pid": os.getpid(), "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
        sys.exit(1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("sidecar")
    p.add_argument("--model-rows", type=int, default=MODEL_ROWS,
                   help=f"the model's PLE rows (default {MODEL_ROWS:,}: "
                        f"the published model's {PUBLISHED_SHARDS} shards)")
    p.add_argument("--model-width", type=int, default=MODEL_WIDTH,
                   help=f"the model's PLE width (default {MODEL_WIDTH})")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--requests", type=int, default=0)
    p.add_argument("--ids", type=int, default=8192)
    p.add_argument("--check", default="", help="global row ids whose rows each worker reports")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hold", action="store_true")
    a = p.parse_args()
    ctx = multiprocessing.get_context("spawn")  # vLLM's get_mp_context() for the offload worker
    results, release = ctx.Queue(), ctx.Event()
    check = [int(x) for x in a.check.split(",") if x]
    procs = [ctx.Process(target=worker, args=(a.sidecar, a.model_rows, a.model_width, a.requests, a.ids, check,
                                              a.seed + i, results, release))
             for i in range(a.workers)]
    for proc in procs:
        proc.start()
    failed = 0
    for _ in procs:
        report = results.get(timeout=900)
        failed += "error" in report
        print(json.dumps(report), flush=True)
    if a.hold and not failed:
        print("HOLDING", flush=True)
        sys.stdin.readline()
    release.set()
    for proc in procs:
        proc.join(60)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
