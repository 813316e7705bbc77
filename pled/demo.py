"""``pled demo``: the whole job on a small synthetic sidecar, explained as it goes."""
from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import time

import numpy as np

from pled.daemon.memory import preflight
from pled.daemon.regions import staging
from pled.daemon.sources.sidecar import open_table
from pled.generator import make_sidecar
from pled.shared import dequant, region
from pled.shared.errors import EX_CONFIG
from pled.shared.pagecache import cached_bytes
from pled.shared.sizes import gib, rate


def _tensors(buffer, entries, shard: int, base: int = 0) -> dict[str, np.ndarray]:
    return {t.name: dequant.view(buffer, t.offset - base, t.dtype, t.shape) for t in entries if t.shard == shard}


def run(layout: str = "ples_int4", shards: int = 16, rows: int = 50_000, seed: int = 0, keep: bool = False) -> int:
    work = tempfile.mkdtemp(prefix="pled-demo-")
    try:
        return _run(work, layout, shards, rows, seed)
    finally:
        if keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _run(work: str, layout: str, shards: int, rows: int, seed: int) -> int:
    path = os.path.join(work, layout)
    t = time.perf_counter()
    make_sidecar(path, layout, shards=shards, rows=rows, seed=seed)
    print(f"1. made a synthetic {layout} sidecar in {path}: {shards} shards x {rows} rows "
          f"({time.perf_counter() - t:.1f} s)")

    sidecar = open_table(path)
    manifest = region.plan(layout, sidecar)
    print(f"2. validated every header: {sidecar.layout}, {len(sidecar.shards)} shards, {sidecar.rows} rows of width "
          f"{sidecar.row_width}, {gib(sidecar.nbytes)} of files -> region of {gib(manifest.region_bytes)} "
          f"(shards at 2 MiB boundaries)")

    verdict = preflight.check({layout: manifest.region_bytes}, margin=256 * 1024**2)
    print(f"3. {verdict.message}")
    if not verdict.ok:
        return EX_CONFIG

    r = staging.stage(layout, sidecar, planned=manifest)
    with r:
        m = r.manifest
        print(f"4. staged into memfd 'pled:{layout}': {gib(m.source_bytes)} in {r.stats.seconds * 1000:.0f} ms "
              f"({rate(m.source_bytes, r.stats.seconds)}) by {r.stats.fill.method}, "
              f"huge pages {r.stats.huge_bytes / m.region_bytes:.0%} (shmem_enabled: {r.stats.fill.policy})")
        cached = sum(cached_bytes(s.path) for s in m.shards)
        print(f"5. page cache still holding the source files: {gib(cached)} "
              f"(largest shard {gib(max(s.size for s in m.shards))}): each shard's pages were dropped after its copy")
        print(f"6. sealed: {region.is_sealed(r.fd)}; ", end="")
        try:
            mmap.mmap(r.fd, m.region_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE).close()
            print("a writable mapping was allowed (unexpected!)")
            return 1
        except PermissionError:
            print("a writable mapping of the region is refused (EPERM): no client can change the table")

        # Read rows back through a read-only mapping and check them against the files on disk.
        view = region.map_readonly(r.fd)
        rng = np.random.default_rng(seed)
        picks = sorted(rng.choice(m.rows, size=min(5, m.rows), replace=False).tolist())
        starts = np.cumsum([0] + [s.rows for s in m.shards])
        for global_row in picks:
            shard = int(np.searchsorted(starts, global_row, side="right") - 1)
            local = np.array([global_row - starts[shard]])
            from_region = dequant.dequant_rows(layout, _tensors(view, m.tensors, shard), local)
            with open(m.shards[shard].path, "rb") as f:
                data = f.read()
            from_file = dequant.dequant_rows(layout, _tensors(data, m.tensors, shard, base=m.shards[shard].offset),
                                             local)
            same = np.array_equal(from_region, from_file, equal_nan=True)
            print(f"7. row {global_row:>7} (shard {shard}, row {int(local[0])}): "
                  f"{' '.join(f'{v:+.4f}' for v in from_region[0, :4])} ... identical to the file: {same}")
            if not same:
                return 1
        del from_region
        view.close()
    print("8. done: the region is freed with its last fd; `pled serve` keeps it for clients instead")
    return 0
