"""The tables bench/device/check.py registers: a synthetic model checkpoint (pled.generator.make_checkpoint) staged
by pled (pled.daemon.regions.staging.stage, as in pled.demo) on 4 KiB pages, on transparent huge pages and on reserved
(hugetlb) 2 MiB pages, with every host setting it changes put back; and what the kernel says of No CUDA here: this
module runs on any Linux host.

- ``4k``: ``huge_pages = "off"`` (staged by sendfile, 4 KiB shmem pages).
- ``thp``: shmem_enabled set to ``advise`` for the section (bench/hugepages.py's ``shmem_enabled``, restored after)
  and ``huge_pages = "auto"``: staging maps the memfd with MADV_HUGEPAGE and faults its pages in, as pled does.
- ``hugetlb``: the 2 MiB pool raised by exactly the pages the region needs (bench/hugepages.py's ``reserve``,
  restored after), staged on a hugetlb memfd (a PagePlan of 2 MiB pages, no NUMA policy).
"""
from __future__ import annotations

import contextlib
import os
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.common import NotMeasured, host_settings, reserve, shmem_enabled
from pled.daemon.memory.pageplan import NumaPolicy, PagePlan
from pled.daemon.regions import staging
from pled.daemon.sources.checkpoint import open_checkpoint
from pled.daemon.sources.safetensors_file import read_header
from pled.generator import make_checkpoint
from pled.shared import region
from pled.shared.hugepages import PMD_SIZE, PolicyUnreadable, read_policy

KINDS = ("hugetlb", "4k", "thp")  # hugetlb first: its pool is raised before the other tables churn memory
ROWS_MULTIPLE = 96  # rows a multiple of every world size up to 4, 6 and 8, as vLLM's padding makes them
NO_NUMA = NumaPolicy(0, (), (), refused="the device check applies no NUMA policy")

__all__ = ["KINDS", "NotMeasured", "Checkpoint", "make", "staged", "host_settings"]


@dataclass(frozen=True)
class Checkpoint:
    path: str
    dtype: str  # "nvfp4" or "fp8"
    rows: int
    width: int  # elements a row
    row_bytes: int  # bytes a row, over the arrays vLLM pins (nvfp4: weight and weight_scale)
    global_scale: float  # nvfp4's weight_scale_2, fp8's weight_scale
    seconds: float  # to write it

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


def row_bytes(dtype: str, width: int) -> int:
    return width // 2 + width // 16 if dtype == "nvfp4" else width


def make(work: str, dtype: str, nbytes: int, width: int) -> Checkpoint:
    """A one-layer checkpoint of about ``nbytes`` of PLE table (16 shard tensors over 2 files), under ``work``."""
    rows = max(ROWS_MULTIPLE, nbytes // row_bytes(dtype, width) // ROWS_MULTIPLE * ROWS_MULTIPLE)
    path = os.path.join(work, f"checkpoint-{dtype}")
    start = time.perf_counter()
    make_checkpoint(path, dtype, {0: rows}, width=width, parts=16, files=2)
    seconds = time.perf_counter() - start
    return Checkpoint(path, dtype, rows, width, row_bytes(dtype, width), global_scale(path), seconds)


def global_scale(path: str) -> float:
    """The checkpoint's per-tensor float32 scale (``…ngram_embedding.weight_scale_2`` for nvfp4, ``.weight_scale``
    for fp8): vLLM keeps it on the GPU, not in pled's region."""
    for name in sorted(Path(path).glob("*.safetensors")):
        for t in read_header(str(name)).tensors:
            if t.name.endswith(("ngram_embedding.weight_scale_2", "ngram_embedding.weight_scale")) and t.shape == (1,):
                with open(name, "rb") as f:
                    f.seek(t.begin)
                    return struct.unpack("<f", f.read(4))[0]
    raise ValueError(f"{path} has no global PLE scale")


@contextlib.contextmanager
def staged(kind: str, checkpoint: Checkpoint) -> Iterator[tuple[region.Region, dict]]:
    """The checkpoint staged by pled on ``kind`` pages: (the Region, what staging said). The region is closed, and
    the host's setting put back, on leaving; NotMeasured (with the reason) where this host cannot give those pages.
    Everything that holds the region's pages (mappings, registrations, children) must be gone by then."""
    source = open_checkpoint(checkpoint.path)
    name = f"device-check-{kind}"
    with contextlib.ExitStack() as stack:
        pages = None
        if kind == "thp":
            try:
                old = stack.enter_context(shmem_enabled("advise"))
                policy = read_policy()
            except (OSError, PolicyUnreadable) as err:
                raise NotMeasured(f"transparent huge pages cannot be set up here: {err}") from err
            if policy is None or not policy.allows_huge:
                raise NotMeasured(f"shmem_enabled set to advise, but huge pages stay off for shared memory "
                                  f"({policy.effective if policy else 'no THP in this kernel'})")
            said = {"shmem_enabled_was": old, "shmem_enabled": policy.effective}
        elif kind == "hugetlb":
            _this_tests_package()
            need = -(-region.plan(name, source).region_bytes // PMD_SIZE)
            given = stack.enter_context(reserve(need, PMD_SIZE))
            if given < need:
                raise NotMeasured(f"the kernel gave {given} of the {need} 2 MiB pages asked for the 2 MiB pool "
                                  "(not enough contiguous free memory)")
            pages = PagePlan("hugetlb", PMD_SIZE, "2 MiB hugetlb pages for the device check", NO_NUMA)
            said = {"pool_raised_by": need}
        else:
            said = {}
        r = staging.stage(name, source, huge_pages="auto" if kind == "thp" else "off", digests=False, pages=pages)
        stack.callback(r.close)
        said.update(seconds=round(r.stats.seconds, 4), fill=r.stats.fill.method, policy=r.stats.fill.policy,
                    huge_bytes=r.stats.huge_bytes, region_bytes=r.manifest.region_bytes,
                    page_size_of_memfd=os.fstat(r.fd).st_blksize)
        yield r, said


def _this_tests_package() -> None:
    """bench/hugepages.py's ``reserve`` imports ``tests.hugepool``: make ``tests`` this repository's folder, so a
    ``tests`` package some library installed into the device image's site-packages cannot stand in for it."""
    import importlib.machinery
    import importlib.util

    here = str(Path(__file__).resolve().parent.parent / "tests")
    known = sys.modules.get("tests")
    if known is None or here not in list(getattr(known, "__path__", [])):
        spec = importlib.machinery.ModuleSpec("tests", None, is_package=True)
        spec.submodule_search_locations = [here]
        sys.modules["tests"] = importlib.util.module_from_spec(spec)
