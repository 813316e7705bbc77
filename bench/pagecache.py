"""What dropping only pled's own pages costs staging a checkpoint table (pled/shared/dropbehind.py), side by side
with the whole-file drop pled did before and with no read-ahead at all.

    python -m bench.pagecache                       # a 1 GiB checkpoint (half PLE tensors), 5 repeats
    python -m bench.pagecache --gib 0.5 --repeats 7

Variants, each staging the same checkpoint, in turn (no variant always first), repeats interleaved:

* ``ranges``: what pled does: a residency snapshot per file (cachestat, mincore where a file is part cached), the
  file read with POSIX_FADV_RANDOM and pled's own read-ahead (POSIX_FADV_WILLNEED of the next chunk, never past a
  run of PLE tensors), pages dropped behind the copy only where pled brought them in;
* ``whole-file``: the behaviour before (read with POSIX_FADV_SEQUENTIAL, every chunk read dropped, then the whole
  file: the page cache of the rest of the checkpoint with it). Both read the file's tensors in file order;
* ``no-read-ahead``: ``ranges`` without pled's read-ahead: the kernel reads exactly what is asked, synchronously.

Each in three states of the page cache: ``cold`` (every file dropped first), ``warm`` (every file read first) and
``others-warm`` (every file read, then its PLE tensors dropped: vLLM has read the model, pled's part is cold). Prints
medians with min and max of seconds, and what each leaves in the page cache; writes JSON with --json. Deletes the
checkpoint at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pled.daemon.regions import staging
from pled.daemon.sources.checkpoint import open_checkpoint
from pled.generator import make_checkpoint
from pled.shared import dropbehind
from pled.shared.pagecache import cached_bytes

MiB = 1024 * 1024


def ple_ranges(path: str) -> list[tuple[int, int]]:
    from pled.daemon.sources.safetensors_file import read_header

    return [(t.begin, t.begin + t.nbytes) for t in read_header(path).tensors if "ngram_embedding" in t.name]


def make(d: Path, gib: float) -> list[str]:
    """Half PLE tensors (two layers of bf16, 32 shard tensors each), half other tensors (64 MiB each), 4 files."""
    width = 2048
    rows = int(gib * 1024**3 / 2 / 2 / (width * 2)) // 32 * 32
    others = max(1, int(gib * 1024**3 / 2 / (64 * MiB)))
    rng = np.random.default_rng(1)
    extra = [(f"model.language_model.layers.{i}.mlp.down_proj.weight", "BF16", (16384, 2048),
              rng.integers(0, 2**16, (16384, 2048), dtype=np.uint16)) for i in range(others)]
    files = make_checkpoint(str(d), "bf16", {0: rows, 1: rows}, width=width, parts=32, files=4, extra=extra)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return files


def advise(files: list[str], state: str) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if state != "cold":
                while os.read(fd, 64 * MiB):
                    pass
            if state == "others-warm":
                for lo, hi in ple_ranges(f):
                    os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _WholeFile(dropbehind.DropBehind):
    def __init__(self, fd, ranges, path, *, everything=False) -> None:
        super().__init__(fd, ranges, path, everything=True)


def _no_read_ahead(real):
    def fadvise(fd, offset, length, advice):
        return None if advice == os.POSIX_FADV_WILLNEED else real(fd, offset, length, advice)
    return fadvise


def _timed_dontneed(real, spent: list[float]):
    """posix_fadvise, the calls and seconds of its DONTNEEDs counted: the kernel may drain every CPU's LRU
    batches in one (lru_add_drain_all, when a page it was to drop sits in another CPU's batch)."""
    def fadvise(fd, offset, length, advice):
        if advice != os.POSIX_FADV_DONTNEED:
            return real(fd, offset, length, advice)
        t = time.perf_counter()
        try:
            return real(fd, offset, length, advice)
        finally:
            spent.append(time.perf_counter() - t)
    return fadvise


def stage_once(d: Path, files: list[str], variant: str) -> dict:
    real_db, real_fadvise = staging.DropBehind, os.posix_fadvise
    spent: list[float] = []
    os.posix_fadvise = _timed_dontneed(real_fadvise, spent)
    if variant == "whole-file":
        staging.DropBehind = _WholeFile  # type: ignore[misc]
    elif variant == "no-read-ahead":
        os.posix_fadvise = _no_read_ahead(os.posix_fadvise)
    try:
        source = open_checkpoint(str(d))
        t, cpu = time.perf_counter(), os.times()
        r = staging.stage("bench", source, digests=False)
        seconds, done = time.perf_counter() - t, os.times()
        r.close()
    finally:
        staging.DropBehind, os.posix_fadvise = real_db, real_fadvise  # type: ignore[misc]
    cpu_seconds = done.user + done.system - cpu.user - cpu.system  # the process's, kernel's copy included
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "dontneed_calls": len(spent),
            "dontneed_seconds": sum(spent),
            "cached_after": sum(cached_bytes(f) for f in files)}


def snapshot_cost(files: list[str]) -> float:
    """Seconds to take the residency snapshot of every file (the part of ``ranges`` that is new)."""
    t = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            dropbehind.resident(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pagecache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workdir", default="/var/tmp", help="a real file system (not tmpfs: its pages never drop)")
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--states", default="cold,warm,others-warm", help="which states of the page cache, by name")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pled-bench-pagecache-", dir=args.workdir))
    try:
        files = make(work, args.gib)
        total = sum(os.path.getsize(f) for f in files)
        ple = sum(hi - lo for f in files for lo, hi in ple_ranges(f))
        variants, states = ["ranges", "whole-file", "no-read-ahead"], args.states.split(",")
        runs: dict[str, list[dict]] = {}
        snap: dict[str, list[float]] = {}
        for rep in range(args.repeats):
            for state in states:
                for variant in variants[rep % 3:] + variants[:rep % 3]:
                    advise(files, state)
                    before = sum(cached_bytes(f) for f in files)
                    result = stage_once(work, files, variant) | {"cached_before": before}
                    runs.setdefault(f"{variant} {state}", []).append(result)
                advise(files, state)
                snap.setdefault(state, []).append(snapshot_cost(files))
            print(f"repeat {rep + 1} of {args.repeats} done", file=sys.stderr, flush=True)
        out = {"bytes": total, "ple_bytes": ple, "kernel": os.uname().release, "results": {}}
        print(f"checkpoint {total / MiB:.0f} MiB in {len(files)} files, PLE tensors {ple / MiB:.0f} MiB; "
              f"{args.repeats} repeats; kernel {os.uname().release}")
        print("| variant, page cache before | seconds, median (min-max) | x ranges | CPU seconds, median (min-max) "
              "| x ranges | DONTNEED calls, s | cached before -> after, MiB |")
        print("|---|---|---|---|---|---|---|")
        for state in states:
            base = {k: statistics.median(r[k] for r in runs[f"ranges {state}"]) for k in ("seconds", "cpu_seconds")}
            for variant in variants:
                rs = runs[f"{variant} {state}"]
                row, cells = {}, []
                for k in ("seconds", "cpu_seconds"):
                    xs = [r[k] for r in rs]
                    row[k] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
                    cells.append(f"{row[k]['median']:.3f} ({min(xs):.3f}-{max(xs):.3f}) | "
                                 f"{row[k]['median'] / base[k]:.2f}")
                b = statistics.median(r["cached_before"] for r in rs) / MiB
                a = statistics.median(r["cached_after"] for r in rs) / MiB
                calls = statistics.median(r["dontneed_calls"] for r in rs)
                dn = statistics.median(r["dontneed_seconds"] for r in rs)
                out["results"][f"{variant} {state}"] = row | {"cached_before": b * MiB, "cached_after": a * MiB,
                                                              "dontneed_calls": calls,
                                                              "dontneed_seconds": dn}
                print(f"| {variant}, {state} | {' | '.join(cells)} | {calls:.0f}, {dn:.3f} | "
                      f"{b:.0f} -> {a:.0f} |")
        for state, secs in snap.items():
            out[f"snapshot_seconds {state}"] = statistics.median(secs)
            print(f"residency snapshot of every file, {state}: {statistics.median(secs) * 1000:.2f} ms (median)")
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        return 0
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    sys.exit(main())
