"""How long `pled status` takes, as a Kubernetes probe or a person runs it: by socket, and by config file.

    python -m bench.status_cli            # its own small pled; prints the figures
    (make bench runs it against the main benchmark's pled: docs/BENCHMARKS.md, section "pled status")

Each run is a fresh `pled status` process (the console script beside this Python, as installed), timed from
start to exit, with `--socket` and with `-c CONFIG` (which reads the socket from the file); the medians are held
against 100 ms. `python -c pass` is timed the same way, side by side: the interpreter's own start-up, the floor.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import report

TARGET_MS = 100.0


def _pled() -> list[str]:
    script = Path(sys.executable).parent / "pled"
    return [str(script)] if script.exists() else [sys.executable, "-m", "pled"]


def _timed(argv: list[str], runs: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PLED_SOCKET", "PLED_CONFIG")}  # the argument decides
    ms = []
    for _ in range(runs):
        start = time.perf_counter()
        r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        ms.append((time.perf_counter() - start) * 1000)
        if r.returncode not in (0, 1):  # 1: a table not fully resident, still a full answer
            raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()}")
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "n": runs}


def bench(socket: str, config: str, runs: int = 30) -> dict:
    return {
        "python -c pass": _timed([sys.executable, "-c", "pass"], runs),
        "pled status --socket": _timed([*_pled(), "status", "--socket", socket], runs),
        "pled status -c": _timed([*_pled(), "status", "-c", config], runs),
    }


@report.section
def status_section(res: dict) -> list[str] | None:
    r = res.get("status_cli")
    if not r:
        return None
    lines = ["## 8. `pled status`, as a probe runs it", "",
             f"A fresh `pled status` process, start to exit, {r['pled status --socket']['n']} runs each "
             "(median, min-max); `python -c pass` is the interpreter's own start-up.", "",
             "| command | median ms | min-max ms |", "|---|---:|---:|"]
    lines += [f"| `{name}` | {v['median']:.1f} | {v['min']:.1f}-{v['max']:.1f} |" for name, v in r.items()]
    return [*lines, ""]


@report.verdict
def status_verdicts(res: dict) -> list[tuple[bool, str]] | None:
    r = res.get("status_cli")
    if not r:
        return None
    return [(r[k]["median"] < TARGET_MS, f"`{k}` median {r[k]['median']:.1f} ms (target < {TARGET_MS:.0f} ms)")
            for k in ("pled status --socket", "pled status -c")]


def main() -> int:
    from pled.generator import make_sidecar
    from tests.harness import start  # the tests' way to start pled: run from the repository root

    work = Path(tempfile.mkdtemp(prefix="pled-bench-status-"))
    try:
        make_sidecar(str(work / "t"), "ples_int4", shards=4, rows=1000)
        pled = start(work, {"t": work / "t"})
        try:
            r = bench(pled.socket, str(pled.config))
        finally:
            pled.stop()
        res = {"status_cli": r}
        print("\n".join(status_section(res) or []))
        print("\n".join(("met: " if ok else "MISSED: ") + text for ok, text in status_verdicts(res) or []))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
