"""Huge-page pools and the v1 hugetlb cgroup controller for the tests that need real ones: each is set up for one
test and put back as it was whatever happens, then checked unchanged (as the PID 1 test checks the host's settings).

    with reserve(4) as given:              # 4 more 2 MiB pages in the pool; given: how many the kernel found
    with hugetlb_cgroup_v1(tmp_path) as cg:  # the controller mounted at tmp_path/..., unmounted after
        child = cg.child("pod", {MiB2: 0})   # a child cgroup with hugetlb.2MB.limit_in_bytes = 0
        cg.run_in(child, action)             # action() in a forked process in that cgroup
"""
import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

MiB2 = 2 * 1024 * 1024
GiB1 = 1024 * 1024 * 1024
HUGEPAGES = Path("/sys/kernel/mm/hugepages")


def size_dir(page_size: int) -> Path:
    return HUGEPAGES / f"hugepages-{page_size // 1024}kB"


def host_settings() -> dict[str, str]:
    """What a test may change and must put back: every pool's size and overcommit, /proc/meminfo's HugePages_*
    lines, and where the hugetlb controller is bound (/proc/cgroups) and mounted."""
    out = {}
    for d in sorted(HUGEPAGES.glob("hugepages-*")):
        for name in ("nr_hugepages", "nr_overcommit_hugepages", "surplus_hugepages"):
            out[f"{d.name}/{name}"] = (d / name).read_text().strip()
    out["meminfo"] = " ".join(line for line in Path("/proc/meminfo").read_text().splitlines()
                              if line.startswith(("HugePages_Total", "HugePages_Surp", "Hugetlb:")))
    out["hugetlb hierarchy"] = str(_hugetlb_cgroups()[0])  # its cgroup count moves with others' v2 cgroups
    out["mounts"] = " ".join(line.split(" - ")[0].split()[4] for line in Path("/proc/self/mountinfo").read_text()
                             .splitlines() if " - cgroup " in line and "hugetlb" in line.split(" - ")[1])
    return out


@pytest.fixture(autouse=True, scope="module")
def host_unchanged():
    """For a test module that imports it: every pool, /proc/meminfo's HugePages_* and the hugetlb controller's
    binding and mounts as they were before its tests."""
    if os.geteuid() != 0:
        yield
        return
    before = host_settings()
    yield
    assert host_settings() == before, "a hugetlb setting of the host changed"


def _wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class PoolUnavailable(Exception):
    """The pool cannot be raised here (no root, no such page size, the write refused); nothing was changed."""


@contextlib.contextmanager
def raised_pool(pages: int, page_size: int) -> Iterator[int]:
    """``pages`` more pages of ``page_size`` in the pool (nr_hugepages raised as root); yields how many the kernel
    gave (0 and up: it may not find contiguous memory). PoolUnavailable before anything changes where it cannot.
    Afterwards nr_hugepages is put back and read back equal (pages still held by a process that has not yet
    exited stay as surplus until freed: waited for); RuntimeError where it is not. For tests (``reserve``) and
    for bench/hugepages.py alike: no pytest here."""
    if os.geteuid() != 0:
        raise PoolUnavailable("needs root to change nr_hugepages")
    path = size_dir(page_size) / "nr_hugepages"
    if not path.exists():
        offered = ", ".join(d.name for d in sorted(HUGEPAGES.glob("hugepages-*"))) or "none"
        raise PoolUnavailable(f"the kernel offers no {page_size // 1024} kB pages (it offers: {offered})")
    original = path.read_text().strip()
    try:
        try:
            path.write_text(str(int(original) + pages))
        except OSError as err:
            raise PoolUnavailable(f"cannot raise {path}: {err.strerror}") from err
        yield int(path.read_text()) - int(original)
    finally:
        path.write_text(original)
        if not _wait(lambda: path.read_text().strip() == original, 10):
            raise RuntimeError(f"{path} not back to {original} (reads {path.read_text().strip()}): pages in use?")


@contextlib.contextmanager
def reserve(pages: int, page_size: int = MiB2) -> Iterator[int]:
    """``raised_pool`` for a test: skips (with the reason) where the pool cannot be raised or the kernel gave
    no page. Every fd holding pages must be closed by the end."""
    from harness import require_marker  # here, not at the top: bench/hugepages.py imports this module too

    require_marker("root", "changes the host's nr_hugepages")
    try:
        with raised_pool(pages, page_size) as given:
            if given <= 0:
                pytest.skip(f"this host gave 0 of {pages} pages of {page_size // 1024} kB asked (no contiguous memory)")
            yield given
    except PoolUnavailable as err:
        pytest.skip(str(err))


def run_forked(action: Callable[[], object], cgroup: Path | None = None) -> str:
    """``action()`` in a forked child, first moved into ``cgroup``: tests/forked.py's ``in_child``."""
    from forked import in_child  # here, not at the top: bench/hugepages.py imports this module too

    def join() -> None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    return in_child(action, before=None if cgroup is None else join)


class HugetlbCgroupV1:
    """The v1 hugetlb hierarchy mounted for one test, and the children made in it."""

    def __init__(self, mountpoint: Path):
        self.root = mountpoint
        self.children: list[Path] = []

    def child(self, name: str, limits: dict[int, int]) -> Path:
        """A child cgroup with ``hugetlb.<size>.limit_in_bytes`` set per page size."""
        d = self.root / name
        d.mkdir()
        self.children.append(d)
        for page_size, limit in limits.items():
            (d / f"hugetlb.{size_name(page_size)}.limit_in_bytes").write_text(str(limit))
        return d

    def run_in(self, child: Path, action: Callable[[], object]) -> str:
        return run_forked(action, child)

    def usage(self, child: Path, page_size: int = MiB2) -> int:
        return int((child / f"hugetlb.{size_name(page_size)}.usage_in_bytes").read_text())


def size_name(page_size: int) -> str:
    return f"{page_size >> 30}GB" if page_size >= 1 << 30 else f"{page_size >> 20}MB"


def _hugetlb_cgroups() -> tuple[int, int]:
    """(hierarchy id, number of cgroups) of the hugetlb controller in /proc/cgroups: hierarchy 0 when no v1
    hierarchy has it."""
    for line in Path("/proc/cgroups").read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == "hugetlb":
            return int(fields[1]), int(fields[2])
    return 0, 0


@contextlib.contextmanager
def hugetlb_cgroup_v1(tmp: Path) -> Iterator[HugetlbCgroupV1]:
    """The v1 hugetlb controller mounted under ``tmp`` for one test. Afterwards every process still in a child
    goes back to the root, the children are removed, the hierarchy unmounted, and /proc/cgroups shows the
    controller bound where it was (a v1 hierarchy outlives its umount while a removed child is still dying: this
    waits for that, and mounts and unmounts once more if it lingers)."""
    from harness import require_marker

    require_marker("root", "mounts a cgroup hierarchy")
    if os.geteuid() != 0:
        pytest.skip("needs root to mount the hugetlb cgroup controller")
    before = _hugetlb_cgroups()
    if before == (0, 0):
        pytest.skip("this kernel has no hugetlb cgroup controller")
    mountpoint = tmp / "hugetlb-cgroup"
    mountpoint.mkdir()
    done = subprocess.run(["mount", "-t", "cgroup", "-o", "hugetlb", "none", str(mountpoint)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        mountpoint.rmdir()
        pytest.skip(f"cannot mount the v1 hugetlb controller (in use by cgroup v2?): {done.stderr.strip()}")
    cg = HugetlbCgroupV1(mountpoint)
    try:
        yield cg
    finally:
        for d in reversed(cg.children):
            for pid in (d / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError, OSError):
                    (mountpoint / "cgroup.procs").write_text(pid)
            assert _wait(lambda d=d: _rmdir(d), 5), f"{d} could not be removed"
        if before[0] == 0:  # ours alone: wait for the removed children to be gone before the hierarchy goes
            _wait(lambda: _hugetlb_cgroups()[1] <= 1, 5)
        subprocess.run(["umount", str(mountpoint)], check=True)
        if before[0] == 0 and not _wait(lambda: _hugetlb_cgroups()[0] == 0, 2):
            subprocess.run(["mount", "-t", "cgroup", "-o", "hugetlb", "none", str(mountpoint)], check=True)
            subprocess.run(["umount", str(mountpoint)], check=True)
        mountpoint.rmdir()
        assert _wait(lambda: _hugetlb_cgroups()[0] == before[0], 2), \
            f"the hugetlb controller is still bound to hierarchy {_hugetlb_cgroups()[0]}, was {before[0]}"


def _rmdir(d: Path) -> bool:
    try:
        d.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True
