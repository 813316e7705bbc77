"""Section 10: vLLM 0.33's own PLE path (Qwen4ExpPLEPinnedHostEmbedding) on a table of at least 2 GiB, built by gloo
worlds of 1, 2 and 3 vLLM processes, three ways side by side in one run:

- pled: each rank's table a view of pled's sealed region (registered, pinned), the checkpoint's shards served from
  the same pages, the load a comparison;
- upstream, filled from pled: vLLM's own private pinned copy per rank (pled's PLED_FALLBACK=disk path, taken because
  registration is refused), its rows copied from pled's pages (no disk read);
- upstream, from disk: vLLM without pled, the checkpoint's page cache dropped first (a restart after a checkpoint
  streamed in), its rows read through safetensors and copied.

Per world and way: the time pled's tables take to attach in a rank (mapped and pre-faulted, before vLLM builds its
tables; the pled and filled-from-pled ways), the time from the first table's construction to the last one loaded
(the slowest rank),
the bytes the ranks made the kernel read from storage (/proc/self/io read_bytes: safetensors maps the files, so
read(2)'s count would miss its reads), the private memory the tables took (RssAnon growth,
after glibc returned what was freed, summed over ranks) against pled's region counted once (Shmem). The ranks are
tests/vllm_env/ple_rank.py with vLLM 0.33's real classes; as there, only the CUDA calls are faked (no GPU here:
registration, is_pinned, the UVA view; upstream's pin_memory is dropped, and its tensor taken as pinned).

    python -m bench.ple033 [--size-gib 2] [--repeats 2]   # this section alone, into docs/ple033.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import report
from pled.generator import make_checkpoint

GiB = 1024**3
ROOT = Path(__file__).resolve().parent.parent
WAYS = ("pled", "upstream, filled from pled", "upstream, from disk")
LAYERS = [0, 1]
ROW_BYTES = 36  # nvfp4 at width 64: 32 bytes of codes, 4 of block scales


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def text_config(size_gib: float) -> dict:
    """A Qwen4ExpTextConfig whose two PLE layers (nvfp4, width 64) hold about ``size_gib`` GiB together."""
    base = int(size_gib * GiB / ROW_BYTES / len(LAYERS) / 4)  # 4 n-gram heads of about ``base`` rows each
    return {"ngram_size": 3, "heads_per_ngram": 2, "ple_embed_dim": 256, "ngram_vocab_size_base": base,
            "make_ngram_vocab_size_divisible_by": 6, "split_ngram_parts": 512, "eos_token_id": 1, "vocab_size": 1000}


def _shmem() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("Shmem:"))


def bench(work: Path, start_pled, repeats: int = 2, size_gib: float = 2.0) -> dict:
    """``start_pled(name, tables)`` -> a running pled (tests.harness.Daemon) serving ``tables``."""
    from tests.harness import drop_page_cache
    from tests.vllm_env.ple_world import run_world, sizes

    text = text_config(size_gib)
    rows = sizes(text, LAYERS)
    ck = work / "qwen4-nvfp4"
    _log(f"making an nvfp4 checkpoint of {sum(rows.values()) * ROW_BYTES / GiB:.2f} GiB: rows {rows}, 512 shards")
    files = make_checkpoint(str(ck), "nvfp4", rows, width=64, parts=512, files=4)
    before = _shmem()
    pled = start_pled("ple033", {"qwen4": {"checkpoint": ck}})
    pled.wait_ready(timeout=900)
    region_shmem = _shmem() - before
    out: dict = {"rows": {str(k): v for k, v in rows.items()}, "table_bytes": sum(rows.values()) * ROW_BYTES,
                 "region_shmem_bytes": region_shmem, "worlds": {}}
    try:
        for world in (1, 2, 3):
            per_way: dict = {}
            for way in WAYS:
                runs = []
                for _ in range(repeats):
                    case = {"name": "t", "dtype": "nvfp4", "checkpoint": str(ck), "layers": LAYERS, "lean": True}
                    if way != "upstream, from disk":
                        case["env"] = {"PLED_SOCKET": pled.socket}
                    if way == "upstream, filled from pled":
                        case["refuse"] = True
                        case["env"]["PLED_FALLBACK"] = "disk"
                    drop_page_cache(files)
                    reports = run_world(world, text, [case])
                    layers = [r["cases"]["t"]["layers"][str(layer)] for r in reports for layer in LAYERS]
                    errors = [rec["error"] for rec in layers if "error" in rec]
                    if errors:
                        raise RuntimeError(f"world {world}, {way}: {errors[0]}")
                    runs.append({
                        "attach_seconds": max(r["cases"]["t"].get("warm_seconds", 0.0) for r in reports),
                        "seconds": max(sum(r["cases"]["t"]["layers"][str(layer)]["seconds"] for layer in LAYERS)
                                       for r in reports),
                        "read_bytes": sum(rec["read_bytes"] for rec in layers),
                        "private_bytes": sum(rec["rss_anon_growth"] for rec in layers),
                        "views": all(all("expected" in p and p["ptr"] == p["expected"] for p in rec["params"].values())
                                     for rec in layers)})
                per_way[way] = {k: _summary([r[k] for r in runs])
                                for k in ("attach_seconds", "seconds", "read_bytes", "private_bytes")}
                per_way[way]["views"] = all(r["views"] for r in runs)
                _log(f"world {world}, {way}: {per_way[way]['seconds']['median']:.2f} s, "
                     f"{per_way[way]['private_bytes']['median'] / GiB:.2f} GiB private")
            out["worlds"][str(world)] = per_way
    finally:
        pled.stop(timeout=60)
    return out


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


@report.section
def ple033_section(res: dict) -> list[str] | None:
    r = res.get("ple033")
    if not r:
        return None
    lines = ["## 10. vLLM 0.33's own PLE path: ranks that view pled's pages, against upstream's private copies", "",
             f"An nvfp4 checkpoint, two PLE layers of {r['rows']['0']:,} and {r['rows']['1']:,} rows (width 64, 512 "
             f"shards each): {r['table_bytes'] / GiB:.2f} GiB of PLE tables; pled's region adds "
             f"{r['region_shmem_bytes'] / GiB:.2f} GiB to Shmem, once for every process. Each world is vLLM 0.33's "
             "real classes in gloo processes, only the CUDA calls faked (no GPU here). Medians, [min, max].", "",
             "| ranks | way | pled's tables attached (slowest rank) | construction to loaded (slowest rank) | read "
             "from storage, all ranks | private memory for the table, all ranks | views of pled's region |",
             "|---|---|---|---|---|---|---|"]
    for world, ways in r["worlds"].items():
        for way, f in ways.items():
            attach = report.fmt(f["attach_seconds"], " s") if f["attach_seconds"]["max"] else "-"
            lines.append(f"| {world} | {way} | {attach} | {report.fmt(f['seconds'], ' s')} | "
                         f"{report.fmt(f['read_bytes'], ' GiB', 1 / GiB)} | "
                         f"{report.fmt(f['private_bytes'], ' GiB', 1 / GiB)} | {'yes' if f['views'] else 'no'} |")
    lines += ["", "Host memory for the table: pled's region once (the Shmem figure above) plus each rank's private "
              "memory; upstream's: each rank's private pinned copy of its rows, for every world and every restart.",
              ""]
    return lines


@report.verdict
def ple033_verdicts(res: dict) -> list[tuple[bool, str]] | None:
    r = res.get("ple033")
    if not r:
        return None
    out = []
    for world, ways in r["worlds"].items():
        mine, theirs = ways["pled"], ways["upstream, from disk"]
        out.append((mine["views"] and mine["private_bytes"]["max"] < 0.05 * r["table_bytes"],
                    f"vLLM 0.33, {world} rank(s): every rank's table a view of pled's region, private memory "
                    f"{mine['private_bytes']['median'] / GiB:.3f} GiB against upstream's "
                    f"{theirs['private_bytes']['median'] / GiB:.2f} GiB"))
    return out


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ple033", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=str(ROOT / "docs" / "ple033.json"))
    a = p.parse_args()
    from tests.harness import start

    with tempfile.TemporaryDirectory(prefix="pled-ple033-", dir="/var/tmp") as work:
        res = {"ple033": bench(Path(work), lambda name, tables: start(Path(work), tables, name=name, wait=None),
                               a.repeats, a.size_gib)}
    Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    print("\n".join(ple033_section(res) or []))
    print("\n".join(f"{'met' if ok else 'NOT MET'}: {text}" for ok, text in ple033_verdicts(res) or []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
