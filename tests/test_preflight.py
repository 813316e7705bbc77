"""The preflight against fixture /proc and /sys trees: every way a host can look."""
import pytest

from fakehost import KB, V1_MOUNT, GiB, Host
from pled.daemon.memory import hostmem
from pled.shared.errors import PreflightRefused


@pytest.fixture
def host(tmp_path):
    return Host(tmp_path)


def test_v1_container_limit_refuses_with_both_figures(host):
    host.meminfo(total=176 * GiB, free=100 * GiB, available=170 * GiB)
    # 24 GiB cage, 6 GiB charged of which 1.2 GiB is reclaimable page cache: 19.2 GiB of headroom.
    host.v1("/docker/abc", {"/docker/abc": (24 * GiB, 6 * GiB, int(1.2 * GiB))})
    v = host.check()
    assert not v.ok
    assert v.message.startswith(
        "pled needs 29.8 GiB for table ples_int4 but only 19.2 GiB is available to this service (cgroup limit 24.0 GiB)"
    )
    assert v.available == 24 * GiB - (6 * GiB - int(1.2 * GiB))
    with pytest.raises(PreflightRefused) as err:
        v.raise_if_refused()
    assert err.value.exit_status == 78


def test_v2_container_limit_refuses(host):
    host.meminfo(total=176 * GiB, free=100 * GiB, available=170 * GiB)
    host.v2("/system.slice/pled.service", {"/": (None, 0, 0), "/system.slice": ("max", 0, 0),
                                           "/system.slice/pled.service": (24 * GiB, 6 * GiB, int(1.2 * GiB))})
    v = host.check()
    assert not v.ok and "19.2 GiB is available to this service (cgroup limit 24.0 GiB)" in v.message
    assert v.cgroup.version == 2


def test_page_cache_full_passes(host):
    # The ordinary case after an mmapped run: MemFree tiny, MemAvailable large. MemFree must not decide.
    host.meminfo(total=176 * GiB, free=int(1.4 * GiB), available=int(168.8 * GiB))
    v = host.check()
    assert v.ok and v.available == int(168.8 * GiB) // KB * KB
    assert "MemAvailable 168.8 GiB" in v.message


def test_reclaimable_file_cache_in_the_cgroup_does_not_refuse(host):
    host.meminfo(total=176 * GiB, free=10 * GiB, available=150 * GiB)
    # Just streamed a checkpoint: 40 GiB charged, 38 GiB of it page cache.
    host.v1("/pled", {"/pled": (64 * GiB, 40 * GiB, 38 * GiB)})
    v = host.check()
    assert v.ok and v.available == 62 * GiB


def test_shmem_charged_to_the_cgroup_is_not_reclaimable(host):
    host.meminfo(total=176 * GiB, free=10 * GiB, available=150 * GiB)
    # 40 GiB charged, of it 30 GiB shmem (not on the file LRU) and 2 GiB file cache.
    host.v2("/pled", {"/": (None, 0, 0), "/pled": (64 * GiB, 40 * GiB, 2 * GiB)})
    v = host.check()
    assert not v.ok and v.available == 26 * GiB


def test_a_tighter_parent_decides_and_is_named(host):
    host.meminfo(total=176 * GiB, free=100 * GiB, available=170 * GiB)
    host.v2("/machine.slice/vm.scope/pled", {"/": (None, 0, 0), "/machine.slice": (20 * GiB, 2 * GiB, 0),
                                             "/machine.slice/vm.scope": ("max", 0, 0),
                                             "/machine.slice/vm.scope/pled": (100 * GiB, GiB, 0)})
    v = host.check()
    assert not v.ok and v.available == 18 * GiB
    assert "cgroup limit 20.0 GiB on /machine.slice" in v.message


def test_v1_unlimited_is_no_limit(host):
    host.meminfo(total=176 * GiB, free=100 * GiB, available=170 * GiB)
    host.v1("/user.slice", {"/": (9223372036854771712, 50 * GiB, 0), "/user.slice": (9223372036854771712, GiB, 0)})
    v = host.check()
    assert v.ok and v.cgroup.limited == () and v.available == 170 * GiB


def test_v1_container_whose_mount_shows_only_its_own_cgroup(host):
    # Docker without a cgroup namespace: /proc/self/cgroup names the host path, the mount root is that path.
    host.meminfo(total=176 * GiB, free=100 * GiB, available=170 * GiB)
    host.file("/proc/self/cgroup", "4:memory:/docker/abc\n")
    host.file("/proc/self/mountinfo", V1_MOUNT.format(root="/docker/abc"))
    host.file("/sys/fs/cgroup/memory/memory.limit_in_bytes", f"{24 * GiB}\n")
    host.file("/sys/fs/cgroup/memory/memory.usage_in_bytes", f"{GiB}\n")
    host.file("/sys/fs/cgroup/memory/memory.stat", "total_active_file 0\ntotal_inactive_file 0\n")
    v = host.check()
    assert not v.ok and v.available == 23 * GiB


def test_no_cgroup_uses_meminfo(host):
    host.meminfo(total=64 * GiB, free=GiB, available=40 * GiB)
    v = host.check()
    assert v.ok and v.cgroup is None and v.available == 40 * GiB
    v = host.check({"ples_fp8": int(48.9 * GiB)})
    assert not v.ok
    assert ("pled needs 48.9 GiB for table ples_fp8 but only 40.0 GiB is available to this service "
            "(MemAvailable 40.0 GiB)") in v.message


def test_margin_counts(host):
    host.meminfo(total=64 * GiB, free=GiB, available=30 * GiB)
    assert host.check().ok
    v = host.check(margin=GiB)
    assert not v.ok and "plus 1.0 GiB headroom_margin" in v.message


def test_several_tables_are_summed(host):
    host.meminfo(total=64 * GiB, free=GiB, available=40 * GiB)
    v = host.check({"a": 25 * GiB, "b": 20 * GiB})
    assert not v.ok and v.needed == 45 * GiB and "tables a (25.0 GiB), b (20.0 GiB)" in v.message


def test_nothing_readable_skips_the_check(host):
    (host.root / "proc" / "meminfo").mkdir(parents=True)  # unreadable: a directory where the file should be
    v = host.check()
    assert v.ok and v.available is None
    assert v.message.startswith("headroom unknown")
    assert "proc/meminfo" in v.message


def test_empty_tree_skips_the_check(host):
    v = host.check()
    assert v.ok and v.available is None and "headroom unknown" in v.message


def test_unreadable_cgroup_falls_back_to_meminfo(host):
    host.meminfo(total=64 * GiB, free=GiB, available=40 * GiB)
    host.v1("/pled", {"/pled": (8 * GiB, GiB, 0)})
    (host.root / "sys/fs/cgroup/memory/pled/memory.stat").unlink()
    (host.root / "sys/fs/cgroup/memory/pled/memory.stat").mkdir()
    v = host.check({"t": GiB})
    assert v.ok and v.available == 40 * GiB
    assert any("memory.stat" in p for p in v.problems)


def test_garbage_limit_is_reported_not_crashed_on(host):
    host.meminfo(total=64 * GiB, free=GiB, available=40 * GiB)
    host.v2("/pled", {"/": (None, 0, 0), "/pled": (8 * GiB, GiB, 0)})
    host.file("/sys/fs/cgroup/pled/memory.max", "eight gigs\n")
    v = host.check({"t": GiB})
    assert v.ok and any("not a number" in p for p in v.problems)


def test_old_kernel_without_memavailable_is_estimated(host):
    host.meminfo(total=64 * GiB, free=10 * GiB)
    info = hostmem.read_meminfo(str(host.root))
    assert info.estimated and info.available == 12 * GiB


def test_zfs_arc_above_its_minimum_counts_as_available(host):
    # MemAvailable alone (20 GiB) would refuse the 29.8 GiB table; the ARC holds 24 GiB, 4 GiB of it its minimum.
    host.meminfo(total=64 * GiB, free=2 * GiB, available=20 * GiB, slab_reclaimable=1 * GiB)
    host.zfs_arc(size=24 * GiB, c_min=4 * GiB)
    v = host.check()
    assert v.ok and v.available == (20 + 24 - 4 - 1) * GiB, v.message
    assert ("MemAvailable 20.0 GiB + ZFS ARC 19.0 GiB: its size 24.0 GiB less its minimum 4.0 GiB "
            "and SReclaimable 1.0 GiB") in v.message
    assert v.as_dict()["zfs_arc"] == {"size_bytes": 24 * GiB, "c_min_bytes": 4 * GiB, "counted_bytes": 19 * GiB}


def test_zfs_arc_at_its_minimum_gives_nothing_and_the_refusal_names_it(host):
    host.meminfo(total=64 * GiB, free=2 * GiB, available=20 * GiB)
    host.zfs_arc(size=4 * GiB, c_min=4 * GiB)
    v = host.check()
    assert not v.ok and v.available == 20 * GiB
    assert "only 20.0 GiB is available" in v.message
    assert "ZFS ARC 0.0 KiB: its size 4.0 GiB less its minimum 4.0 GiB" in v.message
    with pytest.raises(PreflightRefused):
        v.raise_if_refused()


def test_a_cgroup_limit_still_binds_on_a_zfs_host(host):
    host.meminfo(total=64 * GiB, free=2 * GiB, available=20 * GiB)
    host.zfs_arc(size=40 * GiB, c_min=1 * GiB)
    host.v2("/system.slice/pled.service", {"/system.slice/pled.service": (16 * GiB, 0, 0)})
    v = host.check()
    assert not v.ok and v.available == 16 * GiB and "cgroup limit 16.0 GiB" in v.message


def test_unreadable_arcstats_is_named_and_memavailable_alone_decides(host):
    host.meminfo(total=64 * GiB, free=2 * GiB, available=40 * GiB)
    host.file("/proc/spl/kstat/zfs/arcstats", "12 1 0x01 98 26656 1920163911 654183491814\nname type data\nhits 4 12\n")
    v = host.check()
    assert v.ok and v.available == 40 * GiB and v.zfs_arc is None
    assert any("arcstats: has no size and c_min lines" in p for p in v.problems), v.problems
