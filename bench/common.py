"""What bench's sections share (bench/__main__.py, hugepages.py, table_gather.py, device/pages.py): the log line,
a quiet machine, and the host settings a benchmark may change and must put back. Imports no other bench module, so
bench's modules import it and never each other's ``__main__`` (the import circle ``__main__`` <-> hugepages <->
table_gather is gone)."""
from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

HUGEPAGES = Path("/sys/kernel/mm/hugepages")
SHMEM = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_busy(seconds: float = 1.0) -> float:
    def sample():
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait
    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1 - (i1 - i0) / max(1, t1 - t0)


def settle(limit: float = 60.0) -> None:
    """Wait until the machine is quiet (kcompactd and khugepaged work on after a huge-page staging)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and cpu_busy() > 0.2:
        pass


class NotMeasured(Exception):
    """Why a column could not be measured on this host (said in the report instead of a figure)."""


def host_settings() -> dict[str, str]:
    """What this benchmark may change and must put back: every pool's size, and shmem_enabled."""
    out = {d.name: (d / "nr_hugepages").read_text().strip() for d in sorted(HUGEPAGES.glob("hugepages-*"))}
    if SHMEM.exists():
        out["shmem_enabled"] = SHMEM.read_text().strip()
    return out


@contextlib.contextmanager
def reserve(pages: int, page_size: int) -> Iterator[int]:
    """tests/hugepool.py's ``raised_pool`` (pools raised, then read back as they were), NotMeasured where the pool
    cannot be raised here."""
    from tests.hugepool import PoolUnavailable, raised_pool

    try:
        with raised_pool(pages, page_size) as given:
            yield given
    except PoolUnavailable as err:
        raise NotMeasured(str(err)) from err


@contextlib.contextmanager
def shmem_enabled(value: str) -> Iterator[str]:
    """shmem_enabled set to ``value`` and put back afterwards, whatever happens (as bench/__main__.py's)."""
    old = next(w[1:-1] for w in SHMEM.read_text().split() if w.startswith("["))
    try:
        SHMEM.write_text(value)
    except OSError as err:
        raise NotMeasured(f"cannot set {SHMEM} to {value} ({err.strerror})") from err
    try:
        yield old
    finally:
        SHMEM.write_text(old)
