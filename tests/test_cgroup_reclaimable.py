"""Reclaimable memory in a cgroup is its file LRU, never `cache` (v1) or `file` (v2), which include shared memory.

The fixtures differ where the right and the wrong keys differ: 30 GiB of shmem (memfds: a staged table, say) is
counted in cache/file but can only be swapped, not reclaimed; and cache/file differ from active + inactive file."""
from fakehost import V1_MOUNT, V2_MOUNT, GiB, Host
from pled.daemon.memory import preflight


def test_v1_shmem_in_cache_is_not_reclaimable(tmp_path):
    host = Host(tmp_path)
    host.meminfo(total=176 * GiB, free=100 * GiB, available=170 * GiB)
    host.file("/proc/self/cgroup", "4:memory:/pled\n0::/\n")
    host.file("/proc/self/mountinfo", V1_MOUNT.format(root="/"))
    d = "/sys/fs/cgroup/memory/pled"
    host.file(f"{d}/memory.limit_in_bytes", f"{64 * GiB}\n")
    host.file(f"{d}/memory.usage_in_bytes", f"{40 * GiB}\n")
    host.file(f"{d}/memory.stat", "\n".join([
        f"cache {33 * GiB}", f"rss {7 * GiB}", f"shmem {30 * GiB}", f"active_file {GiB}", f"inactive_file {2 * GiB}",
        f"total_cache {33 * GiB}", f"total_rss {7 * GiB}", f"total_shmem {30 * GiB}",
        f"total_active_file {GiB}", f"total_inactive_file {2 * GiB}"]) + "\n")
    v = preflight.check({"t": 20 * GiB}, 0, str(tmp_path))
    # 64 - (40 - 3) = 27 GiB: the 30 GiB of shmem stays charged. With `cache` it would be 64 - (40 - 33) = 57.
    assert v.cgroup.binding.reclaimable == 3 * GiB
    assert v.available == 27 * GiB and v.ok
    assert not preflight.check({"t": 28 * GiB}, 0, str(tmp_path)).ok


def test_v2_shmem_in_file_is_not_reclaimable(tmp_path):
    host = Host(tmp_path)
    host.meminfo(total=176 * GiB, free=100 * GiB, available=170 * GiB)
    host.file("/proc/self/cgroup", "0::/pled\n")
    host.file("/proc/self/mountinfo", V2_MOUNT.format(root="/"))
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True, exist_ok=True)
    d = "/sys/fs/cgroup/pled"
    host.file(f"{d}/memory.max", f"{64 * GiB}\n")
    host.file(f"{d}/memory.current", f"{40 * GiB}\n")
    host.file(f"{d}/memory.stat", "\n".join([
        f"anon {7 * GiB}", f"file {33 * GiB}", f"shmem {30 * GiB}", f"active_file {GiB}", f"inactive_file {2 * GiB}",
        "active_anon 0", f"inactive_anon {37 * GiB}"]) + "\n")
    v = preflight.check({"t": 20 * GiB}, 0, str(tmp_path))
    assert v.cgroup.version == 2 and v.cgroup.binding.reclaimable == 3 * GiB
    assert v.available == 27 * GiB
