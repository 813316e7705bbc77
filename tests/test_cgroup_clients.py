"""A client in a memory cgroup limited far below the table reads all of it: the table is charged to pled.

What a vLLM container capped with `docker run --memory=...` relies on. Shared memory is
charged to the memory cgroup of the process that first faulted each page in: pled, which
staged the table. A client that maps the sealed memfd, pre-faults it, reads every page and
gathers rows adds page-table entries and its own heap to its cgroup, never the table.

Real cgroup v1 memory cgroups (this project's CI host), made and removed with the memcg fixture
(tests/conftest.py); skipped with the reason where none can be made (not root, cgroup v2 without a
delegated subtree).
"""
import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cgroups import join_and_exec, oom_kills
from harness import Daemon, drop_page_cache, run_pled, write_config
from pled import client
from pled.daemon.sources.sidecar import open_table
from pled.shared import region

pytestmark = [pytest.mark.daemon, pytest.mark.root, pytest.mark.slow]
MiB = 1024**2
ROWS = list(range(0, 4_800_000, 9_973))  # rows from every shard

# The client: a fresh interpreter that joins its cgroup before it imports anything, so every byte
# it charges is charged there.
CLIENT = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    import torch
    from pled import client
    torch.set_num_threads(1)
    rows = torch.tensor(json.loads(sys.argv[2]))
    usage = lambda: int(open(sys.argv[3] + "/memory.usage_in_bytes").read())
    def held():  # what the cgroup holds that no reclaim can take back: anonymous memory and shmem (no swap here)
        stat = dict(line.split() for line in open(sys.argv[3] + "/memory.stat"))
        return int(stat["total_rss"]) + int(stat["total_shmem"])
    before, held_before = usage(), held()                       # the interpreter, numpy and torch
    most = held_before
    with client.attach("ples_int4", socket=sys.argv[1]) as t:   # pre-faults: MADV_POPULATE_READ + one read a page
        most = max(most, held())
        total = 0
        view = np.frombuffer(t.buffer, dtype=np.uint8)
        for start in range(0, len(view), 64 << 20):               # then every byte of every page
            total += int(view[start:start + (64 << 20)].sum(dtype=np.uint64))
            most = max(most, held())
        out = t.gather(rows)
        print(json.dumps({"bytes_read": len(view), "residency": t.residency(), "before": before, "after": usage(),
                          "held_before": held_before, "held_after": held(), "held_most": max(most, held()),
                          "gathered": hashlib.sha256(out.float().numpy().tobytes()).hexdigest()}), flush=True)
        del view
""")


def _v1(cg: Path, name: str) -> int:
    return int((cg / name).read_text())


def _stat(cg: Path, key: str) -> int:
    for line in (cg / "memory.stat").read_text().splitlines():
        k, v = line.split()
        if k == key:
            return int(v)
    raise KeyError(key)


def _run_in(cg: Path, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*join_and_exec(cg), *argv], capture_output=True, text=True, timeout=300)


def test_a_client_capped_far_below_the_table_reads_it_all_charged_to_pled(memcg, sidecar, tmp_path):
    d = sidecar("ples_int4", shards=8, rows=600_000)  # 8 x 60 MB of shards: a 458 MiB region
    region_bytes = region.plan("ples_int4", open_table(str(d))).region_bytes
    cfg = write_config(tmp_path / "pled.toml", {"ples_int4": d}, headroom_margin=0)
    socket = str(tmp_path / "run" / "pled.sock")
    pled_cg = memcg(region_bytes + 192 * MiB)  # the table, pled itself, a shard of page cache
    # The "container", at 0.42 of the table: an interpreter with torch imported peaks at ~145 MiB by itself.
    client_cg = memcg(192 * MiB)
    drop_page_cache(d.glob("*.safetensors"))
    pled = Daemon(cfg, cgroup=pled_cg)
    try:
        pled.wait_ready()
        pled_shmem = _stat(pled_cg, "total_shmem")
        assert pled_shmem >= region_bytes, (pled_shmem, region_bytes)  # the table is charged where pled staged it

        r = _run_in(client_cg, [sys.executable, "-c", CLIENT, socket, json.dumps(ROWS), str(client_cg)])
        peak = _v1(client_cg, "memory.max_usage_in_bytes")
        said = json.loads(r.stdout) if r.returncode == 0 else dict.fromkeys(("before", "after", "held_before",
                                                                             "held_after", "held_most"), 0)
        print(f"region {region_bytes / MiB:.0f} MiB; client cgroup: limit 192 MiB, "
              f"before attaching {said['before'] / MiB:.0f} MiB, after reading and gathering "
              f"{said['after'] / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB (anonymous and shmem: before "
              f"{said['held_before'] / MiB:.0f}, at most {said['held_most'] / MiB:.0f}, after "
              f"{said['held_after'] / MiB:.0f} MiB), "
              f"shmem {_stat(client_cg, 'total_shmem') / MiB:.1f} MiB, failcnt {_v1(client_cg, 'memory.failcnt')}; "
              f"pled's cgroup: shmem {_stat(pled_cg, 'total_shmem') / MiB:.0f} MiB")
        assert r.returncode == 0, f"the client failed ({r.returncode}; -9: OOM-killed?) {r.stderr[-2000:]}"
        assert oom_kills(client_cg) == 0
        assert said["bytes_read"] == region_bytes and said["residency"] == 1.0
        with client.attach("ples_int4", socket=socket) as t:  # the same rows, read here
            expected = hashlib.sha256(t.gather(torch.tensor(ROWS)).float().numpy().tobytes()).hexdigest()
        assert said["gathered"] == expected
        # Attaching, reading every byte and gathering grew what the client's cgroup holds (anonymous memory and
        # shmem: what no reclaim takes back) by a gather's output and its heap, far less than the table it read, at
        # every 64 MiB of the reading as after it ... Not its usage: that counts page cache as well, which the
        # client's own imports fault in and charge to it wherever the host's load evicted them (torch's libraries:
        # usage reached the limit under load before attaching, 178 of 192 MiB, and was reclaimed, failcnt > 0).
        assert said["held_after"] - said["held_before"] < region_bytes / 10, (said, region_bytes)
        assert said["held_most"] - said["held_before"] < region_bytes / 10, (said, region_bytes)
        assert _stat(client_cg, "total_shmem") < 8 * MiB  # ... and no page of the table is charged to it
        # ... which stayed charged to pled's cgroup all along.
        assert _stat(pled_cg, "total_shmem") >= region_bytes

        # pled's preflight, run in pled's cgroup, counts the charged table: the same table again (what a
        # reload staging a new generation would need) no longer fits under the limit.
        pre = _run_in(pled_cg, [sys.executable, "-m", "pled", "preflight", "-c", str(cfg), "--json"])
        verdict = json.loads(pre.stdout)
        assert pre.returncode == 78 and not verdict["ok"], pre.stdout
        assert verdict["cgroup"]["usage_bytes"] - verdict["cgroup"]["reclaimable_bytes"] >= region_bytes
        assert verdict["available_bytes"] < region_bytes
        status = run_pled("status", "--json", "--socket", socket)
        assert status.returncode == 0, status.stdout + status.stderr
    finally:
        rc = pled.stop()
    assert rc == 0
