"""Why pled's attach dominates section 11 on this machine: pre-faulting a read-only shared mapping of a table's
memfd (what ``Table.populate`` does with MADV_POPULATE_READ once a process) on 4 KiB pages against 2 MiB hugetlb
pages, side by side, interleaved, medians and spread. This host's shmem THP is "never"
(/sys/kernel/mm/transparent_hugepage/shmem_enabled), so pled's regions here are on 4 KiB pages unless huge pages
are reserved; operations.md ("Huge pages") recommends reserving them for large tables.

    python -m bench.attach_pages [--size-gib 2] [--repeats 5]

It reserves the 2 MiB pages it needs (vm.nr_hugepages) for the run and puts the previous figure back after; root."""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

MFD_HUGETLB = 4
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
NR = "/proc/sys/vm/nr_hugepages"


def region(size: int, flags: int) -> int:
    fd = os.memfd_create("pled-attach-bench", os.MFD_CLOEXEC | flags)
    os.ftruncate(fd, size)
    with mmap.mmap(fd, size) as m:
        chunk = b"\1" * (64 << 20)
        for off in range(0, size, len(chunk)):
            m[off:off + len(chunk)] = chunk[:size - off]
    return fd


def populate(fd: int, size: int) -> float:
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
        start = time.perf_counter()
        m.madvise(MADV_POPULATE_READ)
        return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.attach_pages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    size = int(args.size_gib * (1 << 30)) // (2 << 20) * (2 << 20)
    with open(NR) as f:
        before = int(f.read())
    fds = {"4 KiB pages": region(size, 0)}
    try:
        with open(NR, "w") as f:
            f.write(str(before + size // (2 << 20)))
        fds["2 MiB hugetlb pages"] = region(size, MFD_HUGETLB)
        times: dict[str, list[float]] = {k: [] for k in fds}
        for _ in range(args.repeats):
            for name, fd in fds.items():
                times[name].append(populate(fd, size))
    finally:
        for fd in fds.values():
            os.close(fd)
        with open(NR, "w") as f:
            f.write(str(before))
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"pre-faulting a read-only shared mapping of a {size / (1 << 30):.2f} GiB memfd, {args.repeats} runs "
          f"interleaved, load average {load}:")
    for name, ts in times.items():
        print(f"- {name}: {statistics.median(ts):.3f} s median ({min(ts):.3f}-{max(ts):.3f})")


if __name__ == "__main__":
    main()
