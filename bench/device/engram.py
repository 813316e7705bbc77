"""The device check's Engram section (issue 46 item 5): a synthetic DeepSeek V4.1 Engram checkpoint
(pled.generator.make_engram_checkpoint, one layer of the real head structure, rows enough that rank --engram-rank of
--engram-world's slice holds at least --engram-gib) staged by pled's own staging (sealed; for the writable route,
sealed against all but writing and mapped as a writer), mapped with pled.client; per GPU route this device offers,
the slice's ``weight`` and ``scale`` taken through ``gpu.device_view`` as the Engram seam takes them, looked up by
vLLM 0.33's own ``_engram_lookup_kernel`` (carried in bench/engram_kernels.py) into bf16 and into packed bytes, and
compared with the CPU reference below; rows/s through the route's view against upstream's private pinned copy of the
same rows (CUDA events), the first pass (cold) against the median of the next ones (warm).

``reference_bf16`` and ``reference_packed`` are what the kernel must return, computed on the CPU from the same bytes:
each owned row's e4m3 values (pled's decoder, pled/shared/dequant.py) times its ue8m0 scale read as vLLM's kernel
reads it (the byte shifted into a float32's exponent field), rounded to bf16; the packed form is the row's value
bytes then its scale bytes; zero rows for ids outside ``[vocab_start, vocab_end)`` and for padded heads. They need
no CUDA (tests/test_device_check_engram.py holds them to torch's own float8 dtypes).
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np

from pled.shared import dequant

GiB = 1 << 30
LAYER = 1  # the synthetic checkpoint's one Engram layer


def scale_f32(scale: np.ndarray) -> np.ndarray:
    """ue8m0 bytes as vLLM's kernel reads them: ``(byte << 23)`` bitcast to float32 (byte 0 is 0.0, 255 inf)."""
    return (scale.astype(np.uint32) << 23).view(np.float32)


def reference_f32(weight: np.ndarray, scale: np.ndarray, ids: np.ndarray, vocab_start: int, vocab_end: int,
                  head_start: int, local_heads: int, block: int = 32) -> np.ndarray:
    """float32 [tokens, local_heads, dim]: heads ``[head_start, +local_heads)`` of ``ids`` ([tokens, heads] global
    row ids of ``weight`` [rows, dim] e4m3 codes and ``scale`` [rows, dim/block] ue8m0 bytes) dequantized."""
    tokens, total = ids.shape
    dim = weight.shape[1]
    out = np.zeros((tokens, local_heads, dim), dtype=np.float32)
    for k in range(local_heads):
        h = head_start + k
        if h >= total:
            continue  # a padded head: zeros
        col = ids[:, h]
        owned = (col >= vocab_start) & (col < vocab_end)
        rows = col[owned]
        values = dequant.E4M3_LUT[weight[rows]]
        out[owned, k] = values * np.repeat(scale_f32(scale[rows]), block, axis=1)
    return out


def reference_packed(weight: np.ndarray, scale: np.ndarray, ids: np.ndarray, vocab_start: int, vocab_end: int,
                     head_start: int, local_heads: int) -> np.ndarray:
    """uint8 [tokens, local_heads, dim + dim/block]: each looked-up row's value bytes then its scale bytes."""
    tokens, total = ids.shape
    out = np.zeros((tokens, local_heads, weight.shape[1] + scale.shape[1]), dtype=np.uint8)
    for k in range(local_heads):
        h = head_start + k
        if h >= total:
            continue
        col = ids[:, h]
        owned = (col >= vocab_start) & (col < vocab_end)
        out[owned, k] = np.concatenate([weight[col[owned]], scale[col[owned]]], axis=1)
    return out


def hashed_ids(head_sizes: list[int], tokens: int, vocab_start: int, vocab_end: int, seed: int) -> np.ndarray:
    """int64 [tokens, heads]: each head's ids uniform over its own rows (global ids, as NgramHashState's), with the
    rank's edges and the rows just outside them in the first tokens."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(head_sizes)[:-1]])
    ids = np.stack([o + rng.integers(0, s, tokens) for o, s in zip(offsets, head_sizes, strict=True)], axis=1)
    edges = [vocab_start - 1, vocab_start, vocab_start + 1, vocab_end - 2, vocab_end - 1, vocab_end]
    for i, e in enumerate(e for e in edges if 0 <= e < sum(head_sizes)):
        if i < tokens:
            ids[i, :] = e
    return ids.astype(np.int64)


def shard(head_sizes: list[int], world: int, rank: int) -> tuple[int, int, int, int]:
    """(head_start, local_heads, vocab_start, vocab_end) of a rank as ParallelEngramEmbedding computes them."""
    local = -(-len(head_sizes) // world)
    if (world - 1) * local >= len(head_sizes):
        raise ValueError(f"{len(head_sizes)} heads over {world} shards leave a rank without heads")
    start = rank * local
    return start, local, sum(head_sizes[:start]), sum(head_sizes[:start + local])


def plan(slice_bytes: int, world: int, rank: int, dim: int = 256) -> dict:
    """The synthetic config whose rank slice holds at least ``slice_bytes``: one layer, vLLM's real head structure
    (4 hash heads), the vocab size raised until the slice is large enough."""
    from pled import generator

    row = dim + dim // 32
    vocab = max(50, -(-slice_bytes // row) // max(1, 4 // world) + 1)
    while True:
        c = generator.engram_config({**generator.ENGRAM, "engram_layer_ids": [LAYER], "engram_vocab_size": vocab})
        sizes = generator.engram_head_sizes(c)[0]
        _, _, lo, hi = shard(sizes, world, rank)
        if (hi - lo) * row >= slice_bytes:
            return c
        vocab += max(1, vocab // 64)


# -- on the device ------------------------------------------------------------------------------------------------

class Engram:
    """The checkpoint, written once for the section, and what a lookup needs of it."""

    def __init__(self, ctx) -> None:
        from pled import generator

        a = ctx.args
        self.world, self.rank = a.engram_world, a.engram_rank
        start = time.perf_counter()
        self.path = str(ctx.work / "engram")
        _, self.config = generator.make_engram_checkpoint(self.path, plan(int(a.engram_gib * GiB), self.world,
                                                                          self.rank), files=1)
        self.seconds = time.perf_counter() - start
        self.head_sizes = generator.engram_head_sizes(self.config)[0]
        self.dim = self.config["engram_head_dim"]
        self.head_start, self.local_heads, self.lo, self.hi = shard(self.head_sizes, self.world, self.rank)

    def describe(self) -> dict:
        rows = sum(self.head_sizes)
        return {"rows": rows, "head_sizes": self.head_sizes, "dim": self.dim, "table_bytes": rows * (self.dim +
                self.dim // 32), "world": self.world, "rank": self.rank, "heads": [self.head_start,
                self.local_heads], "rows_of_rank": [self.lo, self.hi],
                "slice_bytes": (self.hi - self.lo) * (self.dim + self.dim // 32), "write_seconds": self.seconds}


def _whole(table, a) -> np.ndarray:
    return np.frombuffer(table.buffer, dtype=np.uint8, count=a.nbytes, offset=a.offset).reshape(a.shape[0], -1)


def _device(ctx, rt, route: str, view, rows: int, width: int):
    """A CUDA uint8 [rows, width] tensor over the device view (a registered one's device pointer; pageable: the
    host address itself)."""
    torch = ctx.cuda.torch
    raw = view.view(torch.uint8).reshape(rows, width)
    if route == "pageable":
        return rt.device_alias(raw)
    return ctx.cuda.device_tensor(raw.data_ptr(), rows * width, raw).view(rows, width)


def check(torch, kernels, weight_d, scale_d, weight: np.ndarray, scale: np.ndarray, e: Engram, tokens: int,
          num_sms: int) -> dict:
    """The carried kernel over the rank's device views into bf16 and packed bytes, against the CPU reference."""
    from bench.device import lookup as device_lookup

    ids = hashed_ids(e.head_sizes, tokens, e.lo, e.hi, seed=11)
    ids_d = torch.from_numpy(ids).cuda()
    args = (e.lo, e.hi, e.head_start, e.local_heads, len(e.head_sizes), e.dim, 32, num_sms)
    bf16 = torch.empty((tokens, e.local_heads, e.dim), dtype=torch.bfloat16, device="cuda")
    packed = torch.empty((tokens, e.local_heads, e.dim + e.dim // 32), dtype=torch.uint8, device="cuda")
    w8 = weight_d.view(torch.float8_e4m3fn)
    kernels.lookup(w8, scale_d, ids_d, bf16, *args)
    kernels.lookup(w8, scale_d, ids_d, packed, *args)
    torch.cuda.synchronize()
    want = reference_f32(weight, scale, ids, e.lo, e.hi, e.head_start, e.local_heads)
    got_packed = packed.cpu().numpy()
    want_packed = reference_packed(weight, scale, ids, e.lo, e.hi, e.head_start, e.local_heads)
    heads = ids[:, e.head_start:e.head_start + e.local_heads]
    owned = int(((heads >= e.lo) & (heads < e.hi)).sum())
    return {"tokens": tokens, "rows": tokens * e.local_heads, "owned": owned,
            "bfloat16": device_lookup.bf16_compare(torch, bf16.reshape(tokens, -1), want.reshape(tokens, -1)),
            "packed": {"equal": bool(np.array_equal(got_packed, want_packed)),
                       "rows_differing": int((got_packed != want_packed).any(axis=2).sum())}}


def one(ctx, e: Engram, route: str) -> dict:
    """One route, measured on its own staging of the checkpoint; a failure is one RuntimeError line, raised once
    every view of the mapping (and the failure's frames holding them) is gone, so the table closes cleanly."""
    import gc

    from pled.client.gpu import routes as gpu_routes

    os.environ[gpu_routes.HMM_OPT_IN] = "1"
    from bench.device.routes import staged_table

    with staged_table(e.path, route, "device-check-engram") as t:
        try:
            return _measure(ctx, e, route, t)
        except Exception as err:  # noqa: BLE001 - said in one line below, once the frames are dropped
            failure = f"{type(err).__name__}: {err}"
        gc.collect()
        raise RuntimeError(failure)


def _measure(ctx, e: Engram, route: str, t) -> dict:
    from bench import engram_kernels as kernels
    from bench.device import lookup as device_lookup
    from bench.device.procfs import meminfo, status_of
    from pled.client import gpu

    torch, rt, a = ctx.cuda.torch, gpu.runtime(), ctx.args
    num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    batch = a.batch - a.batch % e.local_heads
    arrays = {x.param: x for x in t.manifest.arrays if x.prefix == f"layers.{LAYER}.engram.embed"}
    w, s = arrays["weight"], arrays["scale"]
    rows = e.hi - e.lo
    nbytes = rows * (w.row_bytes + s.row_bytes)
    shmem, anon = meminfo().get("Shmem"), status_of().get("RssAnon")
    start = time.perf_counter()
    wv = gpu.device_view(t, w, e.lo, e.hi, what=f"device check, Engram weight, {route}")
    sv = gpu.device_view(t, s, e.lo, e.hi, what=f"device check, Engram scale, {route}")
    seconds = time.perf_counter() - start
    out: dict = {"bytes": nbytes, "seconds": seconds, "gib_per_s": nbytes / GiB / seconds if seconds else None,
                 "is_pinned": bool(wv.is_pinned() and sv.is_pinned()), "protected": t.protected}
    wd, sd = _device(ctx, rt, route, wv, rows, w.row_bytes), _device(ctx, rt, route, sv, rows, s.row_bytes)
    out["host_memory"] = {"shmem_growth": (meminfo().get("Shmem") or 0) - (shmem or 0),
                          "rss_anon_growth": (status_of().get("RssAnon") or 0) - (anon or 0)}
    weight, scale = _whole(t, w), _whole(t, s)
    tokens = a.check_ids // e.local_heads
    out["lookup"] = check(torch, kernels, wd, sd, weight, scale, e, tokens, num_sms)
    pw = ctx.pinned("engram", "weight", t.buffer, w.offset + e.lo * w.row_bytes, rows * w.row_bytes)
    ps = ctx.pinned("engram", "scale", t.buffer, s.offset + e.lo * s.row_bytes, rows * s.row_bytes)
    if "upstream_lookup_engram" not in ctx.result:
        ctx.result["upstream_lookup_engram"] = check(torch, kernels, pw.device(), ps.device(), weight, scale, e,
                                                     tokens, num_sms)
    del weight, scale
    dest = torch.empty((batch // e.local_heads, e.local_heads, e.dim), dtype=torch.bfloat16, device="cuda")

    def side(wt, st):
        w8 = wt.view(torch.float8_e4m3fn)
        return lambda ids: kernels.lookup(w8, st, ids.view(-1, e.local_heads), dest, e.lo, e.hi, 0, e.local_heads,
                                          e.local_heads, e.dim, 32, num_sms)

    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    passes = []
    for _ in range(max(3, a.repeats)):  # cold, then warm
        ids = torch.randint(e.lo, e.hi, (batch,), device="cuda")
        start_ev.record()
        side(wd, sd)(ids)
        end_ev.record()
        end_ev.synchronize()
        passes.append(batch / (start_ev.elapsed_time(end_ev) / 1000))
    out["cold_rows_per_s"], out["warm_rows_per_s"] = passes[0], statistics.median(passes[1:])
    out["rows_per_s"] = device_lookup.rates(torch, {"pled": side(wd, sd), "upstream": side(
        pw.device().view(rows, w.row_bytes), ps.device().view(rows, s.row_bytes))}, e.lo, e.hi, batch, a.launches,
        a.repeats, w.row_bytes + s.row_bytes)
    return out


def engram(ctx) -> dict:
    """The Engram section: the checkpoint, then every route of pled.client.gpu this device offers, measured; the
    others with the reason (bench/device/routes.py decides which are offered)."""
    from bench.device.routes import _offered
    from pled.client import gpu
    from pled.client.gpu import probe as gpu_probe, routes as gpu_routes

    e = Engram(ctx)
    out: dict = {"checkpoint": e.describe()}
    try:
        p = gpu_probe.probe(gpu.runtime(), ctx.cuda.device)
        for route in gpu_routes.ROUTES:
            why = _offered(p, route)
            if why is not None:
                out[route] = {"not_offered": why}
                continue
            try:
                out[route] = one(ctx, e, route)
            except (gpu.NoRoute, RuntimeError) as err:  # a route the attributes offer that still fails: said
                out[route] = {"error": f"{type(err).__name__}: {err}"}
    finally:
        for key in [k for k in ctx.upstream if k[0] == "engram"]:
            del ctx.upstream[key]  # the pinned copies go before the next section
        import shutil

        shutil.rmtree(e.path, ignore_errors=True)
    return out
