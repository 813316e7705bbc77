"""Lookups for bench/device/check.py: vLLM 0.33's carried kernels (bench/ple_kernels.py) over CUDA views of host
memory, checked against pled's numpy reference (pled/shared/dequant.py), and timed side by side.

``reference_nvfp4`` and ``reference_rows`` are what the two kernels must return, computed on the CPU from the
same bytes (the whole table as numpy arrays over pled's read-only mapping): for the nvfp4 kernel, pled's
dequantizer of each owned row (low nibble = even element, an e4m3 scale per 16 elements, times the global scale),
for the raw kernel the row's bytes; zero rows for ids outside the rank's ``[lo, hi)``. They need no CUDA: the
tests hold the carried kernels to them in Triton's CPU interpreter.
"""
from __future__ import annotations

import statistics

import numpy as np

from pled.shared import dequant


def reference_nvfp4(weight: np.ndarray, scale: np.ndarray, global_scale: float, ids: np.ndarray, lo: int,
                    hi: int) -> np.ndarray:
    """float32 [len(ids), width]: rows ``ids`` of the nvfp4 table (``weight`` [rows, width/2] uint8, ``scale``
    [rows, width/16] e4m3 codes), decoded by pled's reference; zeros for ids outside ``[lo, hi)``."""
    owned = (ids >= lo) & (ids < hi)
    out = np.zeros((len(ids), weight.shape[1] * 2), dtype=np.float32)
    tensors = {"weight_e2m1": weight, "weight_scale": scale, "weight_scale_2": np.float32(global_scale)}
    if owned.any():
        out[owned] = dequant.dequant_rows("ples_nvfp4", tensors, ids[owned])
    return out


def reference_rows(raw: np.ndarray, ids: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """uint8 [len(ids), row_bytes]: rows ``ids`` of ``raw`` as bytes; zeros for ids outside ``[lo, hi)``."""
    owned = (ids >= lo) & (ids < hi)
    out = np.zeros((len(ids), raw.shape[1]), dtype=np.uint8)
    out[owned] = raw[ids[owned]]
    return out


def check_ids(rows: int, lo: int, hi: int, n: int, seed: int) -> np.ndarray:
    """``n`` ids over the whole table (so some fall outside the rank's rows), with the edges of both ranges."""
    edges = [i for i in (0, lo - 1, lo, lo + 1, hi - 2, hi - 1, hi, rows - 1) if 0 <= i < rows]
    return np.concatenate([np.array(edges, dtype=np.int64),
                           np.random.default_rng(seed).integers(0, rows, max(0, n - len(edges)), dtype=np.int64)])


def f32_compare(got: np.ndarray, want: np.ndarray) -> dict:
    """A float32 lookup against the reference: equal as values (NaN where NaN), and bit for bit where the
    reference is not NaN (so -0.0 is not 0.0; a NaN's sign and payload are the hardware's own)."""
    same_nan = np.array_equal(np.isnan(got), np.isnan(want))
    real = ~np.isnan(want)
    return {"equal": bool(np.array_equal(got, want, equal_nan=True)),
            "bitwise_equal_except_nan": bool(same_nan and np.array_equal(got[real].view(np.uint32),
                                                                         want[real].view(np.uint32))),
            "nans": int((~real).sum()),
            "max_abs_diff": float(np.nanmax(np.abs(got - want))) if real.any() else 0.0}


def bf16_compare(torch, got, want_f32: np.ndarray) -> dict:
    """A bf16 lookup against the float32 reference rounded to bf16 (round to nearest even, as the GPU's store),
    bit for bit where the reference is not NaN, NaN where it is."""
    got = got.cpu()
    real = ~np.isnan(want_f32)
    same_nan = np.array_equal(got.float().isnan().numpy(), ~real)
    want = torch.from_numpy(want_f32).to(torch.bfloat16)
    a = got.view(torch.int16).numpy().astype(np.int32)[real]
    b = want.view(torch.int16).numpy().astype(np.int32)[real]
    differ = a != b
    return {"equal": bool(same_nan and not differ.any()), "nans_match": bool(same_nan),
            "elements_differing": int(differ.sum()), "max_ulp": int(np.abs(a - b).max()) if a.size else 0}


def check_nvfp4(torch, kernels, weight_view, scale_view, weight: np.ndarray, scale: np.ndarray, global_scale: float,
                lo: int, hi: int, n: int, seed: int = 1) -> dict:
    """The nvfp4 kernel over the rank's views (rows ``[lo, hi)``) into float32 and into bf16, against the
    reference over the whole table's bytes."""
    ids = check_ids(weight.shape[0], lo, hi, n, seed)
    width = weight.shape[1] * 2
    ids_d = torch.from_numpy(ids).cuda()
    g = torch.tensor([global_scale], dtype=torch.float32, device="cuda")
    out32 = torch.empty((len(ids), width), dtype=torch.float32, device="cuda")
    out16 = torch.empty((len(ids), width), dtype=torch.bfloat16, device="cuda")
    kernels.lookup_nvfp4(weight_view, scale_view, g, ids_d, out32, width, lo, hi)
    kernels.lookup_nvfp4(weight_view, scale_view, g, ids_d, out16, width, lo, hi)
    torch.cuda.synchronize()
    want = reference_nvfp4(weight, scale, global_scale, ids, lo, hi)
    got = out32.cpu().numpy()
    owned = int(((ids >= lo) & (ids < hi)).sum())
    return {"ids": len(ids), "owned": owned, "not_owned": len(ids) - owned,
            "float32": f32_compare(got, want),
            "bfloat16": bf16_compare(torch, out16, want)}


def check_rows(torch, kernels, view, raw: np.ndarray, lo: int, hi: int, n: int, seed: int = 2) -> dict:
    """The raw-bytes kernel over the rank's view, against the reference (the rows' bytes)."""
    ids = check_ids(raw.shape[0], lo, hi, n, seed)
    out = torch.empty((len(ids), raw.shape[1]), dtype=torch.uint8, device="cuda")
    kernels.lookup_rows(view, torch.from_numpy(ids).cuda(), out, raw.shape[1], lo, hi)
    torch.cuda.synchronize()
    got, want = out.cpu().numpy(), reference_rows(raw, ids, lo, hi)
    owned = int(((ids >= lo) & (ids < hi)).sum())
    return {"ids": len(ids), "owned": owned, "not_owned": len(ids) - owned,
            "equal": bool(np.array_equal(got, want)), "rows_differing": int((got != want).any(axis=1).sum())}


def summary(values: list[float]) -> dict:
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / med if med else None, "n": len(values), "values": values}


def rates(torch, sides: dict, lo: int, hi: int, batch: int, launches: int, repeats: int, row_bytes: int) -> dict:
    """Rows a second through each side's ``launch(ids)`` (one lookup of ``batch`` ids), timed by CUDA events over
    ``launches`` launches, ``repeats`` times; the sides' order turns every repeat, and every repeat draws new ids
    (uniform over the rank's rows, the same for every side; a side's rows lie elsewhere than another's, so none
    finds another's in the GPU's L2)."""
    for launch in sides.values():  # compile and warm up
        launch(torch.randint(lo, hi, (batch,), device="cuda"))
    torch.cuda.synchronize()
    seen: dict[str, list[float]] = {name: [] for name in sides}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for rep in range(repeats):
        ids = torch.randint(lo, hi, (launches, batch), device="cuda")
        names = list(sides)[rep % len(sides):] + list(sides)[:rep % len(sides)]
        for name in names:
            start.record()
            for i in range(launches):
                sides[name](ids[i])
            end.record()
            end.synchronize()
            seen[name].append(launches * batch / (start.elapsed_time(end) / 1000))
    out = {name: {**summary(v), "row_gb_per_s_median": statistics.median(v) * row_bytes / 1e9}
           for name, v in seen.items()}
    if "pled" in out and "upstream" in out:
        out["pled_over_upstream_median"] = out["pled"]["median"] / out["upstream"]["median"]
    out.update(batch=batch, launches=launches, repeats=repeats, row_bytes=row_bytes)
    return out
