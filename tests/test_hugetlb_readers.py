"""The hugetlb and NUMA readers over fixture trees (issue 21's groundwork): what the kernel's files say, read the way
pled reads them, with no root and no pool. tests/test_hugetlb_primitives.py does the same against the real kernel."""
import errno
import os

import pytest

from pled.daemon.memory import hugetlb, numa
from pled.daemon.memory.hostmem import UNLIMITED

MiB2, GiB1 = 2 * 1024**2, 1024**3
V1_MOUNT = "44 31 0:40 / /sys/fs/cgroup/hugetlb rw,relatime shared:20 - cgroup cgroup rw,hugetlb\n"
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


def put(root, path, text):
    p = root / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def pools(root, **sizes):
    """sizes: hugepages-<kB>kB name -> (nr, free, resv, surplus, overcommit)"""
    for name, (nr, free, resv, surplus, over) in sizes.items():
        d = f"/sys/kernel/mm/hugepages/{name}"
        for f, v in (("nr_hugepages", nr), ("free_hugepages", free), ("resv_hugepages", resv),
                     ("surplus_hugepages", surplus), ("nr_overcommit_hugepages", over)):
            put(root, f"{d}/{f}", f"{v}\n")


def test_page_sizes_and_a_pool_as_sys_writes_them(tmp_path):
    assert hugetlb.page_sizes(str(tmp_path)) == []
    pools(tmp_path, **{"hugepages-2048kB": (40, 30, 6, 0, 0), "hugepages-1048576kB": (1, 1, 0, 0, 0)})
    assert hugetlb.page_sizes(str(tmp_path)) == [MiB2, GiB1]
    p = hugetlb.pool(MiB2, str(tmp_path))
    assert (p.total, p.free, p.reserved, p.surplus, p.overcommit, p.cgroup) == (40, 30, 6, 0, 0, None)
    assert p.available_pages == 24 and p.available == 24 * MiB2  # free less reserved: what a new memfd can take
    assert hugetlb.pool(64 * 1024, str(tmp_path)) is None  # a size the kernel does not offer


def test_sizes_rounding_and_memfd_flags():
    assert [hugetlb.size_name(s) for s in (64 * 1024, MiB2, 32 * 1024**2, GiB1, 16 * GiB1)] == \
        ["64KB", "2MB", "32MB", "1GB", "16GB"]
    assert hugetlb.round_up(0, MiB2) == 0 and hugetlb.round_up(1, MiB2) == MiB2
    assert hugetlb.round_up(GiB1 + 1, GiB1) == 2 * GiB1 and hugetlb.round_up(4 * MiB2, MiB2) == 4 * MiB2
    base = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB
    assert hugetlb.memfd_flags(MiB2) == base | os.MFD_HUGE_2MB
    assert hugetlb.memfd_flags(GiB1) == base | os.MFD_HUGE_1GB
    with pytest.raises(ValueError):
        hugetlb.memfd_flags(3 * MiB2)


def v1_tree(root, path, levels):
    """levels: {cgroup path: {file: value}} under a v1 hugetlb mount."""
    put(root, "/proc/self/cgroup", f"12:hugetlb:{path}\n4:memory:/\n0::/\n")
    put(root, "/proc/self/mountinfo", V1_MOUNT)
    for p, files in levels.items():
        for name, value in files.items():
            put(root, f"/sys/fs/cgroup/hugetlb{'' if p == '/' else p}/{name}", f"{value}\n")


def test_v1_hugetlb_cgroup_every_limited_level_from_ours_up(tmp_path):
    pools(tmp_path, **{"hugepages-2048kB": (64, 64, 0, 0, 0)})
    v1_tree(tmp_path, "/kubepods/pod1", {
        "/": {"hugetlb.2MB.limit_in_bytes": 9223372036854771712, "hugetlb.2MB.usage_in_bytes": 0},
        "/kubepods": {"hugetlb.2MB.limit_in_bytes": 40 * MiB2, "hugetlb.2MB.usage_in_bytes": 30 * MiB2,
                      "hugetlb.2MB.rsvd.limit_in_bytes": 9223372036854771712,
                      "hugetlb.2MB.rsvd.usage_in_bytes": 30 * MiB2},
        "/kubepods/pod1": {"hugetlb.2MB.limit_in_bytes": 16 * MiB2, "hugetlb.2MB.usage_in_bytes": 2 * MiB2,
                           "hugetlb.2MB.rsvd.limit_in_bytes": 12 * MiB2,
                           "hugetlb.2MB.rsvd.usage_in_bytes": 2 * MiB2},
    })
    cg = hugetlb.read_cgroup(MiB2, str(tmp_path))
    assert cg.version == 1 and cg.path == "/kubepods/pod1"
    assert [(lv.path, lv.headroom) for lv in cg.limited] == [("/kubepods/pod1", 10 * MiB2), ("/kubepods", 10 * MiB2)]
    assert cg.limited[0].rsvd_limit == 12 * MiB2  # the reserved limit binds before the fault limit here
    p = hugetlb.pool(MiB2, str(tmp_path))
    assert p.available_pages == 64 and p.available == 10 * MiB2  # the cgroup decides, not the pool
    # No limit for 1 GiB pages anywhere: the controller is there, but nothing binds.
    assert hugetlb.read_cgroup(GiB1, str(tmp_path)).limited == ()


def test_v2_hugetlb_cgroup_and_no_controller(tmp_path):
    put(tmp_path, "/proc/self/cgroup", "0::/system.slice/pled.service\n")
    put(tmp_path, "/proc/self/mountinfo", V2_MOUNT)
    put(tmp_path, "/sys/fs/cgroup/system.slice/pled.service/hugetlb.2MB.max", "max\n")
    put(tmp_path, "/sys/fs/cgroup/system.slice/pled.service/hugetlb.2MB.current", "0\n")
    put(tmp_path, "/sys/fs/cgroup/system.slice/hugetlb.2MB.max", f"{8 * MiB2}\n")
    put(tmp_path, "/sys/fs/cgroup/system.slice/hugetlb.2MB.current", f"{3 * MiB2}\n")
    put(tmp_path, "/sys/fs/cgroup/system.slice/hugetlb.2MB.rsvd.max", "max\n")
    put(tmp_path, "/sys/fs/cgroup/system.slice/hugetlb.2MB.rsvd.current", f"{3 * MiB2}\n")
    cg = hugetlb.read_cgroup(MiB2, str(tmp_path))
    assert cg.version == 2 and cg.path == "/system.slice/pled.service"
    assert [(lv.path, lv.limit, lv.usage, lv.rsvd_limit) for lv in cg.limited] == \
        [("/system.slice", 8 * MiB2, 3 * MiB2, UNLIMITED)]
    assert cg.binding.headroom == 5 * MiB2
    # A v1 host whose hugetlb controller is not mounted (this project's CI host): nothing applies.
    put(tmp_path, "/proc/self/cgroup", "4:memory:/\n0::/\n")
    put(tmp_path, "/proc/self/mountinfo", "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    assert hugetlb.read_cgroup(MiB2, str(tmp_path)) is None


def test_an_unreadable_limit_is_named(tmp_path):
    v1_tree(tmp_path, "/a", {"/a": {"hugetlb.2MB.limit_in_bytes": "lots", "hugetlb.2MB.usage_in_bytes": 0}})
    with pytest.raises(hugetlb.HostInfoUnavailable, match="hugetlb.2MB.limit_in_bytes"):
        hugetlb.read_cgroup(MiB2, str(tmp_path))


def test_node_lists():
    assert numa.parse_nodelist("0\n") == [0]
    assert numa.parse_nodelist("0-3,5,7-8") == [0, 1, 2, 3, 5, 7, 8]
    assert numa.parse_nodelist("") == []
    assert numa.format_nodelist([5, 0, 2, 3, 1, 8, 7]) == "0-3,5,7-8" and numa.format_nodelist([0]) == "0"


def test_nodes_with_memory(tmp_path):
    assert numa.nodes_with_memory(str(tmp_path)) == [0]  # no NUMA in the kernel: one node holds everything
    put(tmp_path, "/sys/devices/system/node/has_memory", "0,2-3\n")
    assert numa.nodes_with_memory(str(tmp_path)) == [0, 2, 3]
    assert 0 in numa.nodes_with_memory()  # this host's


NUMA_MAPS = """\
55d7a0130000 default file=/usr/bin/head mapped=2 N0=2 kernelpagesize_kB=4
7f5740400000 interleave:0-1 file=/memfd:pled.3.ples\\040int4\\040(deleted) huge dirty=4 N0=2 N1=2 \
kernelpagesize_kB=2048
7f5740c00000 bind:1 file=/memfd:pled.3.ples\\040int4\\040(deleted) huge
7f5750000000 prefer:0 file=/memfd:pled.4.x\\075y\\040(deleted) dirty=3 active=0 N0=3 kernelpagesize_kB=4
7ffd1c1e5000 default stack anon=3 dirty=3 N0=3 kernelpagesize_kB=4
"""


def test_numa_maps_as_the_kernel_writes_it(tmp_path):
    put(tmp_path, "/proc/77/numa_maps", NUMA_MAPS)
    maps = numa.read_numa_maps(77, str(tmp_path))
    assert [m.policy for m in maps] == ["default", "interleave:0-1", "bind:1", "prefer:0", "default"]
    region = numa.memfd_mappings("pled.3.ples int4", 77, str(tmp_path))  # the name's space written \040
    assert [(m.start, m.huge, m.pages, m.page_size) for m in region] == \
        [(0x7F5740400000, True, {0: 2, 1: 2}, MiB2), (0x7F5740C00000, True, {}, None)]
    assert region[0].bytes_per_node == {0: 2 * MiB2, 1: 2 * MiB2}
    assert numa.mapping_policy(0x7F5750000000, 77, str(tmp_path)).file == "/memfd:pled.4.x=y (deleted)"
    assert numa.memfd_mappings("pled.3", 77, str(tmp_path)) == []  # a name is matched whole
    assert numa.mapping_policy(0x1000, 77, str(tmp_path)) is None


def test_a_bad_policy_is_the_kernels_error():
    with pytest.raises(numa.NumaError) as err:
        numa.set_mempolicy(numa.MPOL_BIND, [1000])  # no such node
    assert err.value.errno == errno.EINVAL
    assert numa.get_mempolicy() == (numa.MPOL_DEFAULT, [])


@pytest.mark.parametrize("tightest", ["/kubepods/pod1", "/kubepods", "/kubepods/pod1/pled"])
def test_the_binding_hugetlb_level_is_the_tightest_on_the_path_not_ours_nor_the_first(tmp_path, tightest):
    """Issue 48 class 9: a limit on a parent cgroup tighter than pled's own binds (and one tighter below it does not
    hide it); each level's headroom is the lesser of its fault and its reservation limits. Three levels limited, the
    tightest moved from the middle to the top to pled's own: the binding level and the room follow it."""
    headroom = {"/kubepods/pod1/pled": 12, "/kubepods/pod1": 9, "/kubepods": 10}
    headroom[tightest] = 3
    levels = {"/": {"hugetlb.2MB.limit_in_bytes": UNLIMITED, "hugetlb.2MB.usage_in_bytes": 0}}
    for path, room in headroom.items():  # 5 pages used at each level; the reservation limit binds at pod1
        levels[path] = {"hugetlb.2MB.limit_in_bytes": (room + 5 + (4 if path == "/kubepods/pod1" else 0)) * MiB2,
                        "hugetlb.2MB.usage_in_bytes": 5 * MiB2,
                        "hugetlb.2MB.rsvd.limit_in_bytes": (room + 5) * MiB2 if path == "/kubepods/pod1" else UNLIMITED,
                        "hugetlb.2MB.rsvd.usage_in_bytes": 5 * MiB2}
    pools(tmp_path, **{"hugepages-2048kB": (64, 64, 0, 0, 0)})
    v1_tree(tmp_path, "/kubepods/pod1/pled", levels)
    cg = hugetlb.read_cgroup(MiB2, str(tmp_path))
    assert [(lv.path, lv.headroom // MiB2) for lv in cg.limited] == [(p, headroom[p]) for p in
                                                                      ("/kubepods/pod1/pled", "/kubepods/pod1",
                                                                       "/kubepods")]
    assert cg.binding.path == tightest and cg.binding.headroom == 3 * MiB2
    assert hugetlb.pool(MiB2, str(tmp_path)).available == 3 * MiB2  # 64 pages free in the pool: the cgroup decides
