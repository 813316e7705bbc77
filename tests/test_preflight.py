"""The preflight against fixture /proc and /sys trees: every way a host can look."""
import pytest

from pled.daemon import hostmem, preflight
from pled.shared.errors import PreflightRefused

GiB = 1024**3
KB = 1024
TABLE = int(29.8 * GiB)  # ples_int4, the real sidecar

V1_MOUNT = "35 30 0:31 {root} /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:16 - cgroup cgroup rw,memory\n"
V2_MOUNT = "30 23 0:26 {root} /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


class Host:
    """A fixture tree: root/proc/... and root/sys/fs/cgroup/..."""

    def __init__(self, root):
        self.root = root

    def file(self, path, text):
        p = self.root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return p

    def meminfo(self, total, free, available=None, slab_reclaimable=0):
        lines = [f"MemTotal: {total // KB} kB", f"MemFree: {free // KB} kB"]
        if available is not None:
            lines.append(f"MemAvailable: {available // KB} kB")
        lines += ["Active(file): 1048576 kB", "Inactive(file): 1048576 kB", f"SReclaimable: {slab_reclaimable // KB} kB",
                  "HugePages_Total: 0"]
        self.file("/proc/meminfo", "\n".join(lines) + "\n")

    def zfs_arc(self, size, c_min):
        """OpenZFS's arcstats as the kernel module writes it (a kstat header, then name type data)."""
        self.file("/proc/spl/kstat/zfs/arcstats", "12 1 0x01 98 26656 1920163911 654183491814\n"
                  "name                            type data\n"
                  "hits                            4    1115656\n"
                  f"c                               4    {size}\n"
                  f"c_min                           4    {c_min}\n"
                  f"c_max                           4    {64 * GiB}\n"
                  f"size                            4    {size}\n"
                  "arc_meta_used                   4    912345\n")

    def v1(self, path, levels, mount_root="/"):
        """levels: {cgroup path: (limit, usage, file_cache)}"""
        self.file("/proc/self/cgroup", f"9:pids:/\n4:memory:{path}\n1:name=systemd:/\n0::/\n")
        self.file("/proc/self/mountinfo", V1_MOUNT.format(root=mount_root))
        for p, (limit, usage, cache) in levels.items():
            d = "/sys/fs/cgroup/memory" + ("" if p == "/" else p)
            self.file(f"{d}/memory.limit_in_bytes", f"{limit}\n")
            self.file(f"{d}/memory.usage_in_bytes", f"{usage}\n")
            self.file(f"{d}/memory.stat", f"cache {cache}\nrss 0\nshmem 0\ntotal_active_file {cache // 2}\n"
                                          f"total_inactive_file {cache - cache // 2}\n")

    def v2(self, path, levels):
        self.file("/proc/self/cgroup", f"0::{path}\n")
        self.file("/proc/self/mountinfo", V2_MOUNT.format(root="/"))
        for p, (limit, usage, cache) in levels.items():
            d = "/sys/fs/cgroup" + ("" if p == "/" else p)
            if limit is not None:
                self.file(f"{d}/memory.max", "max\n" if limit == "max" else f"{limit}\n")
                self.file(f"{d}/memory.current", f"{usage}\n")
                self.file(f"{d}/memory.stat", f"anon 0\nfile {cache}\nshmem 0\nactive_file {cache // 2}\n"
                                              f"inactive_file {cache - cache // 2}\n")
            else:
                (self.root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)

    def check(self, tables=None, margin=0):
        return preflight.check(tables or {"ples_int4": TABLE}, margin, str(self.root))


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
    assert "pled needs 48.9 GiB for table ples_fp8 but only 40.0 GiB is available to this service (MemAvailable 40.0 GiB)" in v.message


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
    assert "MemAvailable 20.0 GiB + ZFS ARC 19.0 GiB: its size 24.0 GiB less its minimum 4.0 GiB and SReclaimable 1.0 GiB" \
        in v.message
    assert v.as_dict()["zfs_arc"] == {"size_bytes": 24 * GiB, "c_min_bytes": 4 * GiB, "counted_bytes": 19 * GiB}


def test_zfs_arc_at_its_minimum_gives_nothing_and_the_refusal_names_it(host):
    host.meminfo(total=64 * GiB, free=2 * GiB, available=20 * GiB)
    host.zfs_arc(size=4 * GiB, c_min=4 * GiB)
    v = host.check()
    assert not v.ok and v.available == 20 * GiB
    assert "only 20.0 GiB is available" in v.message and "ZFS ARC 0.0 KiB: its size 4.0 GiB less its minimum 4.0 GiB" in v.message
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
