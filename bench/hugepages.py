"""One table on 4 KiB pages, transparent huge pages, and reserved (hugetlb) 2 MiB and 1 GiB pages, side by side.

    python -m bench.hugepages [--size-gib 0.9]    # its own sidecar and pleds; prints the section and verdicts
    (make bench runs it too, with its own sidecar of that size: docs/BENCHMARKS.md, section 9)

Columns, each a fresh `pled serve` per repeat on the same sidecar (page cache dropped before each start):
- 4 KiB pages: ``huge_pages = "off"``;
- THP: ``huge_pages = "auto"`` with shmem_enabled switched to ``advise`` (restored after the column);
- hugetlb 2 MiB and hugetlb 1 GiB: ``huge_pages = "hugetlb"``, ``huge_page_size = "2M"`` / ``"1G"``, each on a
  pool raised for it by exactly the pages the region needs (``nr_hugepages``) and put back afterwards. The 1 GiB
  pool is raised first, before anything else churns memory (the kernel must find whole contiguous GiBs); where it
  gives fewer pages than the table needs, the column's table is made smaller to fit the pages it gave, and where
  it gives none the column is "not measured" with the kernel's figures.

Rows, per column, from the run: staging GB/s (Status ``staging_seconds``: the copy and hashing, after the pages are
allocated) for the first start and for the repeats apart (a hugetlb pool's pages are allocated and zeroed before
the copy: the first start on freshly reserved pages may pay for the memory itself, which the time from start to
ready, less the copy, shows); then, in a fresh client process per repeat, ``attach(..., populate=True)``: the
pre-faulting seconds the client reports (``Table.populate_seconds``) per GiB of the mapping, the whole attach, the
page tables it added (``VmPTE`` of /proc/self/status after attach less before, per GiB) and the pages it got
(``Table.page_size``); and ``Table.gather`` rows/s in a fresh process (bench/table_gather.py's worker, the
asymptote).

The host is left as found: every pool's ``nr_hugepages`` and shmem_enabled are compared before and after (the
result's ``host_restored``), every pled is stopped by its pid, the sidecar deleted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import report, table_gather
from bench.common import HUGEPAGES, SHMEM, NotMeasured, host_settings, reserve, settle, shmem_enabled  # noqa: F401

GiB = 1024**3
MiB = 1024**2
KiB = 1024
ROOT = Path(__file__).resolve().parent.parent
TABLE = "ples_int4"

COLUMNS = {  # the column's name -> its config keys
    "4 KiB pages": {"huge_pages": "off"},
    "THP": {"huge_pages": "auto"},
    "hugetlb 2 MiB": {"huge_pages": "hugetlb", "huge_page_size": "2M"},
    "hugetlb 1 GiB": {"huge_pages": "hugetlb", "huge_page_size": "1G"},
}
POOLS = {"hugetlb 2 MiB": 2 * MiB, "hugetlb 1 GiB": GiB}

# pled's targets for these (issue 21): the only fixed figures in the section
TARGETS = {"populate_ms_per_gib": {"hugetlb 1 GiB": 1, "hugetlb 2 MiB": 4}, "pte_kib_per_gib": 64}


def _log(msg: str) -> None:
    print(f"[bench.hugepages {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# -- the sidecar ------------------------------------------------------------------------------------------

def make_table(d: Path, size_gib: float, shards: int) -> dict:
    """A ples_int4 sidecar of about ``size_gib`` GiB (100 bytes a row), written out to disk; its figures."""
    from pled.daemon.sources.sidecar import open_table
    from pled.generator import make_sidecar
    from pled.shared import region

    make_sidecar(str(d), "ples_int4", shards=shards, rows=max(1, int(size_gib * GiB / 100 / shards)))
    sidecar = open_table(str(d))
    for s in sidecar.shards:  # on disk, so that dropping the page cache drops it all
        fd = os.open(s.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return {"path": str(d), "layout": sidecar.layout, "shards": len(sidecar.shards), "rows": sidecar.rows,
            "bytes": sum(s.size for s in sidecar.shards), "region_bytes": region.plan(TABLE, sidecar).region_bytes,
            "files": [s.path for s in sidecar.shards]}


def fit_table(d: Path, like: dict, limit: int) -> dict:
    """A table of ``like``'s shape whose region fits in ``limit`` bytes (the 1 GiB pages the kernel gave)."""
    size = (limit - like["shards"] * 2 * MiB - 8 * MiB) / GiB  # each shard rounds up to 2 MiB, the header one more
    while True:
        t = make_table(d, size, like["shards"])
        if t["region_bytes"] <= limit:
            return t
        shutil.rmtree(d)
        size *= 0.95


# -- a fresh client: attach with pre-faulting, its page tables -------------------------------------------

def _vm(field: str) -> int:
    """A kB figure of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * KiB for line in f if line.startswith(field + ":"))


def probe(table: str, socket: str) -> dict:
    """In a fresh process: attach with pre-faulting; the seconds it took, the populate seconds the client reports,
    the mapping's size, VmPTE before and after, and the page size it got. Everything attach imports is imported
    first, so the page tables it adds are the mapping's."""
    import numpy  # noqa: F401

    from pled.client import library, mapped_table  # noqa: F401
    from pled.shared import hugepages, pagecache  # noqa: F401

    before = _vm("VmPTE")
    start = time.perf_counter()
    t = library.attach(table, socket=socket, timeout=600, populate=True)
    attach_s = time.perf_counter() - start
    after = _vm("VmPTE")
    try:
        return {"attach_s": attach_s, "populate_s": t.populate_seconds, "mapped_bytes": len(t.buffer),
                "pte_before": before, "pte_after": after, "page_size": t.page_size}
    finally:
        t.close()


def run_probe(table: str, socket: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "bench.hugepages", "probe", table, "--socket", socket],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    if r.returncode:
        raise RuntimeError(f"bench.hugepages probe failed: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout)


def table_status(socket: str, table: str) -> dict:
    from pled.client.connection import call
    from pled.shared import protocol

    return next(t for t in call(protocol.STATUS, socket=socket, timeout=60)["tables"] if t["table"] == table)


# -- one column -------------------------------------------------------------------------------------------

def column(name: str, table: dict, start: Callable, repeats: int, requests: int, ids: int,
           settle: Callable[[], None] | None, log: Callable[[str], None], fitted: bool = False) -> dict:
    """``repeats`` fresh pleds on ``table`` with the column's keys; in each, one fresh probe and one gather run."""
    from tests.harness import drop_page_cache

    runs = []
    slug = name.replace(" ", "-").lower()
    for rep in range(repeats):
        drop_page_cache(table["files"])
        daemon = start(f"hp-{slug}-{rep}", {TABLE: Path(table["path"])}, COLUMNS[name])
        try:
            code = daemon.wait_ready_or_exit(timeout=600)
            if code is not None:
                last = [line for line in daemon.log().splitlines() if line.strip()][-1:] or ["(no log)"]
                raise NotMeasured(f"pled exited {code}: {last[0].split(' ', 3)[-1]}")
            ready_s = time.perf_counter() - daemon.started
            st = table_status(daemon.socket, TABLE)
            if settle:
                settle()  # khugepaged and kcompactd work on after a huge-page staging
            p = run_probe(TABLE, daemon.socket)
            g = table_gather.one_run("Table.gather", TABLE, daemon.socket, requests, ids, seed=rep + 1)
        finally:
            daemon.stop(timeout=60)
        gib = p["mapped_bytes"] / GiB
        run = {"staging_s": st["staging_seconds"], "source_bytes": st["bytes"], "region_bytes": st["region_bytes"],
               "ready_s": ready_s, "status_page_size": st.get("page_size_bytes"),
               "huge_share": (st.get("huge_page_bytes") or 0) / st["region_bytes"],
               "gb_s": st["bytes"] / st["staging_seconds"] / 1e9, "ready_less_copy_s": ready_s - st["staging_seconds"],
               "populate_ms_per_gib": p["populate_s"] * 1e3 / gib, "attach_ms": p["attach_s"] * 1e3,
               "pte_kib_per_gib": (p["pte_after"] - p["pte_before"]) / KiB / gib, "page_size": p["page_size"],
               "mapped_bytes": p["mapped_bytes"], "gather_rows_s": g["asymptote"],
               "gather": {k: g[k] for k in ("first", "requests_to_5pct", "faults_first", "faults_after_first")}}
        runs.append(run)
        log(f"{name} #{rep + 1}: staging {run['gb_s']:.2f} GB/s, ready in {ready_s:.2f} s, pre-fault "
            f"{run['populate_ms_per_gib']:.2f} ms/GiB, page tables {run['pte_kib_per_gib']:.1f} KiB/GiB, pages "
            f"{run['page_size']}, Table.gather {run['gather_rows_s']:.0f} rows/s")
    first, rest = runs[0], runs[1:] or runs[:1]
    out = {"runs": runs, "table_bytes": first["source_bytes"], "fitted_to_pages": fitted,
           "mapped_bytes": first["mapped_bytes"],
           "staging_gb_s_first": first["gb_s"], "ready_less_copy_s_first": first["ready_less_copy_s"],
           "staging_gb_s": _summary([r["gb_s"] for r in rest]),
           "ready_less_copy_s": _summary([r["ready_less_copy_s"] for r in rest]),
           "page_sizes": sorted({r["page_size"] for r in runs})}
    for key in ("huge_share", "populate_ms_per_gib", "attach_ms", "pte_kib_per_gib", "gather_rows_s"):
        out[key] = _summary([r[key] for r in runs])
    return out


def bench(work: Path, repeats: int = 3, requests: int = 45, ids: int = 8192, settle: Callable[[], None] | None = None,
          log: Callable[[str], None] = _log, size_gib: float = 0.9, shards: int = 4) -> dict:
    """Every column on one table of ``size_gib`` GiB made in a directory of its own under ``work`` (deleted after);
    the results. A column this host cannot give is said in its place ("not_measured": why); a column that fails
    otherwise raises. Every pled started is stopped, and the host's pools and shmem_enabled compared after."""
    from tests.harness import start as start_pled  # the tests' way to start pled: run from the repository root

    here = Path(tempfile.mkdtemp(prefix="hugepages-", dir=work))
    host_before = host_settings()
    res: dict = {"repeats": repeats, "gather_ids": ids, "gather_requests": requests, "columns": {}, "pools": {}}
    started: list = []

    def start(name: str, tables: dict, keys: dict):
        d = start_pled(here, tables, name=name, wait=None, **keys)
        started.append(d)
        return d

    def measure(name: str, table: dict, fitted: bool = False) -> None:
        try:
            res["columns"][name] = column(name, table, start, repeats, requests, ids, settle, log, fitted)
        except NotMeasured as err:
            res["columns"][name] = {"not_measured": str(err)}
            log(f"{name}: not measured: {err}")

    try:
        t0 = time.perf_counter()
        table = make_table(here / TABLE, size_gib, shards)
        res["table"] = {k: v for k, v in table.items() if k not in ("path", "files")}
        log(f"a {table['bytes'] / GiB:.2f} GiB ples_int4 sidecar in {here} ({time.perf_counter() - t0:.1f} s)")
        with contextlib.ExitStack() as big:
            # 1 GiB pages first, before the other columns churn memory: the kernel must find whole contiguous GiBs
            needed = math.ceil(table["region_bytes"] / GiB)
            try:
                given = big.enter_context(reserve(needed, GiB))
            except NotMeasured as err:
                given, res["columns"]["hugetlb 1 GiB"] = 0, {"not_measured": str(err)}
            else:
                res["pools"]["1 GiB"] = {"asked": needed, "given": given}
                log(f"1 GiB pool: the kernel gave {given} of {needed} pages")
            measure("4 KiB pages", table)
            try:
                with shmem_enabled("advise"):
                    measure("THP", table)
            except NotMeasured as err:
                res["columns"]["THP"] = {"not_measured": str(err)}
            needed2 = math.ceil(table["region_bytes"] / (2 * MiB))
            try:
                with reserve(needed2, 2 * MiB) as given2:
                    res["pools"]["2 MiB"] = {"asked": needed2, "given": given2}
                    if given2 < needed2:
                        res["columns"]["hugetlb 2 MiB"] = {"not_measured": f"the kernel gave {given2} of {needed2} "
                                                                            "2 MiB pages"}
                    else:
                        measure("hugetlb 2 MiB", table)
            except NotMeasured as err:
                res["columns"]["hugetlb 2 MiB"] = {"not_measured": str(err)}
            if "hugetlb 1 GiB" not in res["columns"]:
                if given == 0:
                    res["columns"]["hugetlb 1 GiB"] = {"not_measured": f"the kernel gave 0 of {needed} 1 GiB pages"}
                elif given < needed:  # a smaller table of the same shape, on the pages given
                    log(f"1 GiB pages: a table fitting the {given} page(s) given")
                    measure("hugetlb 1 GiB", fit_table(here / "fits-1g", table, given * GiB), fitted=True)
                else:
                    measure("hugetlb 1 GiB", table)
    finally:
        for d in started:
            d.stop(timeout=60)
        shutil.rmtree(here, ignore_errors=True)
        host_after = host_settings()
        res["host_restored"] = host_after == host_before
        res["host"] = {"before": host_before, "after": host_after}
        log(f"host settings {'as found' if res['host_restored'] else 'CHANGED'}: {host_after}")
    res["columns"] = {name: res["columns"][name] for name in COLUMNS if name in res["columns"]}
    return res


# -- report -----------------------------------------------------------------------------------------------

def _pages(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _cell(c: dict, key: str, digits: int = 2, scale: float = 1.0) -> str:
    if "not_measured" in c:
        return "not measured"
    v = c[key]
    return report.fmt(v, scale=scale, digits=digits) if isinstance(v, dict) else f"{v * scale:.{digits}f}"


ROWS = (  # (label, key, digits, scale)
    ("staging GB/s, first start", "staging_gb_s_first", 2, 1.0),
    ("staging GB/s, the repeats", "staging_gb_s", 2, 1.0),
    ("start to ready less the copy, s, first start", "ready_less_copy_s_first", 2, 1.0),
    ("start to ready less the copy, s, the repeats", "ready_less_copy_s", 2, 1.0),
    ("huge-page share of the region (Status), %", "huge_share", 0, 100.0),
    ("attach + pre-fault, ms per GiB (`populate_seconds`)", "populate_ms_per_gib", 2, 1.0),
    ("the whole attach, ms", "attach_ms", 1, 1.0),
    ("page tables added, KiB per GiB (`VmPTE`)", "pte_kib_per_gib", 1, 1.0),
    ("`Table.gather`, rows/s (asymptote)", "gather_rows_s", 0, 1.0),
)


@report.section
def section(res: dict) -> list[str] | None:
    h = res.get("hugepages")
    if not h or not h.get("columns"):
        return None
    cols, t = h["columns"], h["table"]
    measured = [c for c in cols.values() if "not_measured" not in c]
    repeats = measured[0]["populate_ms_per_gib"]["n"] if measured else h["repeats"]
    lines = ["## 9. Huge pages, side by side", "",
             f"One {t['layout']} table of {t['bytes'] / GiB:.2f} GiB ({t['shards']} shards) on "
             "each kind of pages, one column after the other in one run: `huge_pages = \"off\"` (4 KiB pages); "
             "`\"auto\"` with shmem_enabled set to `advise` for the column and restored (THP); `\"hugetlb\"` with "
             "`huge_page_size = \"2M\"` and `\"1G\"`, each on a pool raised by the pages the region needs and put back "
             f"after. Each column: {repeats} fresh `pled serve` processes, one after the other, the sidecar's page "
             "cache dropped before each; against each, one fresh client process that attaches with "
             "`populate=True`, and one fresh `Table.gather` process (bench/table_gather.py's worker, "
             f"{h['gather_ids']} random ids a request, {h['gather_requests']} requests, the median of the last "
             "third). Staging GB/s is Status `staging_seconds`: the copy and hashing, after a hugetlb region's "
             "pages are allocated (and zeroed); that allocation, with Python's start-up and the planning, is in "
             "the time from start to ready less the copy. The first start of each column is shown apart: its pages "
             "may be memory this virtual machine's host has not backed yet (the first touch of it), which the "
             "later starts reuse. Per GiB: of the client's mapping "
             "(a hugetlb region is a whole number of pages). Median (min-max) over the repeats.", "",
             "| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for label, key, digits, scale in ROWS:
        lines.append(f"| {label} | " + " | ".join(_cell(c, key, digits, scale) for c in cols.values()) + " |")
    lines.append("| pages the client got (`Table.page_size`) | " + " | ".join(
        "not measured" if "not_measured" in c else ", ".join(_pages(p) for p in c["page_sizes"])
        for c in cols.values()) + " |")
    lines.append("")
    for name, c in cols.items():
        if "not_measured" in c:
            lines.append(f"- {name}: not measured: {c['not_measured']}.")
        elif c.get("fitted_to_pages"):
            lines.append(f"- {name}: on a table of {c['table_bytes'] / GiB:.2f} GiB of the same shape, sized to "
                         "the pages the kernel gave.")
    for size, p in h.get("pools", {}).items():
        lines.append(f"- {size} pool: raised by {p['asked']} page(s), the region's; the kernel gave {p['given']}.")
    lines.append(f"- Every pool's `nr_hugepages` and shmem_enabled afterwards: "
                 f"{'as found' if h.get('host_restored') else 'NOT as found'}.")
    return lines


@report.verdict
def verdicts(res: dict) -> list[tuple[bool, str]] | None:
    h = res.get("hugepages")
    if not h or not h.get("columns"):
        return None
    # (column, figure, statistic, target, what, how the figure reads, unit): one verdict each
    checks = [(name, "populate_ms_per_gib", "median", target, "attach + pre-fault", "{:.2f}", "ms per GiB")
              for name, target in TARGETS["populate_ms_per_gib"].items()]
    checks += [(name, "pte_kib_per_gib", "max", TARGETS["pte_kib_per_gib"], "page tables", "at most {:.1f}",
                "KiB per GiB") for name in POOLS]
    out = []
    for name, figure, stat, target, what, shown, unit in checks:
        c = h["columns"].get(name, {"not_measured": "not run"})
        if "not_measured" in c:
            out.append((False, f"{what} on {name} pages not measured: {c['not_measured']} "
                               f"(target under {target} {unit})"))
        else:
            v = c[figure][stat]
            out.append((v < target, f"{what} on {name} pages {shown.format(v)} {unit} (target under {target} {unit})"))
    return out


def main() -> int:
    if sys.argv[1:2] == ["probe"]:
        p = argparse.ArgumentParser(prog="python -m bench.hugepages probe")
        p.add_argument("table")
        p.add_argument("--socket", required=True)
        a = p.parse_args(sys.argv[2:])
        json.dump(probe(a.table, a.socket), sys.stdout)
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.hugepages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=0.9, help="the table (default: fits one 1 GiB page)")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=45)
    p.add_argument("--ids", type=int, default=8192)
    p.add_argument("--no-settle", action="store_true", help="do not wait for a quiet machine before each client")
    p.add_argument("--workdir", default="/var/tmp")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pled-bench-hp-", dir=a.workdir))
    try:
        res = {"hugepages": bench(work, a.repeats, a.requests, a.ids, None if a.no_settle else settle,
                                  size_gib=a.size_gib, shards=a.shards)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    print("\n".join((section(res) or []) + [""] + [f"- {'met' if ok else 'NOT met'}: {text}"
                                                     for ok, text in verdicts(res) or []]))
    return 0 if res["hugepages"]["host_restored"] else 1


if __name__ == "__main__":
    sys.exit(main())
