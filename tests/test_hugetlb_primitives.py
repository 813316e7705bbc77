"""Issue 21's groundwork against the real kernel: reserved huge-page pools (tests/hugepool.py raises nr_hugepages for
each test and puts it back), hugetlb memfds, their residency, the v1 hugetlb cgroup controller (mounted for the test),
and NUMA policies read back from numa_maps. No mocks: real memfds, pools, cgroups and processes."""
import errno
import faulthandler
import fcntl
import hashlib
import json
import mmap
import os
import subprocess
import sys
import time

import pytest

from hugepool import (
    GiB1,
    MiB2,
    host_unchanged,  # noqa: F401 (an autouse fixture: the host as it was, checked)
    hugetlb_cgroup_v1,
    reserve,
    run_forked,
)
from pled.daemon.memory import hugetlb, numa
from pled.shared import region
from pled.shared.pagecache import cached_bytes_fd, is_hugetlb, mapping_address, page_size

pytestmark = pytest.mark.root
SEALS = region.SEALS


def fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def pool2m() -> hugetlb.Pool:
    p = hugetlb.pool(MiB2)
    assert p is not None
    return p


def sealed(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)


def test_pool_figures_are_the_kernels():
    """/proc/meminfo's HugePages_* (the default size, 2 MiB here) against the pool read from /sys, as pages come
    and go."""
    if hugetlb.pool(MiB2) is None:
        pytest.skip("no 2 MiB huge pages on this kernel")
    with reserve(4) as given:
        def meminfo():
            lines = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines())
            return [int(lines[k].split()[0]) for k in ("HugePages_Total", "HugePages_Free", "HugePages_Rsvd",
                                                       "HugePages_Surp")]
        p = pool2m()
        assert [p.total, p.free, p.reserved, p.surplus] == meminfo()
        fd = hugetlb.create("pool-check", MiB2, MiB2)
        try:
            q = pool2m()
            assert [q.total, q.free, q.reserved, q.surplus] == meminfo()
            assert q.available_pages == p.available_pages - 1 and q.available == q.available_pages * MiB2
        finally:
            os.close(fd)
        assert pool2m().available_pages == p.available_pages and given >= 1
        assert MiB2 in hugetlb.page_sizes()


def test_create_takes_every_page_at_once_and_rounds_up():
    with reserve(4) as given:
        if given < 3:
            pytest.skip(f"this host gave {given} of 4 pages asked")
        before = pool2m().available_pages
        fd = hugetlb.create("rounded", 2 * MiB2 + 1, MiB2)  # a byte over two pages: three
        try:
            st = os.fstat(fd)
            assert st.st_size == 3 * MiB2 and st.st_blksize == MiB2 and st.st_blocks * 512 == 3 * MiB2
            assert pool2m().available_pages == before - 3  # allocated now, not at the first fault
            assert hugetlb.page_size_of(fd) == MiB2 and page_size(fd) == MiB2 and is_hugetlb(fd)
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
            with pytest.raises(OSError) as err:
                os.ftruncate(fd, 3 * MiB2 + 4096)  # whole pages only
            assert err.value.errno == errno.EINVAL
        finally:
            os.close(fd)
        shm = os.memfd_create("shmem", os.MFD_CLOEXEC)
        try:
            assert os.fstat(shm).st_blksize == 4096 and page_size(shm) == 4096 and not is_hugetlb(shm)
        finally:
            os.close(shm)
        assert pool2m().available_pages == before


def test_a_short_pool_fails_at_once_and_leaves_nothing_behind():
    with reserve(4) as given:
        before, open_fds = pool2m(), fds()
        started = time.monotonic()
        with pytest.raises(hugetlb.NoHugePages) as err:
            hugetlb.create("too-big", (given + 1) * MiB2, MiB2)
        took = time.monotonic() - started
        assert err.value.errno == errno.ENOMEM and took < 1
        assert f"{given + 1} pages of 2MB" in str(err.value) and f"{given} of" in str(err.value)
        assert fds() == open_fds  # the fd was closed
        after = pool2m()
        assert (after.free, after.reserved, after.available_pages) == (before.free, before.reserved, given)


def test_fill_through_a_mapping_is_the_files_bytes(tmp_path):
    src = tmp_path / "shard"
    data = os.urandom(5 * MiB2 // 2 + 12345)
    src.write_bytes(data)
    with reserve(3) as given:
        if given < 3:
            pytest.skip(f"this host gave {given} of 3 pages asked")
        fd = hugetlb.create("fill", 4096 + len(data), MiB2)
        try:
            with pytest.raises(OSError) as err:
                os.pwrite(fd, b"x", 0)  # hugetlbfs has no write path
            assert err.value.errno == errno.EINVAL
            s = os.open(src, os.O_RDONLY)
            try:
                with pytest.raises(OSError):
                    os.sendfile(fd, s, 0, 4096)
                m = hugetlb.map_for_fill(fd, 3 * MiB2)
                hugetlb.copy_into(m, 4096, s, 0, len(data))  # at an offset that is no page's start
                with pytest.raises(EOFError):  # the file ends 10 bytes into 20: those 10 are copied
                    hugetlb.copy_into(m, 3 * MiB2 - 20, s, len(data) - 10, 20)
                m.close()
            finally:
                os.close(s)
            with mmap.mmap(fd, 3 * MiB2, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as r:
                assert r[4096:4096 + len(data)] == data and r[:4096] == bytes(4096)
                assert r[-20:] == data[-10:] + bytes(10)
                assert hashlib.sha256(r[4096:4096 + len(data)]).digest() == hashlib.sha256(data).digest()
        finally:
            os.close(fd)


def test_seals_once_no_writable_mapping_is_left():
    with reserve(1):
        fd = hugetlb.create("seal", MiB2, MiB2)
        try:
            m = hugetlb.map_for_fill(fd, MiB2)
            m[:5] = b"hello"
            with pytest.raises(OSError) as err:
                sealed(fd)  # F_SEAL_WRITE while a writable mapping exists
            assert err.value.errno == errno.EBUSY
            m.close()
            sealed(fd)
            region.check_sealed_memfd(fd)  # what a client checks
            with pytest.raises(PermissionError):
                mmap.mmap(fd, MiB2, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 2 * MiB2)
            with mmap.mmap(fd, MiB2, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as r:
                assert r[:5] == b"hello"
        finally:
            os.close(fd)


def test_residency_counts_pages_without_touching_the_pool():
    with reserve(4) as given:
        if given < 4:
            pytest.skip(f"this host gave {given} of 4 pages asked")
        full = hugetlb.create("full", 2 * MiB2, MiB2)
        part = os.memfd_create("part", hugetlb.memfd_flags(MiB2))  # no fallocate: pages come by fault
        try:
            os.ftruncate(part, 2 * MiB2)
            assert cached_bytes_fd(full) == 2 * MiB2 and cached_bytes_fd(part) == 0
            with mmap.mmap(part, 2 * MiB2, flags=mmap.MAP_SHARED) as m:  # reserves the other two pages
                m[MiB2 + 7] = 1  # one page of two faulted in
            assert pool2m().available_pages == 0  # the pool is full: all four pages allocated or reserved
            before = pool2m()
            assert cached_bytes_fd(part) == MiB2 and cached_bytes_fd(full) == 2 * MiB2
            assert pool2m() == before  # the residency check took nothing, even from a full pool
            with pytest.raises(OSError) as err:  # what the old mincore fallback did: a private mapping reserves
                mmap.mmap(part, 2 * MiB2, access=mmap.ACCESS_COPY)
            assert err.value.errno == errno.ENOMEM
            # A region of allocated pages needs no new reservation: another mapping works on the full pool.
            with mmap.mmap(full, 2 * MiB2, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as r:
                assert r[-1] == 0
            assert pool2m() == before
        finally:
            os.close(full)
            os.close(part)


def fresh_process(fd: int, code: str) -> dict:
    """``code`` in a new interpreter (no mapping inherited by fork) that has ``fd`` as FD; its JSON answer."""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FD": str(fd)}, pass_fds=(fd,),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


MAP_AND_READ = """
import json, mmap, os
from pled.daemon.memory import numa
fd = int(os.environ["FD"])
size = os.fstat(fd).st_size
with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
    touched = sum(m[0:size:4096])
    mine = [x for x in numa.read_numa_maps() if x.file and x.file.startswith(os.readlink(f"/proc/self/fd/{fd}"))]
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    print(json.dumps({"policies": [x.policy for x in mine], "pages": [x.pages for x in mine],
                      "touched": touched, "vmpte": int(status["VmPTE"].split()[0]) * 1024}))
"""


def test_numa_policy_applied_by_mbind_read_back_from_numa_maps():
    """mbind on a region's mapping before its pages are touched; numa_maps shows it here. A shmem memfd keeps it
    (its inode's shared policy): another process's mapping shows it too. A hugetlb memfd does not: there the
    other process sees "default". On this one-node host every page is on node 0 whatever the policy."""
    nodes = numa.nodes_with_memory()
    with reserve(4) as given:
        if given < 2:
            pytest.skip(f"this host gave {given} of 4 pages asked")
        for mode, name in ((numa.MPOL_INTERLEAVE, "interleave"), (numa.MPOL_BIND, "bind")):
            want = f"{name}:{numa.format_nodelist(nodes)}"
            for kind in ("shmem", "hugetlb"):
                label = f"numa-{kind}-{name}"
                fd = (os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING) if kind == "shmem"
                      else os.memfd_create(label, hugetlb.memfd_flags(MiB2)))
                try:
                    os.ftruncate(fd, 2 * MiB2)
                    with hugetlb.map_for_fill(fd, 2 * MiB2) as m:
                        numa.mbind(mapping_address(m), 2 * MiB2, mode, nodes)
                        m[0:2 * MiB2:4096] = b"\1" * (2 * MiB2 // 4096)  # first touch, after the policy
                        here = numa.mapping_policy(mapping_address(m))
                        assert here.policy == want and here.file == f"/memfd:{label} (deleted)"
                        assert sum(here.bytes_per_node.values()) == 2 * MiB2 and set(here.pages) <= set(nodes)
                        assert here.huge == (kind == "hugetlb")
                    sealed(fd)
                    there = fresh_process(fd, MAP_AND_READ)
                    assert there["touched"] == 2 * MiB2 // 4096
                    assert there["policies"] == [want if kind == "shmem" else "default"], (kind, there)
                finally:
                    os.close(fd)


def test_a_thread_policy_does_not_follow_a_memfd():
    """set_mempolicy on the thread that fills a shmem memfd: this thread's numa_maps shows its policy (numa_maps
    falls back to the task's), another process's shows "default": the policy is not the memfd's."""
    nodes = numa.nodes_with_memory()
    fd = os.memfd_create("numa-thread", os.MFD_CLOEXEC)
    try:
        with numa.thread_policy(numa.MPOL_INTERLEAVE, nodes):
            assert numa.get_mempolicy() == (numa.MPOL_INTERLEAVE, nodes)
            os.write(fd, b"\1" * (2 * MiB2))
            with mmap.mmap(fd, 2 * MiB2, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ):
                here = {m.policy for m in numa.memfd_mappings("numa-thread")}
                assert here == {f"interleave:{numa.format_nodelist(nodes)}"}
        assert numa.get_mempolicy() == (numa.MPOL_DEFAULT, [])  # put back
        assert fresh_process(fd, MAP_AND_READ)["policies"] == ["default"]
    finally:
        os.close(fd)
    with reserve(1):  # how a hugetlb region is placed: its fallocate allocates by the thread's policy
        with numa.thread_policy(numa.MPOL_BIND, nodes[:1]):
            fd = hugetlb.create("numa-thread-huge", MiB2, MiB2)
        try:
            assert numa.get_mempolicy() == (numa.MPOL_DEFAULT, [])
            assert fresh_process(fd, MAP_AND_READ)["pages"] == [{str(nodes[0]): 1}]
        finally:
            os.close(fd)


def test_page_tables_of_a_client_on_4k_pages_and_on_2m_pages():
    """VmPTE of a fresh process that maps and reads 64 MiB: 4 KiB shmem pages against 2 MiB hugetlb pages."""
    size = 64 * 1024**2
    with reserve(size // MiB2) as given:
        if given < size // MiB2:
            pytest.skip(f"this host gave {given} of {size // MiB2} pages asked")
        shm = os.memfd_create("pte-shmem", os.MFD_CLOEXEC)
        huge = hugetlb.create("pte-huge", size, MiB2)
        try:
            os.ftruncate(shm, size)
            os.posix_fallocate(shm, 0, size)
            costs = {name: fresh_process(fd, MAP_AND_READ)["vmpte"] for name, fd in (("4k", shm), ("2m", huge))}
        finally:
            os.close(shm)
            os.close(huge)
        print(f"VmPTE after mapping and reading 64 MiB: {costs}")
        # 16384 PTEs of 8 bytes (128 KiB) on 4 KiB pages; 32 PMD entries, in tables the interpreter has anyway.
        assert costs["4k"] - costs["2m"] >= 120 * 1024


def test_hugetlb_cgroup_limits_read_back_and_enforced(tmp_path):
    with reserve(4) as given, hugetlb_cgroup_v1(tmp_path) as cg:
        if given < 3:
            pytest.skip(f"this host gave {given} of 4 pages asked")
        child = cg.child("pled", {MiB2: 2 * MiB2})

        def inside():
            p = hugetlb.pool(MiB2)
            b = p.cgroup.binding
            out = [p.cgroup.version, p.cgroup.path, b.path, b.limit, b.headroom, p.available]
            started = time.monotonic()
            try:
                hugetlb.create("over", 3 * MiB2, MiB2)
                out.append("created")
            except hugetlb.NoHugePages as err:
                out += [err.errno, time.monotonic() - started < 1, "hugetlb cgroup /pled has room for 2" in str(err)]
            fd = hugetlb.create("within", 2 * MiB2, MiB2)
            out.append(hugetlb.pool(MiB2).cgroup.binding.usage)
            os.close(fd)
            return json.dumps(out)

        said = cg.run_in(child, inside)
        assert json.loads(said) == [1, "/pled", "/pled", 2 * MiB2, 2 * MiB2, 2 * MiB2, errno.ENOMEM, True, True,
                                    2 * MiB2], said
        assert cg.usage(child) == 0  # the pages were freed with the fd


def test_a_client_with_no_hugetlb_allowance_reads_a_region_pled_filled(tmp_path):
    """The Kubernetes pod that requests no huge pages: its hugetlb limit is 0, yet it maps and reads a region
    another process (outside the cgroup) filled; the pages are charged to whoever allocated them. Its own
    hugetlb memfd is refused."""
    data = os.urandom(3 * MiB2)
    with reserve(4) as given, hugetlb_cgroup_v1(tmp_path) as cg:
        if given < 3:
            pytest.skip(f"this host gave {given} of 4 pages asked")
        fd = hugetlb.create("filled", len(data), MiB2)
        try:
            with hugetlb.map_for_fill(fd, len(data)) as m:
                m[:] = data
            sealed(fd)
            pod = cg.child("pod", {MiB2: 0})
            before = pool2m()

            def client():
                with mmap.mmap(fd, len(data), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as r:
                    same = hashlib.sha256(r).digest() == hashlib.sha256(data).digest()
                try:
                    hugetlb.create("mine", MiB2, MiB2)
                    own = "created"
                except hugetlb.NoHugePages as err:
                    own = f"refused {err.errno}"
                return f"{same} {hugetlb.pool(MiB2).cgroup.binding.limit} {own}"

            assert cg.run_in(pod, client) == f"True 0 refused {errno.ENOMEM}"
            assert cg.usage(pod) == 0 and pool2m() == before
            # Through a mapping that only reserved (no fallocate), the fault itself is refused: SIGBUS.
            lazy = os.memfd_create("lazy", hugetlb.memfd_flags(MiB2))
            try:
                os.ftruncate(lazy, MiB2)

                def fault():
                    faulthandler.disable()  # the SIGBUS is expected: no traceback on the test's stderr
                    with mmap.mmap(lazy, MiB2, flags=mmap.MAP_SHARED) as m:
                        m[0] = 1
                    return "faulted"

                assert cg.run_in(pod, fault) == "killed by SIGBUS"
            finally:
                os.close(lazy)
        finally:
            os.close(fd)


@pytest.mark.slow
def test_one_gib_pages():
    """A 1 GiB page where the kernel can find one: create, fill a little, seal, read back, release."""
    if hugetlb.pool(GiB1) is None:
        pytest.skip("this kernel offers no 1 GiB pages")
    with reserve(1, GiB1):
        started = time.monotonic()
        fd = hugetlb.create("gib", 5 * MiB2, GiB1)  # rounds up to the one page
        took = time.monotonic() - started
        try:
            assert os.fstat(fd).st_size == GiB1 and os.fstat(fd).st_blksize == GiB1 and page_size(fd) == GiB1
            assert hugetlb.pool(GiB1).available_pages == 0 and cached_bytes_fd(fd) == GiB1
            with hugetlb.map_for_fill(fd, GiB1) as m:
                m[GiB1 - 5:] = b"tail!"
            sealed(fd)
            with mmap.mmap(fd, GiB1, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as r:
                assert r[GiB1 - 5:] == b"tail!" and r[:4] == bytes(4)
            assert run_forked(lambda: cached_bytes_fd(fd)) == str(GiB1)
        finally:
            os.close(fd)
        print(f"a 1 GiB page allocated and zeroed by create in {took * 1000:.0f} ms")
        assert hugetlb.pool(GiB1).available_pages == 1
