"""pled serve inside a real memory cgroup (v1, as on this machine): refuse in seconds, never be OOM-killed.

Skipped, with the reason, where a memory cgroup cannot be created (not root, no
v1 memory controller, a read-only cgroup tree).
"""
import time

import pytest

from cgroups import oom_kills
from harness import Daemon, drop_page_cache, write_config
from pled.daemon.sources.sidecar import open_table
from pled.shared import region

pytestmark = [pytest.mark.daemon, pytest.mark.root]  # the memcg fixture (tests/conftest.py) makes the cgroups
MiB = 1024**2


def test_limit_below_the_table_exits_78_in_seconds_without_oom(memcg, sidecar, tmp_path):
    d = sidecar("ples_int4", shards=8, rows=160_000)  # 128 MB of shards
    needed = region.plan("ples_int4", open_table(str(d))).region_bytes
    cfg = write_config(tmp_path / "pled.toml", {"ples_int4": d}, headroom_margin=0)
    cg = memcg(96 * MiB)
    start = time.monotonic()
    pled = Daemon(cfg, cgroup=cg)
    assert pled.wait(timeout=120) == 78, pled.log()
    elapsed = time.monotonic() - start
    err = pled.log()
    assert f"pled needs {needed / MiB:.1f} MiB for table ples_int4 but only" in err
    assert "is available to this service (cgroup limit 96.0 MiB" in err
    assert elapsed < 30, f"a refusal must take seconds, took {elapsed:.1f} s"
    assert oom_kills(cg) == 0


def test_staging_inside_the_cgroup_charges_the_table_once(memcg, sidecar, tmp_path):
    d = sidecar("ples_int4", shards=8, rows=160_000)
    region_bytes = region.plan("ples_int4", open_table(str(d))).region_bytes
    cfg = write_config(tmp_path / "pled.toml", {"ples_int4": d}, headroom_margin=0)
    cg = memcg(512 * MiB)
    drop_page_cache(d.glob("*.safetensors"))  # pled's reads are charged to its cgroup, not to whoever wrote the files
    pled = Daemon(cfg, cgroup=cg)
    try:
        pled.wait_ready()
        usage = int((cg / "memory.usage_in_bytes").read_text())
        peak = int((cg / "memory.max_usage_in_bytes").read_text())
        # The table is charged to pled's cgroup (shared memory is accounted to whoever faulted it in) ...
        print(f"usage {usage / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB, region {region_bytes / MiB:.0f} MiB")
        assert usage >= region_bytes * 0.95, (usage, region_bytes)
        # ... once: the interpreter and at most about a shard of page cache on top, never a second table.
        # Without dropping each shard's pages the peak would be at least region + 128 MB of page cache.
        assert peak - region_bytes < 100 * MiB, f"peak {peak / MiB:.0f} MiB for a {region_bytes / MiB:.0f} MiB region"
        assert oom_kills(cg) == 0
    finally:
        rc = pled.stop()
    assert rc == 0
