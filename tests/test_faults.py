"""Faults, against a real daemon process: kill -9 while staging, sources that change or fail while being
copied, corrupt shards, a full or missing socket directory."""
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from harness import Daemon, mount_fuse, require_fuse, run_pled, write_config
from pled import client
from pled.generator import make_sidecar
from pled.shared import protocol

pytestmark = pytest.mark.daemon
MiB = 1024**2


def charged_shmem(cg: Path) -> int:
    """Shared memory (memfd pages) charged to the memory cgroup ``cg`` and its children: memory.stat's total_shmem."""
    for line in (cg / "memory.stat").read_text().splitlines():
        if line.startswith("total_shmem "):
            return int(line.split()[1])
    raise AssertionError(f"no total_shmem in {cg}/memory.stat")


# Where pled is killed: at once (before Python runs), then after each line it logs on its way to ready.
KILL_POINTS = ("", "preflight passed", "listening on", "table t: shard 1/4", "table t: shard 2/4", "table t: shard 3/4",
               "table t: shard 4/4", "table t staged", "ready:")
# memory.stat's figures are flushed from per-CPU counters in batches (64 pages a CPU): a figure read at once may lag
# the truth by that much, never by a region (34 MiB here).
STAT_LAG = 64 * 4096 * (os.cpu_count() or 1)


@pytest.mark.slow
def test_kill_9_at_each_point_of_staging_pled_reports_leaves_nothing_behind(tmp_path, memcg):
    """pled is killed with SIGKILL at each point of its start that it reports (at once; after its preflight; once
    listening; after each shard; once staged; once ready), in a memory cgroup of its own. Once it is reaped, no
    process of it is left in that cgroup and no shared memory is charged there: a region outlives pled only while
    something holds it. The next start in the same cgroup stages cleanly, the dead pled's socket no obstacle, and
    stops cleanly, leaving nothing either. Each kill waits for pled's own line, never for a time, and the memory is
    pled's own cgroup's, not the host's, which other programs change meanwhile: a busy machine moves where between
    two lines a kill lands, not what is checked."""
    d = tmp_path / "sc"
    make_sidecar(str(d), "ples_int4", shards=4, rows=80_000)  # 32 MB, staged at 40 MB/s: under a second
    cfg = write_config(tmp_path / "pled.toml", {"t": d}, headroom_margin=0, staging_bandwidth="40MB/s")
    cg = memcg(1 << 30)

    def nothing_left(when: str) -> None:
        procs = (cg / "cgroup.procs").read_text().split()
        shm = charged_shmem(cg)
        assert procs == [] and shm <= STAT_LAG, f"{when}: processes {procs}, shared memory {shm / MiB:.1f} MiB"

    for point in KILL_POINTS:
        victim = Daemon(cfg, cgroup=cg)
        if point:
            victim.wait_for(point)
        victim.stop(signal.SIGKILL)
        nothing_left(f"killed after {point!r}")
        nxt = Daemon(cfg, cgroup=cg)  # the dead daemon's socket file does not block it
        nxt.wait_ready()
        assert client.call(protocol.PING, socket=nxt.socket) == {}
        assert charged_shmem(cg) >= 32 * MiB  # the region is charged here while pled holds it
        assert nxt.stop() == 0, nxt.log()
        nothing_left(f"stopped after a kill after {point!r}")
    assert not (tmp_path / "run/pled.sock").exists()  # a clean stop removes its socket


def test_a_shard_that_shrinks_while_it_is_copied_fails_the_start_clearly(tmp_path, sidecar):
    d = sidecar("ples_int4", shards=4, rows=80_000)
    cfg = write_config(tmp_path / "pled.toml", {"t": d}, headroom_margin=0, staging_bandwidth="16MB/s")
    pled = Daemon(cfg)
    pled.wait_for("shard 1/4")
    os.truncate(d / "shard_3.safetensors", 1000)  # shrinks before (or while) it is copied
    assert pled.wait(timeout=60) == 1
    log = pled.log()
    assert "shard_3.safetensors" in log and "changed while pled was staging it (size 1000, was" in log
    assert "start pled again once the sidecar is completely written" in log
    pled.stop()


@pytest.fixture
def faultfs(tmp_path):
    """mount(source, bad_file, bad_offset) -> a FUSE mount of ``source`` whose reads of that byte fail with EIO."""
    require_fuse()
    mounts = []

    def mount(source: Path, name: str, offset: int) -> Path:
        point = tmp_path / f"fuse{len(mounts)}"
        point.mkdir()
        mounts.append((point, mount_fuse("faultfs.py", source, point, name, str(offset))))
        return point

    yield mount
    for point, proc in mounts:
        subprocess.run(["umount", str(point)], check=False)
        proc.wait(timeout=10)


@pytest.mark.root
def test_a_read_error_names_the_file_and_the_offset(tmp_path, sidecar, faultfs):
    d = sidecar("ples_int4", shards=3, rows=20_000)
    mounted = faultfs(d, "shard_1.safetensors", 1_000_000)
    cfg = write_config(tmp_path / "pled.toml", {"t": mounted}, headroom_margin=0)
    r = run_pled("serve", "-c", cfg)
    assert r.returncode == 1
    assert f"reading {mounted}/shard_1.safetensors failed at offset" in r.stderr and "Input/output error" in r.stderr
    offset = int(r.stderr.split("failed at offset ")[1].split()[0])
    assert offset <= 1_000_000 < offset + 4096 * 32  # where the bad byte is, to the readahead window
    assert not (tmp_path / "run/pled.sock").exists()


def test_a_corrupt_shard_is_refused_by_its_digest_and_found_by_verify(tmp_path, sidecar, daemon):
    d = sidecar("ples_fp8", shards=4, rows=2000)
    good = (d / "shard_2.safetensors").read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01  # one bit in one byte of the data, the header untouched
    (d / "shard_2.safetensors").write_bytes(bad)
    refused = daemon({"t": d}, wait=None)
    assert refused.wait_ready_or_exit() == 78, refused.log()
    log = refused.log()
    assert "shard_2.safetensors: content xxh3_128:" in log and "does not match" in log and "META.json" in log
    # Without the shipped digests the same file stages; `pled verify` then finds what differs from the disk.
    (d / "shard_2.safetensors").write_bytes(good)
    meta = d / "META.json"
    import json

    doc = json.loads(meta.read_text())
    del doc["digests"]
    meta.write_text(json.dumps(doc))
    pled = daemon({"t": d})
    (d / "shard_2.safetensors").write_bytes(bad)
    r = run_pled("verify", "--socket", pled.socket)
    assert r.returncode == 1
    assert f"t/shard_2.safetensors: DIFFERS at byte {len(bad) // 2}" in r.stdout
    assert r.stdout.count("identical") == 3


def test_sums_files_are_checked_too(tmp_path, sidecar):
    d = sidecar("ples_int4", shards=2, rows=100)
    import json

    doc = json.loads((d / "META.json").read_text())
    digests = doc.pop("digests")
    (d / "META.json").write_text(json.dumps(doc))
    import blake3

    (d / "B3SUMS").write_text("".join(f"{blake3.blake3((d / k).read_bytes()).hexdigest()}  {k}\n" for k in digests))
    pled = Daemon(write_config(tmp_path / "ok.toml", {"t": d}, headroom_margin=0))
    pled.wait_ready()  # the correct sums pass
    assert pled.stop() == 0
    (d / "B3SUMS").write_text(f"{'0' * 64}  shard_1.safetensors\n")
    r = run_pled("serve", "-c", write_config(tmp_path / "bad.toml", {"t": d}, headroom_margin=0))
    assert r.returncode == 78 and "shard_1.safetensors: content blake3:" in r.stderr and "B3SUMS" in r.stderr


@pytest.mark.root
def test_a_full_socket_directory_is_a_clear_error(tmp_path, sidecar):
    if not shutil.which("unshare"):
        pytest.skip("needs unshare for a private tmpfs")
    d = sidecar(shards=1, rows=10)
    full = tmp_path / "full"
    full.mkdir()
    cfg = write_config(tmp_path / "pled.toml", {"t": d}, headroom_margin=0, socket=str(full / "pled.sock"))
    # A tmpfs with one inode, in a private mount namespace: full as soon as it exists.
    mount = 'mount -t tmpfs -o size=64k,nr_inodes=1,mode=0750 pled-full "$0" && exec "$@"'
    pled = Daemon(cfg, prefix=["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, str(full)])
    assert pled.wait(timeout=60) == 1, pled.log()
    assert f"cannot create socket {full}/pled.sock: No space left on device; free space (or inodes) there" in pled.log()


def test_a_socket_directory_that_cannot_be_made_is_a_clear_error(tmp_path, sidecar):
    d = sidecar(shards=1, rows=10)
    cfg = write_config(tmp_path / "pled.toml", {"t": d}, headroom_margin=0, socket="/proc/pled-nowhere/pled.sock")
    r = run_pled("serve", "-c", cfg)
    assert r.returncode == 78, r.stderr  # a refusal: a restart would fail the same way
    assert "cannot create the socket's directory /proc/pled-nowhere" in r.stderr


@pytest.mark.root
def test_a_socket_directory_pled_may_not_write_is_a_refusal(tmp_path, sidecar, open_dir):
    """pled (here root with no capability, as a non-root pled in a container whose socket directory belongs to
    someone else) cannot create its socket: 78 (no restart loop), naming the uid and the directory."""
    d = sidecar(shards=1, rows=10)
    run = os.path.join(open_dir, "run")
    os.mkdir(run, 0o755)
    os.chown(run, 4321, 4321)
    cfg = write_config(tmp_path / "pled.toml", {"t": d}, headroom_margin=0, socket=os.path.join(run, "pled.sock"))
    pled = Daemon(cfg, prefix=["setpriv", "--bounding-set=-all", "--inh-caps=-all"])
    assert pled.wait(timeout=60) == 78, pled.log()
    assert f"cannot create socket {run}/pled.sock: Permission denied; check that uid 0 may write {run}" in pled.log()
