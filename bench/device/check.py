"""The device check (issue 31, item 4): pled's sealed region registered with a GPU read-only and looked up by
vLLM 0.33's own kernels, measured on a machine with one NVIDIA GPU. ``make device-check`` runs it; without CUDA
it says so in one line and in its JSON, and exits 0.

    python -m bench.device.check [--out DIR] [--table-gib 1] [--kinds hugetlb,thp,4k] ...  # DIR/device_check.json
    python -m bench.device.check --plan   # the device tool's run call, and the bytes that would travel

On the device machine (Python 3.12, torch, Triton, numpy, xxhash, no pydantic): ``make device-wheels`` here first
(pydantic's wheels into .whl/, git-ignored), then the device tool's ``run`` with carry [".whl"], timeout_s 360 and
the command ``COMMAND`` below (``--plan`` prints all three). Nothing of vLLM travels: its two lookup kernels are
carried in bench/ple_kernels.py. The default run takes about 2-3 minutes there (budget: --budget-s 270).

What it measures, each figure from the run or the reason it could not be had:
- per page kind (``4k``, ``thp``, ``hugetlb``; bench/device/pages.py stages one synthetic nvfp4 checkpoint of
  --table-gib on each, putting back shmem_enabled and the 2 MiB pool): what staging got; the client's mapping
  (pled.client.mapped_table.Table, populated) and its smaps; cudaHostRegister(Mapped|ReadOnly) of the whole table
  through pled's seam (pled.client.gpu), --register-repeats times: seconds, GiB/s, is_pinned, and the
  unregistering; one cudaHostRegister(Mapped) without ReadOnly (how it fails on a PROT_READ mapping); then rank
  --rank of --world's rows, registered as the plugin registers them (a page-rounded, unaligned slice), looked up by
  the carried nvfp4 kernel through the CUDA view (cudaHostGetDevicePointer) into float32 and bf16 and compared with
  pled's numpy reference (bench/device/lookup.py); rows/s through pled's view against upstream's private pinned
  copy (torch.empty(pin_memory=True) + copy_, the same rows) and, as the ceiling, the rows in the GPU's memory,
  CUDA events, median and spread of --repeats;
- per GPU route (bench/device/routes.py: read-only registration, pageable access on ATS or HMM, writable
  registration, each the device offers): the view's seconds and GiB/s, is_pinned, rows/s through the route's view
  against upstream's pinned copy, the first pass against the warm ones, host memory counted once;
- on the first of thp, 4k that stages: two processes registering the same table (meminfo's Shmem and each
  process's smaps and status, bench/device/child.py);
- Engram (bench/device/engram.py, issue 46 item 5): a synthetic DeepSeek V4.1 Engram checkpoint whose rank slice
  (--engram-rank of --engram-world head shards) holds --engram-gib, staged by pled per GPU route and taken through
  ``gpu.device_view``; vLLM 0.33's ``_engram_lookup_kernel`` (carried in bench/engram_kernels.py) into bf16 and
  packed bytes against the CPU reference; rows/s against upstream's private pinned copy, cold and warm;
- fp8 (a --fp8-mib checkpoint, on thp else 4k): the carried raw-rows kernel through pled's view equal to the rows'
  bytes, and its rows/s against upstream's pinned copy; last, GPU writes through the read-only view, each in a
  child (a kernel's store, cudaMemcpy, cudaMemset): how each failed, and the bytes read back after.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
MiB = 1 << 20
WHEELS = ".whl"
COMMAND = ("set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
           "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 timeout -s INT "
           "320 python3 -m bench.device.check 2>&1 | tee \"$OUT/device_check.log\"")
RUN = {"command": COMMAND, "carry": [WHEELS], "timeout_s": 360}
TRAVEL_LIMIT = 64 * MiB
SECTIONS = ("machine", "checkpoints", "pages", "routes", "engram", "fp8")  # in the order they run, where CUDA is


def no_cuda() -> str:
    """Why CUDA cannot be used here ("" where it can)."""
    try:
        import torch
    except ImportError as err:
        return f"torch cannot be imported ({err})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return ""


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


class Run:
    """The figures so far, written to ``path`` after every section (a run cut short keeps what it measured)."""

    def __init__(self, path: Path, budget: float) -> None:
        self.path, self.budget, self.start = path, budget, time.monotonic()
        self.result: dict = {"check": "pled device check (issue 31, item 4)", "argv": sys.argv[1:],
                             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "errors": []}

    def write(self) -> None:
        self.result["seconds"] = round(time.monotonic() - self.start, 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.path)

    def section(self, where: dict, key: str, measure, *args) -> dict:
        """``where[key]`` = ``measure(*args)``, or why not: the host cannot (not_measured), a failure (error, one
        line), or the budget spent (skipped)."""
        from bench.device.pages import NotMeasured

        if time.monotonic() - self.start > self.budget:
            where[key] = {"skipped": f"the run's budget of {self.budget:.0f} s was spent"}
        else:
            try:
                where[key] = measure(*args)
            except NotMeasured as err:
                where[key] = {"not_measured": str(err)}
            except Exception as err:  # noqa: BLE001 - every section reports its own failure and the run goes on
                where[key] = {"error": one_line(err)}
                self.result["errors"].append(f"{key}: {one_line(err)}")
        self.write()
        return where[key]


def machine(cuda) -> dict:
    import numpy
    import torch

    from bench.device import pages as device_pages
    from bench.device.procfs import meminfo

    try:
        import triton
        triton_version = triton.__version__
    except ImportError as err:
        triton_version = f"not importable: {err}"
    return {**cuda.versions(), "torch": torch.__version__, "triton": triton_version, "numpy": numpy.__version__,
            "python": platform.python_version(), "kernel": platform.release(), "cpus": os.cpu_count(),
            "host_settings": device_pages.host_settings(), "meminfo": meminfo()}


def measure(args: argparse.Namespace, run: Run) -> None:
    from bench.device import pages as device_pages
    from bench.device.cuda import Cuda
    from bench.device.engram import engram
    from bench.device.routes import routes
    from bench.device.sections import Context, fp8, page_kind

    cuda = Cuda()
    run.section(run.result, "machine", machine, cuda)
    host_before = device_pages.host_settings()
    with tempfile.TemporaryDirectory(prefix="pled-device-check-", dir=args.work) as work:
        ctx = Context(args, cuda, Path(work), run.result)
        try:
            run.section(run.result, "checkpoints", ctx.make_checkpoints)
            if "error" not in run.result["checkpoints"]:
                for kind in args.kinds:
                    run.section(run.result.setdefault("pages", {}), kind, page_kind, ctx, kind)
                run.section(run.result, "routes", routes, ctx)  # each GPU route pled.client.gpu offers here
            run.section(run.result, "engram", engram, ctx)  # its own checkpoint: vLLM's Engram kernel per route
            if "error" not in run.result["checkpoints"]:
                run.section(run.result, "fp8", fp8, ctx)
        finally:
            ctx.close()
            run.result["cuda_views_made_by"] = cuda.views
            run.result["host_settings_after"] = device_pages.host_settings()
            run.result["host_restored"] = run.result["host_settings_after"] == host_before


def summary(result: dict) -> list[str]:
    """A few lines of what the JSON holds, for the run's log."""
    lines = []
    for route, r in result.get("engram", {}).items():
        if route == "checkpoint" or not isinstance(r, dict):
            lines.append(f"engram, {route}: {json.dumps(r)[:300]}")
        else:
            look, rates = r.get("lookup", {}), r.get("rows_per_s", {})
            lines.append(f"engram, {route}: " + (json.dumps(r)[:300] if "lookup" not in r else
                         f"bf16 equal {look.get('bfloat16', {}).get('equal')}, packed equal "
                         f"{look.get('packed', {}).get('equal')}; rows/s pled "
                         f"{rates.get('pled', {}).get('median', 0):.3g} vs upstream "
                         f"{rates.get('upstream', {}).get('median', 0):.3g}"))
    for kind, page in result.get("pages", {}).items():
        if "register" not in page:
            lines.append(f"{kind}: {json.dumps(page)[:300]}")
            continue
        reg, rates, look = page["register"], page.get("rows_per_s", {}), page.get("lookup_nvfp4", {})
        lines.append(f"{kind}: registered {reg['bytes'] / GiB:.2f} GiB Mapped|ReadOnly at {reg['gib_per_s_median']:.1f}"
                     f" GiB/s (pinned {reg['is_pinned']}); nvfp4 lookup equal to pled's reference: float32 "
                     f"{look.get('float32', {}).get('equal')}, bf16 {look.get('bfloat16', {}).get('equal')}; rows/s "
                     f"pled {rates.get('pled', {}).get('median', 0):.3g} vs upstream "
                     f"{rates.get('upstream', {}).get('median', 0):.3g} (GPU memory "
                     f"{rates.get('gpu_memory', {}).get('median', 0):.3g})")
        if "memory" in page:
            m = page["memory"]
            lines.append(f"{kind}: two processes registering the same {m.get('region_bytes')}-byte region: Rss of "
                         f"each mapping {m.get('mapping_rss_each')}, Pss of both {m.get('mapping_pss_sum')}, RssAnon "
                         f"growth {m.get('rss_anon_growth_each')}, Shmem moved by {m.get('shmem_delta_holding')}; "
                         f"errors {[c['error'] for c in m.get('children', []) if 'error' in c]}")
    if "fp8" in result:
        f = result["fp8"]
        lines.append(f"fp8: {json.dumps(f.get('lookup', f))[:300]}")
        if "write_fault" in f:
            w = f["write_fault"]
            said = "; ".join(f"{mode}: {w.get(mode, {}).get('error') or w.get(mode, {}).get('failed')}"
                             for mode in ("store", "memcpy", "memset"))
            lines.append(f"GPU writes through the read-only view: {said}; bytes unchanged {w.get('bytes_unchanged')}")
    lines += [f"error: {e}" for e in result.get("errors", [])]
    lines.append(f"host settings restored: {result.get('host_restored')}; {result.get('seconds')} s")
    return lines


def travel(root: Path = ROOT) -> dict:
    """What the device tool would send from ``root``: tracked files, untracked files git does not ignore, and the
    carried wheels, in bytes, against the 64 MiB limit."""
    import subprocess

    def listed(*extra: str) -> int:
        names = subprocess.run(["git", "ls-files", "-z", *extra], cwd=root, capture_output=True, check=True)
        return sum(os.lstat(root / n).st_size for n in names.stdout.decode().split("\0")
                   if n and os.path.lexists(root / n))

    wheels = sorted(p for p in (root / WHEELS).glob("*") if p.is_file())
    out = {"tracked": listed(), "untracked_not_ignored": listed("-o", "--exclude-standard"),
           "carried": {WHEELS: sum(p.stat().st_size for p in wheels)}, "wheels": [p.name for p in wheels]}
    out["total"] = out["tracked"] + out["untracked_not_ignored"] + sum(out["carried"].values())
    out["limit"] = TRAVEL_LIMIT
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.device.check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "out" / "device-check"),
                   help="folder for device_check.json (default: $OUT, else bench/out/device-check)")
    p.add_argument("--work", default=None, help="folder for the synthetic checkpoints (default: the temp folder)")
    p.add_argument("--table-gib", type=float, default=1.0, help="the nvfp4 table's size (default 1)")
    p.add_argument("--engram-gib", type=float, default=1.0, help="the Engram rank slice's size (default 1)")
    p.add_argument("--engram-world", type=int, default=2, help="Engram shards for the slice (default 2)")
    p.add_argument("--engram-rank", type=int, default=1, help="the Engram shard looked up (default 1)")
    p.add_argument("--fp8-mib", type=float, default=256, help="the fp8 table's size (default 256)")
    p.add_argument("--width", type=int, default=160, help="elements a row, a multiple of 16 (default 160)")
    p.add_argument("--world", type=int, default=3, help="the embedding group's size for the rank slice (default 3)")
    p.add_argument("--rank", type=int, default=1, help="the rank whose rows are registered and looked up (default 1)")
    p.add_argument("--kinds", default="hugetlb,thp,4k", type=lambda s: [k for k in s.split(",") if k],
                   help="page kinds, in order (default hugetlb,thp,4k: the pool raised first)")
    p.add_argument("--register-repeats", type=int, default=3, help="registrations of the whole table (default 3)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds of lookups per side (default 7)")
    p.add_argument("--batch", type=int, default=131072, help="ids a lookup launch (default 131072)")
    p.add_argument("--launches", type=int, default=20, help="launches a timed round (default 20)")
    p.add_argument("--check-ids", type=int, default=65536, help="ids compared with the reference (default 65536)")
    p.add_argument("--no-write-fault", dest="write_fault", action="store_false",
                   help="skip the GPU writes through the read-only view (run last: a fault could spoil what follows)")
    p.add_argument("--child-timeout", type=float, default=120, help="seconds a child may take (default 120)")
    p.add_argument("--budget-s", type=float, default=270, help="no section starts after this (default 270)")
    p.add_argument("--plan", action="store_true", help="print the device run call and what would travel; no check")
    args = p.parse_args(argv)
    bad = [k for k in args.kinds if k not in ("4k", "thp", "hugetlb")]
    if bad or args.width % 16 or not 0 <= args.rank < args.world:
        p.error(f"unknown page kinds {bad}" if bad else "--width must be a multiple of 16 and 0 <= --rank < --world")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.plan:
        print(json.dumps({"run": RUN, "command_chars": len(COMMAND), "travel": travel()}, indent=1))
        return 0
    run = Run(Path(args.out) / "device_check.json", args.budget_s)
    why = no_cuda()
    run.result["cuda"] = not why
    run.result["sections"] = list(SECTIONS)
    if why:
        run.result["reason"] = f"no CUDA: {why}; nothing measured"
        run.write()
        print(f"device check: {run.result['reason']} (wrote {run.path})")
        return 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` and SIGTERM unwind: host settings restored
    try:
        measure(args, run)
    except KeyboardInterrupt:
        run.result["errors"].append("interrupted (SIGINT or SIGTERM): the figures so far")
    except Exception as err:  # noqa: BLE001 - set-up failed (an import, CUDA's context): said in one line
        run.result["errors"].append(f"the check could not run: {one_line(err)}")
        run.result["failed"] = True
    finally:
        run.write()
    try:
        for line in summary(run.result):
            print(f"device check: {line}")
    except (KeyError, TypeError, ValueError) as err:
        print(f"device check: no summary ({one_line(err)}); the figures are in the JSON")
    print(f"device check: figures in {run.path}")
    return 1 if run.result.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
