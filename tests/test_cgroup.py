"""pled serve inside a real memory cgroup (v1, as on this machine): refuse in seconds, never be OOM-killed.

Skipped, with the reason, where a memory cgroup cannot be created (not root, no
v1 memory controller, a read-only cgroup tree).
"""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import write_config
from pled.shared import region
from pled.daemon.sidecar import open_table

MiB = 1024**2


def _own_v1_memory_cgroup() -> Path | None:
    path = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, p = line.split(":", 2)
        if "memory" in controllers.split(","):
            path = p
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1] == "cgroup" and "memory" in fields[sep + 3].split(",") and path is not None:
            mount_root, mountpoint = fields[3], Path(fields[4])
            rel = path[len(mount_root):] if path.startswith(mount_root) else path
            candidate = mountpoint / rel.lstrip("/")
            return candidate if candidate.is_dir() else mountpoint
    return None


@pytest.fixture
def memcg():
    """make(limit) -> a fresh child of this process's v1 memory cgroup, removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("creating a memory cgroup needs root")
    parent = _own_v1_memory_cgroup()
    if parent is None:
        pytest.skip("no cgroup v1 memory controller mounted (cgroup v2 needs a delegated subtree)")
    made = []

    def make(limit: int) -> Path:
        child = parent / f"pled-test-{os.getpid()}-{len(made)}"
        try:
            child.mkdir()
            (child / "memory.limit_in_bytes").write_text(str(limit))
        except OSError as err:
            pytest.skip(f"cannot create a memory cgroup under {parent}: {err}")
        made.append(child)
        return child

    yield make
    for child in made:
        for _ in range(50):
            try:
                child.rmdir()
                break
            except OSError:
                time.sleep(0.1)  # the last task is still leaving


def _drop_page_cache(d: Path) -> None:
    for f in d.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _wait_ready(proc: subprocess.Popen) -> str:
    """Read pled's log until it is ready; what it logged so far."""
    seen = ""
    while "ready:" not in seen:
        line = proc.stderr.readline()
        assert line, f"pled exited early:\n{seen}"
        seen += line
    return seen


def _serve_in(cg: Path, cfg: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM")}
    # The shell joins the cgroup, then becomes pled: every byte pled charges lands in the cgroup.
    return subprocess.Popen(
        ["sh", "-c", f'echo $$ > "{cg}/cgroup.procs" && exec "$0" -m pled serve -c "$1"', sys.executable, str(cfg)],
        stderr=subprocess.PIPE, text=True, env=env,
    )


def _oom_kills(cg: Path) -> int:
    for line in (cg / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def test_limit_below_the_table_exits_78_in_seconds_without_oom(memcg, sidecar, tmp_path):
    d = sidecar("ples_int4", shards=8, rows=160_000)  # 128 MB of shards
    needed = region.plan("ples_int4", open_table(str(d))).region_bytes
    cfg = write_config(tmp_path / "pled.toml", {"ples_int4": d}, headroom_margin=0)
    cg = memcg(96 * MiB)
    start = time.monotonic()
    proc = _serve_in(cg, cfg)
    _, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 78, err
    assert f"pled needs {needed / MiB:.1f} MiB for table ples_int4 but only" in err
    assert "is available to this service (cgroup limit 96.0 MiB" in err
    assert elapsed < 30, f"a refusal must take seconds, took {elapsed:.1f} s"
    assert _oom_kills(cg) == 0


def test_staging_inside_the_cgroup_charges_the_table_once(memcg, sidecar, tmp_path):
    d = sidecar("ples_int4", shards=8, rows=160_000)
    region_bytes = region.plan("ples_int4", open_table(str(d))).region_bytes
    cfg = write_config(tmp_path / "pled.toml", {"ples_int4": d}, headroom_margin=0)
    cg = memcg(512 * MiB)
    _drop_page_cache(d)  # so that pled's reads are charged to its cgroup, not to whoever wrote the files
    proc = _serve_in(cg, cfg)
    try:
        _wait_ready(proc)
        usage = int((cg / "memory.usage_in_bytes").read_text())
        peak = int((cg / "memory.max_usage_in_bytes").read_text())
        # The table is charged to pled's cgroup (shared memory is accounted to whoever faulted it in) ...
        print(f"usage {usage / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB, region {region_bytes / MiB:.0f} MiB")
        assert usage >= region_bytes * 0.95, (usage, region_bytes)
        # ... once: the interpreter and at most about a shard of page cache on top, never a second table.
        # Without dropping each shard's pages the peak would be at least region + 128 MB of page cache.
        assert peak - region_bytes < 100 * MiB, f"peak {peak / MiB:.0f} MiB for a {region_bytes / MiB:.0f} MiB region"
        assert _oom_kills(cg) == 0
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert proc.returncode == 0
