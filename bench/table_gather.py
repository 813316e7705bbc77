"""pled's own Table.gather in fresh processes, beside the numpy worker and the published op chain.

    python -m bench.table_gather worker CASE TABLE --socket S --requests 45 --ids 8192   # one run, JSON out
    python -m bench.table_gather --size-gib 0.5 --repeats 5    # alone: its own sidecar and daemon(s)

``python -m bench`` calls ``run`` for 4 KiB pages and for huge pages; the report's section and verdicts are
registered with bench.report.
Cases, each in a fresh process that attaches with pre-faulting, then times each request alone and
counts the process's minor page faults during it; the output (bfloat16) is allocated once, as the
offload worker's pinned buffers are:
- numpy worker: bench/gather_worker.py's gather, its code warmed on a small copy in anonymous memory;
- op chain: bench/op_chain.py (index_select, stack the nibbles, repeat_interleave the scales, per
  shard), the same warm-up;
- Table.gather: ``attach(..., warm_rows=ids)`` then ``table.gather(ids, out=out)``;
- Table.gather, no warm-up: the same without ``warm_rows``, to show what it buys;
- Table.gather, 1 torch thread: with warm-up, ``torch.set_num_threads(1)``: torch's thread pool, whose
  threads sleep when idle, set aside.
The cases run interleaved (A, B, C, D, E, A, B, ...) so a slow minute hits all of them alike.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import report

ROOT = Path(__file__).resolve().parent.parent
CASES = ("numpy worker", "op chain", "Table.gather", "Table.gather, no warm-up", "Table.gather, 1 torch thread")


# -- one run in a fresh process ------------------------------------------------------------------

def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _torch_setup(case: str, table: str, socket: str, ids: int):
    """Attach; return (gather(ids, out), populate seconds)."""
    import torch

    from pled.client import attach

    if case == "Table.gather, 1 torch thread":
        torch.set_num_threads(1)  # no thread pool to wake: the numpy worker's case, with pled's gather
    if case.startswith("Table.gather"):
        t = attach(table, socket=socket, timeout=600, warm_rows=0 if case.endswith("no warm-up") else ids)
        return t, t.gather
    from bench import op_chain

    t = attach(table, socket=socket, timeout=600)
    m = t.manifest
    shards = [t.shard_tensors(s) for s in range(len(m.shards))]
    starts = torch.tensor([0] + [s.rows for s in m.shards][:-1]).cumsum(0)
    # warm the op chain's code on a small table in anonymous memory, as the numpy worker does
    small = [{k: torch.zeros((64, *v.shape[1:]) if v.dim() else (), dtype=v.dtype) for k, v in s.items()}
             for s in shards]
    for _ in range(3):
        op_chain.gather(m.layout, small, torch.arange(len(small)) * 64, torch.randint(0, 64 * len(small), (ids,)),
                        torch.empty((ids, m.row_width), dtype=torch.bfloat16))
    return t, lambda i, out: op_chain.gather(m.layout, shards, starts, i, out)


IDLE_S = 0.3  # after the requests, the process sleeps this long and times one request more


def worker(case: str, table: str, socket: str, requests: int, ids: int, seed: int) -> dict:
    t0 = time.perf_counter()
    if case == "numpy worker":
        import numpy as np

        from bench import gather_worker as gw

        views, rows, layout, populate = gw.shard_tensors_from_pled(table, socket, True)
        setup = time.perf_counter() - t0
        starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
        gw.warm_up_code(views, layout, ids)
        rng = np.random.default_rng(seed)
        batches = lambda: rng.integers(0, int(sum(rows)), size=ids, dtype=np.int64)  # noqa: E731
        gather = lambda batch: gw.gather(views, starts, layout, batch)  # noqa: E731
    else:
        import torch

        keep, gather_into = _torch_setup(case, table, socket, ids)
        populate, setup = keep.populate_seconds, time.perf_counter() - t0
        out = torch.empty((ids, keep.manifest.row_width), dtype=torch.bfloat16)
        out.zero_()
        g = torch.Generator().manual_seed(seed)
        batches = lambda: torch.randint(0, keep.manifest.rows, (ids,), generator=g)  # noqa: E731
        gather = lambda batch: gather_into(batch, out)  # noqa: E731

    def one() -> tuple[float, int]:
        batch = batches()
        f, t = _minflt(), time.perf_counter()
        gather(batch)
        return ids / (time.perf_counter() - t), _minflt() - f

    rates, faults = zip(*(one() for _ in range(requests)), strict=True)
    time.sleep(IDLE_S)
    after_idle = one()[0]
    return {"setup_s": setup, "populate_s": populate, "rows_per_s": rates, "faults": faults, "after_idle": after_idle}


# -- the cases, interleaved ----------------------------------------------------------------------

def one_run(case: str, table: str, socket: str, requests: int, ids: int, seed: int) -> dict:
    r = subprocess.run([sys.executable, "-m", "bench.table_gather", "worker", case, table, "--socket", socket,
                        "--requests", str(requests), "--ids", str(ids), "--seed", str(seed)],
                       capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise RuntimeError(f"bench.table_gather worker {case!r} failed: {r.stderr.strip()[-2000:]}")
    data = json.loads(r.stdout)
    rates, faults = data["rows_per_s"], data["faults"]
    asymptote = statistics.median(rates[-max(5, requests // 3):])
    within = next((i + 1 for i, x in enumerate(rates) if x >= 0.95 * asymptote), requests)
    return {"first": rates[0], "asymptote": asymptote, "first_over_asymptote": rates[0] / asymptote,
            "requests_to_5pct": within, "faults_first": faults[0], "faults_after_first": max(faults[1:], default=0),
            "faults_after_first_mean": statistics.mean(faults[1:]) if faults[1:] else 0.0,
            "populate_s": data["populate_s"],
            "after_idle_over_asymptote": data["after_idle"] / asymptote}


def run(socket: str, table: str, repeats: int, requests: int, ids: int, settle=None, log=print) -> dict:
    """Every case ``repeats`` times, interleaved, each run in a fresh process; summaries and per-run figures."""
    runs: dict[str, list[dict]] = {c: [] for c in CASES}
    for rep in range(repeats):
        for case in CASES:
            if settle:
                settle()
            r = one_run(case, table, socket, requests, ids, seed=rep + 1)
            runs[case].append(r)
            log(f"table gather {case}: first/asymptote {r['first_over_asymptote']:.2f}, asymptote "
                f"{r['asymptote']:.0f} rows/s, {r['requests_to_5pct']} requests to 5%, "
                f"faults first {r['faults_first']}, "
                f"after {r['faults_after_first']}, after {IDLE_S} s idle {r['after_idle_over_asymptote']:.2f}")
    keys = ("first", "asymptote", "first_over_asymptote", "requests_to_5pct", "faults_first", "faults_after_first",
            "faults_after_first_mean", "populate_s", "after_idle_over_asymptote")
    out = {"cases": {c: {k: _summary([r[k] for r in rs]) for k in keys} | {"runs": rs} for c, rs in runs.items()},
           "idle_s": IDLE_S}
    # rows/s of Table.gather over the op chain, per repeat (the two ran within the same minute)
    out["speedup_over_op_chain"] = _summary([a["asymptote"] / b["asymptote"]
                                             for a, b in zip(runs["Table.gather"], runs["op chain"], strict=True)])
    out["speedup_over_numpy"] = _summary([a["asymptote"] / b["asymptote"]
                                          for a, b in zip(runs["Table.gather"], runs["numpy worker"], strict=True)])
    return out


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# -- report --------------------------------------------------------------------------------------

@report.section
def report_lines(res: dict) -> list[str]:
    """The report's section, every figure from ``res['table_gather']`` (absent: nothing)."""
    tg = res.get("table_gather")
    if not tg:
        return []
    first = next(iter(tg.values()))
    n = first["cases"]["Table.gather"]["first"]["n"]
    lines = ["## 6. pled's own `Table.gather`", "",
             f"{res['gather_ids']} random row ids per request, {res['gather_requests']} requests per run, into a "
             f"bfloat16 output allocated once; each case {n} times in fresh processes, "
             "interleaved (A, B, C, ..., A, ...), "
             "all pre-faulted. numpy worker: section 3's gather; op chain: the published offload worker's torch ops "
             "per shard (bench/op_chain.py); Table.gather with `attach(..., warm_rows=ids)` (gathers of random ids "
             "until two in a row take the same time), without it, and with it on one torch thread "
             "(`torch.set_num_threads(1)`; the others use torch's default, one thread a core). "
             "Faults: the process's minor page faults during one request. After idle: once the requests are done, the "
             f"process sleeps {first.get('idle_s', IDLE_S)} s and times one request more; "
             "no warm-up can reach that one, so it shows what "
             "any request after a pause costs on this machine, beside what the first one costs.", "",
             "| pages | case | first / asymptote | asymptote, rows/s | requests to within 5% | faults, first request | "
             "faults per request after the first (max) | after idle / asymptote |", "|---|---|---|---|---|---|---|---|"]
    for pages, block in tg.items():
        for case, c in block["cases"].items():
            lines.append(f"| {pages} | {case} | {report.fmt(c['first_over_asymptote'])} | "
                         f"{report.fmt(c['asymptote'], digits=0)} | "
                         f"{c['requests_to_5pct']['median']:.0f} ({c['requests_to_5pct']['min']:.0f}-"
                         f"{c['requests_to_5pct']['max']:.0f}) | {c['faults_first']['median']:.0f} | "
                         f"{c['faults_after_first']['median']:.0f} ({c['faults_after_first']['max']:.0f}) | "
                         + (report.fmt(c['after_idle_over_asymptote']) if 'after_idle_over_asymptote' in c
                            else 'not measured') + " |")
    lines += [""]
    for pages, block in tg.items():
        runs = ", ".join(f"{r['first_over_asymptote']:.2f}" for r in block["cases"]["Table.gather"]["runs"])
        lines.append(f"- {pages}: Table.gather's rows/s at {report.fmt(block['speedup_over_op_chain'])}x "
                     "the op chain's and "
                     f"{report.fmt(block['speedup_over_numpy'])}x the numpy worker's (asymptotes, per repeat); first / "
                     f"asymptote per run {runs}.")
    return lines


@report.verdict
def verdicts(res: dict) -> list[tuple[bool, str]]:
    tg = res.get("table_gather") or {}
    out = []
    for pages, block in tg.items():
        c = block["cases"]["Table.gather"]
        ratio, faults = c["first_over_asymptote"]["median"], c["faults_after_first"]["max"]
        out.append((ratio >= 0.9, f"Table.gather's first request at {ratio:.2f} of its asymptote with {pages} "
                                  f"(target 0.9, median of {c['first_over_asymptote']['n']} fresh processes)"))
        out.append((faults == 0, f"Table.gather's page faults per request after the first with {pages}: at most "
                                 f"{faults:.0f} (target 0)"))
    return out


# -- alone: a sidecar, a daemon with 4 KiB pages and one with huge pages ----------------------------

def main() -> int:
    if sys.argv[1:2] == ["worker"]:
        p = argparse.ArgumentParser(prog="python -m bench.table_gather worker")
        p.add_argument("case", choices=CASES)
        p.add_argument("table")
        p.add_argument("--socket", required=True)
        p.add_argument("--requests", type=int, default=45)
        p.add_argument("--ids", type=int, default=8192)
        p.add_argument("--seed", type=int, default=1)
        a = p.parse_args(sys.argv[2:])
        json.dump(worker(a.case, a.table, a.socket, a.requests, a.ids, a.seed), sys.stdout)
        return 0
    import contextlib
    import shutil
    import tempfile

    from bench.common import SHMEM, log, settle, shmem_enabled
    from pled.generator import make_sidecar
    from tests.harness import start

    p = argparse.ArgumentParser(prog="python -m bench.table_gather", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=45)
    p.add_argument("--ids", type=int, default=8192)
    p.add_argument("--no-huge-pages", action="store_true")
    p.add_argument("--no-settle", action="store_true", help="do not wait for a quiet machine before each run")
    p.add_argument("--workdir", default="/var/tmp")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pled-bench-tg-", dir=a.workdir))
    res = {"gather_ids": a.ids, "gather_requests": a.requests, "table_gather": {}}
    wait = None if a.no_settle else settle
    try:
        d = work / "ples_int4"
        make_sidecar(str(d), "ples_int4", shards=a.shards, rows=int(a.size_gib * 1024**3 / 100 / a.shards))
        small = start(work, {"ples_int4": d}, name="small", wait=None)
        try:
            small.wait_ready(timeout=600)
            res["table_gather"]["4 KiB pages"] = run(small.socket, "ples_int4", a.repeats, a.requests, a.ids, wait, log)
        finally:
            small.stop()
        if not a.no_huge_pages and SHMEM.exists():
            before = SHMEM.read_text()
            with contextlib.ExitStack() as stack:
                stack.enter_context(shmem_enabled("advise"))
                huge = start(work, {"ples_int4": d}, name="huge", wait=None)
                stack.callback(huge.stop)
                huge.wait_ready(timeout=600)
                res["table_gather"]["huge pages"] = run(huge.socket, "ples_int4", a.repeats, a.requests, a.ids, wait,
                                                        log)
            res["shmem_enabled_restored"] = SHMEM.read_text() == before
            log(f"shmem_enabled restored: {SHMEM.read_text().strip()!r} (was {before.strip()!r})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    print("\n".join(report_lines(res) + [""] + [f"- {'met' if ok else 'NOT met'}: {t}" for ok, t in verdicts(res)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
