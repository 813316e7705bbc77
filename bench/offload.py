"""The PLE offload worker's side (bench/ple_offload_worker.py): a spawned process that reads the sidecar with
``safe_open`` + ``get_tensor`` and gathers 8,192 random rows per request with torch, just after a restart.

The worker, like the published one, accepts only the published shape (2,500,012 rows a shard, width 160), so
this section makes its own int4 sidecar of that shape (2 shards by default, standing in for the published 128:
the worker is told the model has that many rows) and its own pled serving it:

- pled: the worker finds the table through pled's start-up hook (PLED_SOCKET set), pre-faulted;
- mmapped sidecar: no PLED_SOCKET; safetensors maps the files, whose page cache a checkpoint load evicted
  (dropped here with POSIX_FADV_DONTNEED on each shard).

Also the interpreter's start-up time with the hook installed and PLED_SOCKET unset, set, and without the
hook. The worker runs in a scratch virtual environment with pled installed from a wheel by `pip install`,
as an operator installs it, seeing the vLLM environment's torch and safetensors (.venv-vllm).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import report as bench_report
from bench.ple_offload_worker import MODEL_WIDTH, ROWS_PER_SHARD

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
WORKER = ROOT / "bench" / "ple_offload_worker.py"
PTH = "pled-autoload.pth"


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLED_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return env | extra


def hook_venv(work: Path) -> Path:
    """A venv of the vLLM environment's interpreter, its packages visible, pled pip-installed from a wheel."""
    wheels, venv = work / "wheel", work / "hook-venv"
    subprocess.run([str(VLLM_PYTHON), "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True, env=_env())
    subprocess.run([str(VLLM_PYTHON), "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    vllm_site = subprocess.run([str(VLLM_PYTHON), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "_bench_vllm_env.pth").write_text(vllm_site + "\n")
    (wheel,) = wheels.glob("pled-*.whl")
    subprocess.run([str(VLLM_PYTHON), "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    str(wheel)], check=True, capture_output=True, env=_env())
    return python


def _drop_cache(files: list[str]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)  # pages still dirty from the writing are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _worker_run(python: Path, d: Path, model_rows: int, env: dict, requests: int, ids: int) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([str(python), str(WORKER), str(d), "--model-rows", str(model_rows), "--workers", "1",
                        "--requests", str(requests), "--ids", str(ids)],
                       capture_output=True, text=True, env=env, cwd="/", timeout=3600)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"offload worker failed: {r.stdout[-2000:]} {r.stderr[-2000:]}")
    (report,) = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    rates = [ids / s for s in report["request_s"]]
    asymptote = statistics.median(rates[-max(5, requests // 3):])
    within = next((i + 1 for i, x in enumerate(rates) if x >= 0.95 * asymptote), None)
    return {"first": rates[0], "asymptote": asymptote, "first_over_asymptote": rates[0] / asymptote,
            "requests_to_5pct": within or requests, "load_s": report["load_s"], "wall_s": wall,
            "opened_as": report["opened_as"]}


def startup_times(python: Path, runs: int) -> dict:
    """`python -c pass` in the hook's venv: hook installed, PLED_SOCKET unset / set; and the .pth removed."""
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())

    def once(env: dict) -> float:
        t = time.perf_counter()
        subprocess.run([str(python), "-c", "pass"], env=env, check=True, cwd="/")
        return time.perf_counter() - t

    times: dict[str, list[float]] = {"no hook": [], "hook, PLED_SOCKET unset": [], "hook, PLED_SOCKET set": []}
    for _ in range(runs):  # interleaved, so that the machine's drift touches each alike
        times["hook, PLED_SOCKET unset"].append(once(_env()))
        times["hook, PLED_SOCKET set"].append(once(_env(PLED_SOCKET="/nonexistent")))
        (site / PTH).rename(site / (PTH + ".off"))
        try:
            times["no hook"].append(once(_env()))
        finally:
            (site / (PTH + ".off")).rename(site / PTH)
    out = {name: statistics.median(t) * 1000 for name, t in times.items()}
    return out


def published_sidecar(d: Path, shards: int) -> Path:
    """An int4 sidecar of the published shape: ``shards`` shards of 2,500,012 rows, width 160 (240 MB a shard)."""
    from pled.generator import make_sidecar

    make_sidecar(str(d), "ples_int4", shards=shards, rows=ROWS_PER_SHARD, width=MODEL_WIDTH, seed=11)
    return d


def bench(work: Path, start_daemon, repeats: int, requests: int, ids: int, shards: int = 2) -> dict | None:
    """The offload worker against pled and against the mmapped sidecar, on a published-shape int4 sidecar of
    ``shards`` shards made here and served by a pled that ``start_daemon(name, tables)`` starts (an object with
    ``socket``, ``wait_ready()`` and ``stop()``); both are gone afterwards. None where .venv-vllm is missing."""
    if not VLLM_PYTHON.exists():
        _log("offload worker not measured: no .venv-vllm (torch and safetensors come from it; make vllm-env)")
        return None
    python = hook_venv(work)
    d = work / "offload-published"
    model_rows = shards * ROWS_PER_SHARD
    _log(f"offload worker: a published-shape ples_int4 sidecar, {shards} shards x {ROWS_PER_SHARD} rows, in {d}")
    published_sidecar(d, shards)
    daemon = start_daemon("offload", {"ples_int4": d})
    try:
        daemon.wait_ready()
        files = sorted(str(p) for p in d.glob("*.safetensors"))
        cases = {"pled (start-up hook), fresh worker": _env(PLED_SOCKET=daemon.socket, OMP_NUM_THREADS="1"),
                 "mmapped sidecar, page cache evicted": _env(OMP_NUM_THREADS="1")}
        runs: dict[str, list[dict]] = {}
        for _ in range(repeats):
            for name, env in cases.items():
                _drop_cache(files)
                r = _worker_run(python, d, model_rows, env, requests, ids)
                runs.setdefault(name, []).append(r)
                _log(f"offload worker, {name}: load {r['load_s']:.2f} s, first {r['first']:.0f} rows/s, asymptote "
                     f"{r['asymptote']:.0f}, {r['requests_to_5pct']} requests to 5% ({r['opened_as']})")
    finally:
        daemon.stop()
        shutil.rmtree(d, ignore_errors=True)
    keys = ("first", "asymptote", "first_over_asymptote", "requests_to_5pct", "load_s")
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    spread = {name: {k: [min(r[k] for r in rs), max(r[k] for r in rs)] for k in keys} for name, rs in runs.items()}
    for name in med:
        med[name]["spread"] = spread[name]
    # The sidecar's shape under names of its own (the report renders them from here, never as fixed figures).
    shape = {"n_shards": shards, "rows_per_shard": ROWS_PER_SHARD, "width": MODEL_WIDTH, "model_rows": model_rows}
    return {"cases": med, "startup_ms": startup_times(python, 10 * repeats), "requests": requests, "ids": ids,
            "sidecar": shape}


@bench_report.section
def section(res: dict) -> list[str] | None:
    return report(res["offload_worker"])[1:] if "offload_worker" in res else None


def _range(c: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    lo, hi = c.get("spread", {}).get(key, (None, None))
    return "" if lo is None else f" ({format(lo * scale, fmt)}-{format(hi * scale, fmt)})"


def report(res: dict | None) -> list[str]:
    """The section of docs/BENCHMARKS.md."""
    lines = ["", "## 5. The PLE offload worker after a restart", ""]
    if not res:
        return lines + ["Not measured in this run (it needs .venv-vllm, whose torch and safetensors the worker uses).",
                        ""]
    tok = res["ids"] // 16
    shape = res.get("sidecar")  # absent in results of runs before the worker took the published shape only
    table = "" if not shape else (
        f" The sidecar: ples_int4 of the published shape, {shape['n_shards']} shards of {shape['rows_per_shard']:,} "
        f"rows, width {shape['width']}, the worker told the model has {shape['model_rows']:,} rows (as the "
        "published worker, it refuses any other shape).")
    lines += [f"vLLM's PLE offload worker played as the Flash-Next builds run it (`bench/ple_offload_worker.py`): a "
              "spawned process that never loads vLLM's plugins reads META.json and checks it against the model, "
              "`safe_open` (handles kept) + `get_tensor` on every "
              f"shard, then gathers {res['ids']} random rows per request ({tok} tokens of 16 ids) and dequantizes "
              f"them with torch; {res['requests']} requests. pled reaches it only through its start-up hook "
              "(`pled-autoload.pth`, PLED_SOCKET set). The mmapped case's page cache was evicted first, as a "
              "checkpoint load does. Medians over the repeats, with (min-max)." + table, "",
              "| case | table load in the worker | first request, tok/s | asymptote, tok/s | first / asymptote | "
              "requests to within 5% |", "|---|---|---|---|---|---|"]
    for name, c in res["cases"].items():
        lines.append(f"| {name} | {c['load_s']:.2f} s{_range(c, 'load_s', '.2f')} | {c['first'] / 16:.0f}"
                     f"{_range(c, 'first', '.0f', 1 / 16)} | "
                     f"{c['asymptote'] / 16:.0f}{_range(c, 'asymptote', '.0f', 1 / 16)} | "
                     f"{c['first_over_asymptote']:.2f}{_range(c, 'first_over_asymptote', '.2f')} | "
                     f"{c['requests_to_5pct']:.0f}{_range(c, 'requests_to_5pct', '.0f')} |")
    s = res["startup_ms"]
    lines += ["", "tok/s here is this gather's own rate (rows/s / 16), not a model's decode rate. Interpreter start-up "
                  f"(`python -c pass`, median): without the hook {s['no hook']:.1f} ms; with it and PLED_SOCKET unset "
                  f"{s['hook, PLED_SOCKET unset']:.1f} ms; with PLED_SOCKET set (the import hook installed) "
                  f"{s['hook, PLED_SOCKET set']:.1f} ms.", ""]
    return lines


def main() -> int:
    """A small run on its own: python -m bench.offload [--shards 2] [--requests 20]."""
    import argparse
    import tempfile

    from tests.harness import start

    p = argparse.ArgumentParser(prog="python -m bench.offload")
    p.add_argument("--shards", type=int, default=2, help="published-shape int4 shards (2,500,012 rows, 240 MB each)")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--ids", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pled-bench-offload-", dir="/var/tmp"))
    try:
        res = bench(work, lambda name, tables: start(work, tables, name=name, wait=None), a.repeats, a.requests, a.ids,
                    a.shards)
        print("\n".join(report(res)))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
