"""The child processes of bench/device/check.py, each a fresh ``python -m bench.device.child SPEC`` handed the
region's memfd (as a vLLM process gets it from pled), with its own CUDA context: a write that faults the GPU
leaves the parent's context unharmed, and two of them show what two processes cost the host.

- ``hold``: map the region (pled.client.mapped_table.Table, populated), register its nvfp4 arrays through pled's
  seam (Mapped|ReadOnly), look rows up through the views (so the GPU reads the pages), print this process's figures
  as one JSON line, wait for a line on stdin, exit. ``memory()`` runs two at once and reads /proc/meminfo around.
- ``store``, ``memcpy``, ``memset``: register the weight array, then write its first 4 KiB through the CUDA view
  with a kernel (``fill_``), by ``cudaMemcpy`` (device to host, to the host pointer), or by ``cudaMemset`` on the
  device pointer. Each prints how it failed (or that CUDA said nothing; a child killed by a signal is said so).
  ``write_fault()`` runs the three and reads the pages before and after.
"""
from __future__ import annotations

import hashlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.device.procfs import meminfo, smaps_of, status_of

ROOT = Path(__file__).resolve().parent.parent
WRITE_BYTES = 4096
WRITES = ("store", "memcpy", "memset")  # each in a child of its own: one that faults takes nothing else with it


# -- the parent's side -------------------------------------------------------------------------------------------

class Child:
    def __init__(self, spec: dict, fd: int, log: Path) -> None:
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "bench.device.child", json.dumps(spec)],
                                         pass_fds=(fd,), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, cwd=ROOT, text=True)

    def line(self, timeout: float) -> dict:
        """The child's JSON line, or why there is none (it died, or said nothing within ``timeout``)."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while sel.select(max(0.0, deadline - time.monotonic())):
                text = self.proc.stdout.readline()
                if not text:  # its end of the pipe closed: it exited, or is exiting
                    try:
                        self.proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        break
                    return {"error": f"{self.ended()} without an answer; its last line on stderr: "
                                     f"{self.last_error()}"}
                if text.startswith("{"):  # its answer; anything else a library printed is passed over
                    return json.loads(text)
        self.proc.kill()
        self.proc.wait()
        return {"error": f"no answer within {timeout:.0f} s; killed"}

    def ended(self) -> str:
        rc = self.proc.returncode
        return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited {rc}"

    def last_error(self) -> str:
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1][:300] if lines else "(nothing on stderr)"

    def finish(self, timeout: float) -> int:
        try:
            self.proc.communicate("go\n", timeout=timeout)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode


def memory(fd: int, spec: dict, work: Path, timeout: float) -> dict:
    """Two processes map and register the same region at once: /proc/meminfo before, with both holding it and
    after; each child's own figures. Shmem (or, on hugetlb, HugePages_Free) moving by the region's size would
    mean a copy (other programs on the host move it too); each mapping's Pss is its share of the pages it maps
    with the other, so the two add up to the region once; RssAnon growing by the table would be a private copy."""
    before = meminfo()
    children = [Child({**spec, "mode": "hold"}, fd, work / f"hold-{i}.log") for i in range(2)]
    try:
        seen = [c.line(timeout) for c in children]
        holding = meminfo()
    finally:
        codes = [c.finish(30) for c in children]
    time.sleep(0.5)
    after = meminfo()

    def delta(a: dict, key: str):
        return holding.get(key, 0) - a.get(key, 0) if key in holding else None

    maps = [c.get("mapping_smaps", {}) for c in seen]
    return {"table_bytes": spec["table_bytes"], "region_bytes": os.fstat(fd).st_size,
            "mapping_rss_each": [m.get("Rss", 0) + m.get("Shared_Hugetlb", 0) + m.get("Private_Hugetlb", 0)
                                 for m in maps],
            "mapping_pss_sum": sum(m.get("Pss", 0) for m in maps),
            "rss_anon_growth_each": [c.get("rss_anon_growth_after_cuda") for c in seen],
            "children": seen, "exit_codes": codes,
            "meminfo_before": before, "meminfo_holding": holding, "meminfo_after": after,
            "shmem_delta_holding": delta(before, "Shmem"),
            "hugepages_free_delta_holding": delta(before, "HugePages_Free"),
            "mem_available_delta_holding": delta(before, "MemAvailable")}


def write_fault(fd: int, spec: dict, work: Path, timeout: float) -> dict:
    """Writes through the registered read-only view (a kernel's store, cudaMemcpy, cudaMemset), each in its own
    child; the first 4 KiB of the weight array read (pread on the memfd) before and after."""
    offset = spec["weight"][0]
    before = hashlib.sha256(os.pread(fd, WRITE_BYTES, offset)).hexdigest()
    out = {}
    for mode in WRITES:
        child = Child({**spec, "mode": mode}, fd, work / f"{mode}.log")
        out[mode] = child.line(timeout)
        out[mode]["exit_code"] = child.finish(30)
        out[mode]["stderr_last_line"] = child.last_error()
    out["bytes_unchanged"] = hashlib.sha256(os.pread(fd, WRITE_BYTES, offset)).hexdigest() == before
    return out


# -- the child's side --------------------------------------------------------------------------------------------

def _table(spec: dict):
    from pled.client.mapped_table import Table

    return Table(spec["fd"], 0, populate=True)


def _hold(spec: dict) -> dict:
    start = status_of()
    from bench import ple_kernels
    from bench.device.cuda import Cuda, Registered

    cuda = Cuda()
    with_cuda = status_of()
    table = _table(spec)
    regs = [Registered(cuda, table.buffer, off, n, f"{name} (child {os.getpid()})")
            for name, (off, n) in (("weight", spec["weight"]), ("weight_scale", spec["scale"]))]
    torch, rows, width = cuda.torch, spec["rows"], spec["width"]
    n = spec["ids"]
    ids = torch.randint(0, rows, (n,), device="cuda")
    out = torch.empty((n, width), dtype=torch.bfloat16, device="cuda")
    g = torch.tensor([spec["global_scale"]], dtype=torch.float32, device="cuda")
    ple_kernels.lookup_nvfp4(regs[0].device(), regs[1].device(), g, ids, out, width, 0, rows)
    cuda.sync()
    holding = status_of()
    return {"pid": os.getpid(), "registered": [r.key for r in regs], "pinned": all(r.pinned for r in regs),
            "register_seconds": sum(r.seconds for r in regs), "looked_up_rows": n,
            "mapping_smaps": smaps_of(table.address), "status_start": start,
            "status_with_cuda": with_cuda, "status_holding": holding,
            "rss_anon_growth_after_cuda": holding.get("RssAnon", 0) - with_cuda.get("RssAnon", 0)}


def _writer(spec: dict):
    from bench.device.cuda import Cuda, Registered

    cuda = Cuda()
    table = _table(spec)
    return cuda, table, Registered(cuda, table.buffer, *spec["weight"], "weight (write test)")


def _store(spec: dict) -> dict:
    cuda, _table_kept, reg = _writer(spec)
    out = {"how": "a kernel's store (torch fill_) through the CUDA view"}
    try:
        reg.device()[:WRITE_BYTES].fill_(0xAB)
        cuda.sync()
    except Exception as err:  # noqa: BLE001 - what failed, and how, is the figure
        return {**out, "failed": True, "error_type": type(err).__name__,
                "error": str(err).strip().splitlines()[0][:300]}
    return {**out, "failed": False, "error": "no CUDA error: bytes_unchanged says whether the pages took it"}


def _memcpy(spec: dict) -> dict:
    cuda, _table_kept, reg = _writer(spec)
    src = cuda.torch.full((WRITE_BYTES,), 0xAB, dtype=cuda.torch.uint8, device="cuda")
    code = cuda.lib.cudaMemcpy(reg.host, src.data_ptr(), WRITE_BYTES, 2)  # cudaMemcpyDeviceToHost
    sync = cuda.lib.cudaDeviceSynchronize()
    return {"how": "cudaMemcpy device-to-host into the registered pages", "failed": bool(code or sync),
            "code": code, "error": cuda.rt.error(code) if code else "", "synchronize_code": sync}


def _memset(spec: dict) -> dict:
    cuda, _table_kept, reg = _writer(spec)
    code = cuda.lib.cudaMemset(reg.device().data_ptr(), 0xAB, WRITE_BYTES)
    sync = cuda.lib.cudaDeviceSynchronize()
    return {"how": "cudaMemset on the registered pages' device pointer", "failed": bool(code or sync),
            "code": code, "error": cuda.rt.error(code) if code else "", "synchronize_code": sync,
            "synchronize_error": cuda.rt.error(sync) if sync else ""}


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        result = {"hold": _hold, "store": _store, "memcpy": _memcpy, "memset": _memset}[spec["mode"]](spec)
    except Exception as err:  # noqa: BLE001 - said in one line to the parent, which reports it
        result = {"error": f"{type(err).__name__}: {str(err).strip()[:300]}"}
    print(json.dumps(result), flush=True)
    if spec["mode"] == "hold":
        sys.stdin.readline()  # hold the registration until the parent has read /proc/meminfo
    return 0


if __name__ == "__main__":
    sys.exit(main())
