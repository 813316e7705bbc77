"""Section 11: vLLM 0.33's DeepSeek V4.1 Engram tables (ParallelEngramEmbedding) on a scaled Engram checkpoint (the
real head structure: two layers of four prime-sized hash heads, 256 F8_E4M3 values and 8 F8_E8M0 scales a row, fewer
rows), built by gloo worlds of DP x TP = 1x1, 2x1 and 2x2 vLLM processes, three ways side by side in one run:

- pled: each rank's weight and weight_scale_inv a view of pled's sealed region, sharing answered by pled, the
  checkpoint's tensors served from the same pages, the load a comparison;
- upstream, shared refill: vLLM without pled, sharing on (its default with DP > 1): one writable /dev/shm file per
  layer and TP rank (DPSharedEngramStorage), filled from the checkpoint by Engram-DP rank 0; at DP = 1 there is no
  Engram DP group and vLLM makes private copies, as below;
- upstream, private pinned: vLLM without pled, sharing off: a private pinned copy per rank.

Per world and way: the time from the first layer's construction to the last loaded (the slowest rank), the table
bytes written (pled: none, its pages are mapped read-only so a write would fault; upstream: what its loaders copy:
each rank's slice, or each TP slice once for the shared file), host memory for the table (pled's region once in
Shmem; upstream's /dev/shm files in Shmem, or each rank's RssAnon growth for its private copies), and the ratio of
upstream's time to pled's. The ranks are tests/vllm_env/engram_rank.py with vLLM 0.33's real classes; as there,
only the CUDA calls are faked (no GPU here: registration, is_pinned, the UVA view, the device index; upstream's
pin_memory is dropped, and its tensor taken as pinned). The checkpoint's page cache is warm for every way (a restart
right after the previous start read it): what is compared is the fill, not the disk. pled's tables are attached
(mapped and pre-faulted, once a process, before vLLM builds its layers) outside the timed span, and shown beside it.

    python -m bench.engram033 [--size-gib 4] [--repeats 1]   # this section alone, into docs/engram033.json
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
from pled.generator import make_engram_checkpoint

GiB = 1024**3
ROOT = Path(__file__).resolve().parent.parent
WAYS = ("pled", "upstream, shared refill", "upstream, private pinned")
WORLDS = ((1, 1), (2, 1), (2, 2))
ROW_BYTES = 264
FULL_BYTES = 202_758_032_400  # DeepSeek V4.1's two Engram tables, one copy (188.83 GiB)


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def config(size_gib: float) -> dict:
    """Two Engram layers of 4 hash heads (max n-gram 3 x 2 heads, as V4.1's 24 are split alike) holding about
    ``size_gib`` GiB together."""
    vocab = int(size_gib * GiB / ROW_BYTES / 2 / 4)
    return {"engram_layer_ids": [1, 14], "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 256,
            "engram_vocab_size": vocab}


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _measure(reports: list[dict], way: str) -> dict:
    cases = [r["cases"]["t"] for r in reports]
    errors = [c["error"] for c in cases if "error" in c]
    if errors:
        raise RuntimeError(f"{way}: {errors[0]}")
    written, shmem, private = 0, 0, 0
    tp_seen: set = set()
    for r, c in zip(reports, cases, strict=True):
        for layer, rec in c["layers"].items():
            nbytes = sum(p["nbytes"] for p in rec["params"].values())
            if way == "pled":
                continue  # read-only views: nothing is written, nothing allocated for the table
            if rec["shared_memory"]:
                if (r["tp_rank"], layer) not in tp_seen:  # one file a layer and TP slice, filled once
                    tp_seen.add((r["tp_rank"], layer))
                    written += nbytes
                    shmem += nbytes
            else:
                written += nbytes
        private += c["rss_anon_growth"]
    return {"seconds": max(c["seconds"] for c in cases),
            "attach_seconds": max(c.get("attach_seconds", 0.0) for c in cases), "written_bytes": written,
            "shmem_bytes": shmem,
            "private_bytes": private, "views": way == "pled" and all(
                p.get("expected") == p["ptr"] for c in cases for rec in c["layers"].values()
                for p in rec["params"].values())}


def bench(work: Path, start_pled, repeats: int = 1, size_gib: float = 2.0) -> dict:
    """``start_pled(name, tables)`` -> a running pled (tests.harness.Daemon) serving ``tables``."""
    from tests.vllm_env.engram_world import run_world

    ck = work / "deepseek-v41-engram"
    _log(f"making a DeepSeek V4.1-style Engram checkpoint of about {size_gib} GiB in {ck}")
    _, c = make_engram_checkpoint(str(ck), config(size_gib), files=4)
    table = sum(c["engram_num_embeddings"]) * ROW_BYTES
    before = _shmem()
    pled = start_pled("engram033", {"ds": {"checkpoint": ck}})
    pled.wait_ready(timeout=900)
    out: dict = {"rows": c["engram_num_embeddings"], "table_bytes": table, "region_shmem_bytes": _shmem() - before,
                 "worlds": {}}
    try:
        for dp, tp in WORLDS:
            per_way: dict = {}
            for way in WAYS:
                runs = []
                for _ in range(repeats):
                    case = {"name": "t", "uva": False, "share": way != "upstream, private pinned"}
                    if way == "pled":
                        case["env"] = {"PLED_SOCKET": pled.socket}
                    runs.append(_measure(run_world(dp, tp, str(ck), [case]), way))
                per_way[way] = {k: _summary([r[k] for r in runs])
                                for k in ("seconds", "attach_seconds", "written_bytes", "shmem_bytes",
                                          "private_bytes")}
                per_way[way]["views"] = all(r["views"] for r in runs)
                _log(f"DP x TP {dp}x{tp}, {way}: {per_way[way]['seconds']['median']:.3f} s, "
                     f"{per_way[way]['written_bytes']['median'] / GiB:.2f} GiB written")
            out["worlds"][f"{dp}x{tp}"] = per_way
    finally:
        pled.stop(timeout=60)
    return out


def _shmem() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("Shmem:"))


@report.section
def engram033_section(res: dict) -> list[str] | None:
    r = res.get("engram033")
    if not r:
        return None
    lines = ["## 11. vLLM 0.33's DeepSeek V4.1 Engram tables: pled's views against upstream's shared refill and "
             "private copies", "",
             f"A DeepSeek V4.1-style checkpoint, two Engram layers of {r['rows'][0]:,} and {r['rows'][1]:,} rows (4 "
             f"prime-sized hash heads each; 256 F8_E4M3 values and 8 F8_E8M0 scales a row): "
             f"{r['table_bytes'] / GiB:.2f} GiB of tables; pled's region adds {r['region_shmem_bytes'] / GiB:.2f} "
             "GiB to Shmem, once for every process and every restart. Each world is vLLM 0.33's real classes in gloo "
             "processes, only the CUDA calls faked (no GPU here); the checkpoint's page cache warm for every way. "
             "Medians, (min-max)." + (f" Measured by `{r['command']}`." if r.get("command") else ""), "",
             "| DP x TP | way | pled's tables attached (slowest rank) | construction to loaded (slowest rank) | table "
             "bytes written | /dev/shm for the table | private memory, all ranks | x pled's time |",
             "|---|---|---|---|---|---|---|---|"]
    for world, ways in r["worlds"].items():
        mine = ways["pled"]["seconds"]["median"]
        for way, f in ways.items():
            ratio = f["seconds"]["median"] / mine if mine else float("inf")
            attach = report.fmt(f["attach_seconds"], " s", digits=3) if f["attach_seconds"]["max"] else "-"
            lines.append(f"| {world} | {way} | {attach} | {report.fmt(f['seconds'], ' s', digits=3)} | "
                         f"{report.fmt(f['written_bytes'], ' GiB', 1 / GiB)} | "
                         f"{report.fmt(f['shmem_bytes'], ' GiB', 1 / GiB)} | "
                         f"{report.fmt(f['private_bytes'], ' GiB', 1 / GiB)} | {ratio:.1f} |")
    if r.get("note"):
        lines += ["", r["note"]]
    lines += ["", *extrapolation(r), ""]
    return lines


def extrapolation(r: dict) -> list[str]:
    """188.83 GiB, at each path's measured rate (GiB of table a second), with what that assumes."""
    out = ["Extrapolated to DeepSeek V4.1's 188.83 GiB (both tables, one copy), at each way's measured rate at DP x TP "
           "2x1, assuming the time grows with the bytes filled (upstream) or the slices handed out (pled: per-rank "
           "work is per table and per page registered, not per byte; on a GPU host add the registration cost the "
           "device check measures), and a host with the memory for it:", ""]
    ways = r["worlds"].get("2x1") or next(iter(r["worlds"].values()))
    scale = FULL_BYTES / r["table_bytes"]
    for way, f in ways.items():
        seconds = f["seconds"]["median"] * scale
        written = f["written_bytes"]["median"] * scale
        out.append(f"- {way}: {seconds:.1f} s to loaded, {written / GiB:.1f} GiB written per start")
    return out


@report.verdict
def engram033_verdicts(res: dict) -> list[tuple[bool, str]] | None:
    r = res.get("engram033")
    if not r:
        return None
    out = []
    for world, ways in r["worlds"].items():
        mine, shared = ways["pled"], ways["upstream, shared refill"]
        ratio = shared["seconds"]["median"] / mine["seconds"]["median"]
        whole = shared["seconds"]["median"] / (mine["seconds"]["median"] + mine["attach_seconds"]["median"])
        out.append((mine["views"] and mine["written_bytes"]["max"] == 0 and (world.startswith("1x") or whole >= 20),
                    f"Engram, DP x TP {world}: pled writes 0 bytes of the table; to loaded {ratio:.1f}x faster than "
                    f"upstream's shared refill, {whole:.1f}x with pled's attach (mapping and pre-faulting the region "
                    "once a process) counted (goal: 20x where DP > 1)"))
    return out


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engram033", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", default=str(ROOT / "docs" / "engram033.json"))
    a = p.parse_args()
    from tests.harness import start

    with tempfile.TemporaryDirectory(prefix="pled-engram033-", dir="/var/tmp") as work:
        res = {"engram033": bench(Path(work), lambda name, tables: start(Path(work), tables, name=name, wait=None),
                                  a.repeats, a.size_gib)}
    res["engram033"]["command"] = "python -m bench.engram033 " + " ".join(sys.argv[1:])
    Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    print("\n".join(engram033_section(res) or []))
    print("\n".join(f"{'met' if ok else 'NOT MET'}: {text}" for ok, text in engram033_verdicts(res) or []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
