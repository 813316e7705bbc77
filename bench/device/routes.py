"""The device check, per GPU route (issue 45 item 5): each route pled.client.gpu offers on this device, taken through
``gpu.device_view`` exactly as the vLLM seams take it, on the nvfp4 checkpoint (``--table-gib``, at least 1 GiB)
staged by pled (sealed; for the writable route, sealed against all but writing and mapped by this process as a
writer). Per route: the probe's answers; the view's seconds and GiB/s (registration, or none for pageable access);
whether it is pinned; rows/s through the route's device view against upstream's private pinned copy of the same rows
(vLLM's raw-row lookup, CUDA events), the first pass (cold: the GPU's translations and the driver's mirror empty)
against the median of the next ones (warm); and host memory counted once (meminfo's Shmem and this process's RssAnon
around the view: no copy). Pageable access is measured on HMM as well as ATS (``PLED_PAGEABLE_HMM=1`` for this
run): showing whether it is sound and fast there is what this section is for. Writes through a view are the fp8
section's (bench/device/sections.py), last in the run.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time

from bench.device import lookup as device_lookup
from bench.device.procfs import meminfo, status_of
from pled.client import gpu
from pled.client.gpu import probe as gpu_probe, routes as gpu_routes
from pled.client.mapped_table import Table
from pled.daemon.regions import staging
from pled.daemon.sources.checkpoint import open_checkpoint

GiB = 1 << 30


def _offered(p, route: str) -> str | None:
    """Why this device cannot take ``route`` (None: measure it); the table's side is this run's own."""
    if route == "read-only":
        return None if p.register_supported and p.read_only_supported else "no read-only host registration"
    if route == "pageable":
        return None if p.pageable else "no pageable memory access (88 = 0)"
    return None if p.register_supported else "no host registration (99 = 0)"


@contextlib.contextmanager
def staged_table(path: str, route: str, name: str = "device-check"):
    """The checkpoint at ``path`` staged as a region for ``route`` (writable for the writable route) and mapped as
    a Table that takes only that route; the region is closed after."""
    region = staging.stage(f"{name}-{route}", open_checkpoint(path), writable=route == "writable")
    try:
        with Table(os.dup(region.fd), 1, populate=True, gpu_access="writable" if route == "writable" else
                   "read-only", gpu_routes=(route,), writer=route == "writable") as t:
            yield t
    finally:
        region.close()


def one(ctx, route: str) -> dict:
    torch, rt = ctx.cuda.torch, gpu.runtime()
    os.environ[gpu_routes.HMM_OPT_IN] = "1"
    with staged_table(ctx.nvfp4.path, route) as t:
        w = next(a for a in t.manifest.arrays if a.param == "weight")
        lo, hi = ctx.rank_rows(w.shape[0])
        nbytes = (hi - lo) * w.row_bytes
        shmem, anon = meminfo().get("Shmem"), status_of().get("RssAnon")
        start = time.perf_counter()
        view = gpu.device_view(t, w, lo, hi, what=f"device check, {route}")
        seconds = time.perf_counter() - start
        out = {"bytes": nbytes, "seconds": seconds, "gib_per_s": nbytes / GiB / seconds if seconds else None,
               "is_pinned": bool(view.is_pinned()), "protected": t.protected}
        raw = view.view(torch.uint8).reshape(hi - lo, w.row_bytes)
        dev = rt.device_alias(raw) if route == "pageable" else \
            ctx.cuda.device_tensor(raw.data_ptr(), nbytes, raw).view(hi - lo, w.row_bytes)
        out["host_memory"] = {"shmem_growth": (meminfo().get("Shmem") or 0) - (shmem or 0),
                              "rss_anon_growth": (status_of().get("RssAnon") or 0) - (anon or 0)}
        a = ctx.args

        def lookup(table):
            return lambda ids: table.index_select(0, ids - lo)

        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        passes = []
        for _ in range(max(3, a.repeats)):  # cold, then warm
            ids = torch.randint(lo, hi, (a.batch,), device="cuda")
            start_ev.record()
            lookup(dev)(ids)
            end_ev.record()
            end_ev.synchronize()
            passes.append(a.batch / (start_ev.elapsed_time(end_ev) / 1000))
        out["cold_rows_per_s"], out["warm_rows_per_s"] = passes[0], statistics.median(passes[1:])
        pinned = ctx.pinned("nvfp4", "weight", t.buffer, w.offset + lo * w.row_bytes, nbytes)
        out["rows_per_s"] = device_lookup.rates(torch, {"pled": lookup(dev), "upstream": lookup(
            pinned.device().view(hi - lo, w.row_bytes))}, lo, hi, a.batch, a.launches, a.repeats, w.row_bytes)
        del dev, raw, view
        return out


def routes(ctx) -> dict:
    """Every route of pled.client.gpu this device offers, measured; the others with the reason."""
    rt = gpu.runtime()
    p = gpu_probe.probe(rt, ctx.cuda.device)
    out: dict = {"probe": p.describe()}
    for route in gpu_routes.ROUTES:
        why = _offered(p, route)
        if why is not None:
            out[route] = {"not_offered": why}
            continue
        try:
            out[route] = one(ctx, route)
        except (gpu.NoRoute, RuntimeError) as err:  # a route the attributes offer that still fails: said
            out[route] = {"error": f"{type(err).__name__}: {err}"}
    return out
