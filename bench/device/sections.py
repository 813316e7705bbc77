"""The sections of bench/device/check.py that need CUDA: one per page kind (registration, lookups, rows/s; the
memory of two processes on the first of thp, 4k that stages) and fp8's (lookups, rows/s, then GPU writes through
the read-only view, last). Each returns
its figures as a dict; bench/device/check.py runs them, writes them and reports a failure as one line.
"""
from __future__ import annotations

import mmap
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.device import child as device_child, lookup as device_lookup, pages as device_pages
from bench.device.cuda import Cuda, PinnedCopy, Registered, try_register
from bench.device.procfs import smaps_of
from pled.client import gpu
from pled.client.mapped_table import Table

GiB = 1 << 30
SHMEM_KINDS = ("thp", "4k")  # the memory check, and fp8's table, on the first of these that stages


@dataclass
class Context:
    args: object
    cuda: Cuda
    work: Path
    result: dict
    nvfp4: device_pages.Checkpoint | None = None
    fp8: device_pages.Checkpoint | None = None
    upstream: dict = field(default_factory=dict)  # (dtype, param) -> PinnedCopy of the rank's rows
    memory_done: bool = False

    @property
    def kernels(self):
        from bench import ple_kernels  # Triton: imported where a lookup runs, so a failure is that section's

        return ple_kernels

    def make_checkpoints(self) -> dict:
        a = self.args
        self.nvfp4 = device_pages.make(str(self.work), "nvfp4", int(a.table_gib * GiB), a.width)
        self.fp8 = device_pages.make(str(self.work), "fp8", int(a.fp8_mib * (1 << 20)), a.width)
        return {c.dtype: {"rows": c.rows, "width": c.width, "row_bytes": c.row_bytes, "table_bytes": c.nbytes,
                          "global_scale": c.global_scale, "write_seconds": round(c.seconds, 3)}
                for c in (self.nvfp4, self.fp8)}

    def rank_rows(self, rows: int) -> tuple[int, int]:
        per = rows // self.args.world
        return self.args.rank * per, (self.args.rank + 1) * per

    def pinned(self, dtype: str, param: str, mapping, offset: int, nbytes: int) -> PinnedCopy:
        key = (dtype, param)
        if key not in self.upstream:
            copy = self.upstream[key] = PinnedCopy(self.cuda, mapping, offset, nbytes)
            self.result.setdefault("upstream_copy", {})[f"{dtype}.{param}"] = {
                "bytes": nbytes, "alloc_seconds": copy.alloc_seconds, "copy_seconds": copy.copy_seconds,
                "copy_gib_per_s": nbytes / GiB / copy.copy_seconds if copy.copy_seconds else None,
                "is_pinned": copy.pinned}
        return self.upstream[key]

    def close(self) -> None:
        self.upstream.clear()


def _arrays(table: Table) -> dict:
    return {a.param: a for a in table.manifest.arrays}


def _whole(table: Table, a) -> np.ndarray:
    return np.frombuffer(table.buffer, dtype=np.uint8, count=a.nbytes, offset=a.offset).reshape(a.shape[0], -1)


def _slice(ctx: Context, table: Table, a, lo: int, hi: int, what: str) -> Registered:
    return Registered(ctx.cuda, table.buffer, a.offset + lo * a.row_bytes, (hi - lo) * a.row_bytes,
                      f"{a.param} rows {lo}..{hi} ({what})")


def registration(ctx: Context, table: Table, kind: str) -> dict:
    """The whole table (weight and weight_scale) registered Mapped|ReadOnly through pled's seam and released,
    --register-repeats times; and once Mapped alone."""
    arrays = list(_arrays(table).values())
    took, released, pinned = [], [], True
    for _ in range(ctx.args.register_repeats):
        regs = [Registered(ctx.cuda, table.buffer, a.offset, a.nbytes, f"{a.param} ({kind})") for a in arrays]
        took.append(sum(r.seconds for r in regs))
        pinned = pinned and all(r.pinned for r in regs)
        released.append(sum(r.release() for r in regs))
        del regs
    nbytes = sum(a.nbytes for a in arrays)
    first = arrays[0]
    return {"register": {"flags": "Mapped|ReadOnly", "calls": len(arrays), "bytes": nbytes,
                         "seconds": device_lookup.summary(took),
                         "gib_per_s_median": nbytes / GiB / statistics.median(took), "is_pinned": pinned,
                         "unregister_seconds": device_lookup.summary(released)},
            "register_without_read_only": try_register(ctx.cuda, table.address + first.offset, first.nbytes,
                                                       gpu.cuda.MAPPED)}


def page_kind(ctx: Context, kind: str) -> dict:
    with device_pages.staged(kind, ctx.nvfp4) as (region, said):
        out: dict = {"staged": said}
        table = Table(os.dup(region.fd), 0, populate=True)
        try:
            out.update(populate_seconds=table.populate_seconds, page_size=table.page_size,
                       mapping_smaps=smaps_of(table.address))
            out.update(registration(ctx, table, kind))
            out.update(nvfp4_lookups(ctx, table, kind))
        finally:
            table.close()
        if kind in SHMEM_KINDS and not ctx.memory_done:
            ctx.memory_done = True
            out["memory"] = memory(ctx, region.fd)
    return out


def nvfp4_lookups(ctx: Context, table: Table, kind: str) -> dict:
    torch, kernels, c = ctx.cuda.torch, ctx.kernels, ctx.nvfp4
    arrays = _arrays(table)
    w, s = arrays["weight"], arrays["weight_scale"]
    lo, hi = ctx.rank_rows(w.shape[0])
    rw, rs = _slice(ctx, table, w, lo, hi, kind), _slice(ctx, table, s, lo, hi, kind)
    weight, scale = _whole(table, w), _whole(table, s)
    try:
        out = {"rank_slice": {"world": ctx.args.world, "rank": ctx.args.rank, "rows": [lo, hi],
                              "registered": [rw.key, rs.key], "pinned": rw.pinned and rs.pinned,
                              "register_seconds": rw.seconds + rs.seconds,
                              "start_page_aligned": rw.host % mmap.PAGESIZE == 0,
                              "device_pointer_is_host_pointer": rw.device().data_ptr() == rw.host}}
        out["lookup_nvfp4"] = device_lookup.check_nvfp4(torch, kernels, rw.device(), rs.device(), weight, scale,
                                                        c.global_scale, lo, hi, ctx.args.check_ids)
        pw = ctx.pinned("nvfp4", "weight", table.buffer, w.offset + lo * w.row_bytes, (hi - lo) * w.row_bytes)
        ps = ctx.pinned("nvfp4", "weight_scale", table.buffer, s.offset + lo * s.row_bytes, (hi - lo) * s.row_bytes)
        if "upstream_lookup_nvfp4" not in ctx.result:
            ctx.result["upstream_lookup_nvfp4"] = device_lookup.check_nvfp4(
                torch, kernels, pw.device(), ps.device(), weight, scale, c.global_scale, lo, hi, ctx.args.check_ids)
        g = torch.tensor([c.global_scale], dtype=torch.float32, device="cuda")
        dest = torch.empty((ctx.args.batch, c.width), dtype=torch.bfloat16, device="cuda")

        def side(wv, sv):
            return lambda ids: kernels.lookup_nvfp4(wv, sv, g, ids, dest, c.width, lo, hi)

        a = ctx.args
        hbm = (pw.cpu.to("cuda"), ps.cpu.to("cuda"))  # the ceiling: the same rows in the GPU's own memory
        out["rows_per_s"] = device_lookup.rates(torch, {"pled": side(rw.device(), rs.device()),
                                                        "upstream": side(pw.device(), ps.device()),
                                                        "gpu_memory": side(*hbm)},
                                                lo, hi, a.batch, a.launches, a.repeats, c.row_bytes)
        return out
    finally:
        del weight, scale
        rw.release()
        rs.release()


def _spec(table: Table, **more) -> dict:
    """What a child needs of the region besides its fd: where the arrays lie."""
    a = _arrays(table)
    spec = {"rows": a["weight"].shape[0], "weight": [a["weight"].offset, a["weight"].nbytes], **more}
    if "weight_scale" in a:
        spec["scale"] = [a["weight_scale"].offset, a["weight_scale"].nbytes]
    return spec


def memory(ctx: Context, fd: int) -> dict:
    """Two processes holding the nvfp4 table at once, registered and looked up (bench/device/child.py)."""
    with Table(os.dup(fd), 0, populate=False) as m:
        spec = _spec(m, fd=fd, width=ctx.nvfp4.width, global_scale=ctx.nvfp4.global_scale,
                     table_bytes=ctx.nvfp4.nbytes, ids=ctx.args.check_ids)
    return device_child.memory(fd, spec, ctx.work, ctx.args.child_timeout)


def fp8(ctx: Context) -> dict:
    """The fp8 table on the first of thp, 4k that stages: the raw-rows kernel through pled's view against the rows'
    bytes, and rows/s against upstream's pinned copy; then, the run's last check (a GPU fault could spoil what
    came after it), writes through the registered read-only view, each in a child (bench/device/child.py)."""
    reasons = {}
    for kind in SHMEM_KINDS:
        try:
            with device_pages.staged(kind, ctx.fp8) as (region, said):
                with Table(os.dup(region.fd), 0, populate=True) as table:
                    out = {"kind": kind, "staged": said, **fp8_lookups(ctx, table, kind)}
                    spec = _spec(table, fd=region.fd)
                if ctx.args.write_fault:
                    out["write_fault"] = device_child.write_fault(region.fd, spec, ctx.work, ctx.args.child_timeout)
                return out
        except device_pages.NotMeasured as err:
            reasons[kind] = str(err)
    raise device_pages.NotMeasured(f"no page kind staged: {reasons}")


def fp8_lookups(ctx: Context, table: Table, kind: str) -> dict:
    torch, kernels = ctx.cuda.torch, ctx.kernels
    w = _arrays(table)["weight"]
    lo, hi = ctx.rank_rows(w.shape[0])
    rw = _slice(ctx, table, w, lo, hi, f"fp8, {kind}")
    raw = _whole(table, w)
    try:
        out = {"lookup": device_lookup.check_rows(torch, kernels, rw.device(), raw, lo, hi, ctx.args.check_ids)}
        pw = ctx.pinned("fp8", "weight", table.buffer, w.offset + lo * w.row_bytes, (hi - lo) * w.row_bytes)
        dest = torch.empty((ctx.args.batch, w.row_bytes), dtype=torch.uint8, device="cuda")

        def side(view):
            return lambda ids: kernels.lookup_rows(view, ids, dest, w.row_bytes, lo, hi)

        a = ctx.args
        out["rows_per_s"] = device_lookup.rates(torch, {"pled": side(rw.device()), "upstream": side(pw.device())},
                                                lo, hi, a.batch, a.launches, a.repeats, w.row_bytes)
        return out
    finally:
        del raw
        rw.release()
