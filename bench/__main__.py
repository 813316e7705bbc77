"""pled's benchmarks, side by side against the baselines a user would otherwise pick.

    make bench                      # about 4 GiB ples_int4, 16 shards, 3 repeats
    python -m bench --size-gib 1 --repeats 5

Writes docs/BENCHMARKS.md and docs/benchmarks.json. Everything it makes (the sidecar, copies in
/dev/shm) is deleted at the end; a shmem_enabled it changes for the huge-page runs is restored.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import engram033, hugepages, offload, ple033, report, soak, status_cli, table_gather  # sections 5-11
from bench.common import SHMEM, cpu_busy, log, settle  # noqa: F401 (shared: bench/common.py)
from pled.daemon.regions import staging
from pled.daemon.sources.sidecar import open_table
from pled.generator import make_sidecar
from pled.shared.pagecache import cached_bytes
from tests.harness import Daemon, start  # the tests' way to start pled: python -m bench runs from the repository root

GiB = 1024**3
MiB = 1024**2
ROOT = Path(__file__).resolve().parent.parent


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def shard_files(d: Path) -> list[str]:
    return [s.path for s in open_table(str(d)).shards]


def drop_cache(files: list[str]) -> None:
    """POSIX_FADV_DONTNEED on every shard: these files leave the page cache, nothing else does."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(files: list[str]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(16 * MiB):
                pass


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    mem = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / GiB, 1), "kernel": platform.release(),
            "python": platform.python_version(), "shmem_enabled": SHMEM.read_text().strip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


# -- 1. staging -------------------------------------------------------------------------------

def sample_page_cache(files: list[str], stop: threading.Event, peak: list[int]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], sum(cached_bytes(f) for f in files))
        time.sleep(0.005)


def stage_pled(d: Path, files: list[str], digests: bool = True) -> dict:
    sidecar = open_table(str(d))
    peak, stop = [0], threading.Event()
    sampler = threading.Thread(target=sample_page_cache, args=(files, stop, peak))
    sampler.start()
    t = time.perf_counter()
    try:
        r = staging.stage("bench", sidecar, digests=digests)
    finally:
        stop.set()
        sampler.join()
    seconds = time.perf_counter() - t
    huge = r.stats.huge_bytes / r.manifest.region_bytes
    r.close()
    return {"seconds": seconds, "peak_page_cache": peak[0], "huge_share": huge}


def stage_dd(files: list[str]) -> dict:
    t = time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct", "status=none"], check=True)
    return {"seconds": time.perf_counter() - t}


def stage_cp(files: list[str]) -> dict:
    target = Path(tempfile.mkdtemp(prefix="pled-bench-", dir="/dev/shm"))
    try:
        t = time.perf_counter()
        subprocess.run(["cp", *files, str(target)], check=True)
        return {"seconds": time.perf_counter() - t}
    finally:
        shutil.rmtree(target)


def bench_staging(d: Path, repeats: int) -> dict:
    files = shard_files(d)
    nbytes = sum(os.path.getsize(f) for f in files)
    runs: dict[str, list[dict]] = {}
    methods = {"pled": lambda: stage_pled(d, files),
               "pled without digests": lambda: stage_pled(d, files, digests=False),
               "dd iflag=direct": lambda: stage_dd(files), "cp to /dev/shm": lambda: stage_cp(files)}
    for rep in range(repeats):
        order = list(methods)[rep % len(methods):] + list(methods)[: rep % len(methods)]  # no method always goes first
        for cache in ("cold", "warm"):
            for name in order:
                if name == "dd iflag=direct" and cache == "warm":
                    continue  # O_DIRECT bypasses the page cache: warm is the same as cold
                drop_cache(files) if cache == "cold" else warm_cache(files)
                result = methods[name]()
                result["gb_s"] = nbytes / result["seconds"] / 1e9
                runs.setdefault(f"{name} {cache}", []).append(result)
                log(f"staging {name} {cache}: {result['gb_s']:.2f} GB/s")
    out = {k: {"gb_s": summary([r["gb_s"] for r in v])} for k, v in runs.items()}
    pled_cold = runs["pled cold"]
    out["pled cold"]["peak_page_cache"] = summary([r["peak_page_cache"] for r in pled_cold])
    out["pled cold"]["huge_share"] = summary([r["huge_share"] for r in pled_cold])
    out["bytes"] = nbytes
    out["largest_shard"] = max(os.path.getsize(f) for f in files)
    return out


# -- daemons ------------------------------------------------------------------------------------

def memory(pid: int) -> dict:
    """The kB figures of /proc/PID/status, in bytes."""
    fields = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def rchar(pid: int) -> int:
    """Bytes the process has read (/proc/PID/io), whatever the page cache held."""
    return next(int(line.split()[1]) for line in open(f"/proc/{pid}/io") if line.startswith("rchar"))


# -- 2. attach ----------------------------------------------------------------------------------

def bench_attach(sock: str, tables: list[str], attaches: int, populate_runs: int, bench_table: str) -> dict:
    from pled.client import attach

    out = {}
    for name in tables:
        lat = []
        for _ in range(attaches):
            t = time.perf_counter()
            table = attach(name, socket=sock, populate=False)
            _ = table.tensors  # views over the mapping, no copy
            lat.append(time.perf_counter() - t)
            del _
            table.close()
        lat.sort()
        out[name] = {"median_ms": statistics.median(lat) * 1e3, "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1e3,
                     "max_ms": lat[-1] * 1e3, "n": len(lat), "shards": len(table.shards)}
        log(f"attach {name}: median {out[name]['median_ms']:.3f} ms, p99 {out[name]['p99_ms']:.3f} ms")
    out["populate_s_per_gib"] = summary(populate_per_gib(sock, bench_table, populate_runs))
    return out


def populate_per_gib(sock: str, table: str, runs: int) -> list[float]:
    """Pre-fault time per GiB, each in a fresh process (a mapping already faulted in costs nothing)."""
    code = ("import json,sys; from pled.client import attach; t = attach(sys.argv[1], socket=sys.argv[2]); "
            "print(json.dumps([t.populate_seconds, t.manifest.region_bytes]))")
    values = []
    for _ in range(runs):
        seconds, size = json.loads(subprocess.run([sys.executable, "-c", code, table, sock], capture_output=True,
                                                  text=True, check=True).stdout)
        values.append(seconds / (size / GiB))
    return values


# -- 3. cold-start gathers -----------------------------------------------------------------------

def gather_run(args: list[str], requests: int, ids: int) -> dict:
    r = subprocess.run([sys.executable, "-m", "bench.gather_worker", *args, "--requests", str(requests),
                        "--ids", str(ids)], capture_output=True, text=True, check=True, cwd=ROOT)
    data = json.loads(r.stdout)
    rates = data["rows_per_s"]
    tail = max(5, requests // 3)
    asymptote = statistics.median(rates[-tail:])
    within = next((i + 1 for i, x in enumerate(rates) if x >= 0.95 * asymptote), None)
    return {"first": rates[0], "first10": statistics.mean(rates[:10]), "asymptote": asymptote,
            "first_over_asymptote": rates[0] / asymptote, "requests_to_5pct": within,
            "populate_s": data["populate_s"], "setup_s": data["setup_s"]}


def gather_cases(d: Path, sock: str, table: str, pages: str | None) -> dict:
    """The cases of one pass: the mmap baselines and pled with 4 KiB pages, or pled with huge pages."""
    files = shard_files(d)
    if pages == "huge pages":
        return {f"(c) pled, fresh process, pre-faulted ({pages})": (["pled", table, "--socket", sock], lambda: None),
                f"(c) pled, fresh process, not pre-faulted ({pages})": (["pled", table, "--socket", sock,
                                                                         "--no-populate"], lambda: None)}
    return {
        "(a) files mmapped, cold page cache": (["mmap", str(d)], lambda: drop_cache(files)),
        "(b) files mmapped, warm page cache": (["mmap", str(d)], lambda: warm_cache(files)),
        "(c) pled, fresh process, pre-faulted (4 KiB pages)": (["pled", table, "--socket", sock], lambda: None),
        "(c) pled, fresh process, not pre-faulted (4 KiB pages)": (["pled", table, "--socket", sock, "--no-populate"],
                                                                   lambda: None),
    }


def bench_gathers(cases: dict, repeats: int, requests: int, ids: int) -> dict:
    out = {}
    for _ in range(repeats):
        for name, (args, prepare) in cases.items():
            prepare()
            settle()
            result = gather_run(args, requests, ids)
            out.setdefault(name, []).append(result)
            log(f"gathers {name}: first {result['first']:.0f} rows/s, asymptote {result['asymptote']:.0f}, "
                f"{result['requests_to_5pct']} requests to 5%")
    keys = ["first", "first10", "asymptote", "first_over_asymptote", "populate_s"]
    return {name: {k: summary([r[k] for r in runs]) for k in keys}
            | {"requests_to_5pct": summary([r["requests_to_5pct"] or requests for r in runs]),
               "runs_first_over_asymptote": [round(r["first_over_asymptote"], 3) for r in runs]}
            for name, runs in out.items()}


# -- 4. restart cost -----------------------------------------------------------------------------

class NotifySocket:
    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.path = str(path)

    def wait_stored(self, timeout: float = 600) -> tuple[int, str]:
        self.sock.settimeout(timeout)
        while True:
            msg, fds, _, _ = socket.recv_fds(self.sock, 65536, 4)
            fields = msg.decode().split("\n")
            if "FDSTORE=1" in fields:
                return fds[0], next(f[7:] for f in fields if f.startswith("FDNAME="))
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        self.sock.close()


def bench_restart(work: Path, d: Path, repeats: int) -> dict:
    files = shard_files(d)
    fresh, adopted = [], []
    for rep in range(repeats):
        n = NotifySocket(work / f"notify{rep}.sock")
        drop_cache(files)
        first = start(work, {"bench": d}, name=f"restart{rep}a", env={"NOTIFY_SOCKET": n.path}, wait=None)
        fd, name = n.wait_stored()
        fresh.append({"seconds": first.wait_ready(timeout=600), "rchar": rchar(first.pid)})
        first.stop(timeout=60)
        drop_cache(files)
        second = start(work, {"bench": d}, name=f"restart{rep}b", env={"NOTIFY_SOCKET": n.path}, fds=[(fd, name)],
                       wait=None)
        os.close(fd)
        adopted.append({"seconds": second.wait_ready(timeout=600), "rchar": rchar(second.pid)})
        second.stop(timeout=60)
        n.close()
        log(f"restart: fresh {fresh[-1]['seconds']:.2f} s, adopted {adopted[-1]['seconds']:.2f} s")
    return {k: {"seconds": summary([r["seconds"] for r in v]), "rchar": summary([r["rchar"] for r in v])}
            for k, v in (("fresh staging", fresh), ("adopted from the fd store", adopted))}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=4.0)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--staging-repeats", type=int, default=5, help="staging is the noisiest measurement here")
    p.add_argument("--attaches", type=int, default=1000)
    p.add_argument("--requests", type=int, default=45)
    p.add_argument("--ids", type=int, default=8192)
    p.add_argument("--no-huge-pages", action="store_true",
                   help="do not switch shmem_enabled to advise for the huge-page runs")
    p.add_argument("--soak-seconds", type=float, default=120.0, help="bench/soak.py's duration (0: skip it)")
    p.add_argument("--ple033-gib", type=float, default=2.0, help="section 10's PLE tables (vLLM 0.33's own path)")
    p.add_argument("--engram033-gib", type=float, default=4.0,
                   help="section 11's DeepSeek V4.1 Engram tables (4 GiB where the host has the memory to spare)")
    p.add_argument("--workdir", default="/var/tmp")
    p.add_argument("--out", default=str(ROOT / "docs" / "BENCHMARKS.md"))
    p.add_argument("--json", default=str(ROOT / "docs" / "benchmarks.json"))
    p.add_argument("--render", metavar="JSON", help="only write the report again from a results file")
    a = p.parse_args()
    if a.render:
        res = json.loads(Path(a.render).read_text())
        res.pop("verdicts", None)  # written by older runs; verdicts are always made from the figures
        report.write(res, Path(a.out))
        print("\n".join(report.verdict_lines(res)))
        return 0
    command = "python -m bench " + " ".join(sys.argv[1:]) if sys.argv[1:] else "make bench"
    work = Path(tempfile.mkdtemp(prefix="pled-bench-", dir=a.workdir))
    daemons: list[Daemon] = []
    try:
        rows = int(a.size_gib * GiB / 100 / a.shards)  # ples_int4: 100 bytes a row
        log(f"making a {a.size_gib} GiB ples_int4 sidecar, {a.shards} shards x {rows} rows, in {work}")
        d = work / "ples_int4"
        make_sidecar(str(d), "ples_int4", shards=a.shards, rows=rows)
        small = work / "ples128"
        make_sidecar(str(small), "ples_int4", shards=128, rows=1000)
        sidecar = open_table(str(d))
        res = {"machine": machine(), "command": command, "table_name": "ples_int4", "gather_ids": a.ids,
               "gather_requests": a.requests,
               "table": {"layout": sidecar.layout, "shards": len(sidecar.shards), "rows": sidecar.rows,
                         "row_width": sidecar.row_width}}
        res["staging"] = bench_staging(d, a.staging_repeats)
        daemon = start(work, {"ples_int4": d, "ples128": small}, name="main", wait=None)
        daemons.append(daemon)
        daemon.wait_ready(timeout=600)
        res["daemon"] = memory(daemon.pid)
        res["attach"] = bench_attach(daemon.socket, ["ples_int4", "ples128"], a.attaches, a.repeats, "ples_int4")
        res["status_cli"] = status_cli.bench(daemon.socket, str(daemon.config))
        # 4 KiB pages first, huge pages after: staging a huge-page table makes the kernel compact memory,
        # migrating other tables' pages under their mappings, which would disturb the 4 KiB runs.
        res["gathers"] = bench_gathers(gather_cases(d, daemon.socket, "ples_int4", None), a.repeats, a.requests, a.ids)
        res["table_gather"] = {"4 KiB pages": table_gather.run(daemon.socket, "ples_int4", max(5, a.repeats),
                                                               a.requests, a.ids, settle, log)}
        with contextlib.ExitStack() as stack:
            if not a.no_huge_pages and SHMEM.exists():
                try:
                    stack.enter_context(hugepages.shmem_enabled("advise"))
                except hugepages.NotMeasured as err:
                    log(f"huge pages not measured: {err}")
                else:
                    huge = start(work, {"ples_int4": d}, name="huge", wait=None)
                    daemons.append(huge)
                    huge.wait_ready(timeout=600)
                    res["attach_huge"] = {
                        "populate_s_per_gib": summary(populate_per_gib(huge.socket, "ples_int4", a.repeats))}
                    res["huge_share"] = [line for line in huge.log_path.read_text().splitlines()
                                         if "staged:" in line][0]
                    res["gathers"] |= bench_gathers(gather_cases(d, huge.socket, "ples_int4", "huge pages"), a.repeats,
                                                    a.requests, a.ids)
                    res["table_gather"]["huge pages"] = table_gather.run(huge.socket, "ples_int4", max(5, a.repeats),
                                                                         a.requests, a.ids, settle, log)
        res["hugepages"] = None if a.no_huge_pages else hugepages.bench(work, a.repeats, a.requests, a.ids, settle, log)
        # its own published-shape sidecar and pled: the worker refuses the benchmark's table of another shape
        res["offload_worker"] = offload.bench(work, lambda name, tables: start(work, tables, name=name, wait=None),
                                              a.repeats, a.requests, a.ids)
        if (ROOT / ".cache" / "vllm-0.33.0" / ".ready").exists():
            res["ple033"] = ple033.bench(work, lambda name, tables: start(work, tables, name=name, wait=None),
                                         a.repeats, a.ple033_gib)
            res["engram033"] = engram033.bench(work, lambda name, tables: start(work, tables, name=name, wait=None),
                                               1, a.engram033_gib)
        else:
            log("section 10 (vLLM 0.33's PLE path) not measured: no .cache/vllm-0.33.0 (make vllm-env makes it)")
        for dm in daemons:
            dm.stop(timeout=60)
        res["restart"] = bench_restart(work, d, a.repeats)
        if a.soak_seconds > 0:
            res["soak"] = soak.run(work, a.soak_seconds)
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
        report.write(res, Path(a.out))
        log(f"wrote {a.out} and {a.json}")
        print("\n".join(report.verdict_lines(res)))
        return 0
    finally:
        for dm in daemons:
            dm.stop(timeout=60)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
