"""The scheduled verify of a writable table (gpu_access = "writable"): is what sits in its memfd still what pled
staged? Off the loop (a worker thread), throttled.

A writable table is not sealed against writing: the writers its config names map it writable (a GPU without
read-only registration). So pled compares, every ``verify_interval`` seconds, the region with what it recorded when
it staged it: each piece (a shard, or a checkpoint's tensor) against its staging digest (xxh3_128, in the manifest),
and the header and manifest against the copy pled kept of them before the table was served. Where a piece differs,
its bytes are compared with its source file (when the file is still as staged) to name the exact range; else the
piece's whole range is named. The padding between pieces is not compared: nothing reads it.

The throttle (``Throttle``): after each chunk, the thread sleeps as long as it must so that its CPU time stays under
``cpu_share`` of one core and its reads under ``bandwidth`` bytes a second, whichever asks the longer pause.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from pled.shared import region
from pled.shared.boundary import BoundaryError, open_regular
from pled.shared.digests import HEX_LENGTH, new_hasher
from pled.shared.dropbehind import DropBehind

CHUNK = 4 * 1024 * 1024  # bytes hashed between two looks at the throttle and the stop flag


class Stopped(Exception):
    """pled is stopping: the verify ended between two chunks."""


@dataclass(frozen=True)
class Difference:
    """Bytes [start, end) of the region are not what pled staged; ``what``: the piece (or "header")."""

    start: int
    end: int
    what: str


@dataclass(frozen=True)
class Outcome:
    differences: tuple[Difference, ...]
    bytes_read: int
    seconds: float  # wall time, pauses included
    cpu_seconds: float


class Throttle:
    """Keeps a thread's CPU time under ``cpu_share`` of one core and its reads under ``bandwidth`` bytes/s."""

    def __init__(self, cpu_share: float, bandwidth: int, should_stop: Callable[[], bool] = lambda: False,
                 sleep: Callable[[float], object] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self.cpu_share = cpu_share
        self.bandwidth = bandwidth
        self.should_stop = should_stop
        self.sleep, self.clock, self.cpu_clock = sleep, clock, cpu_clock
        self.start_wall = clock()
        self.start_cpu = cpu_clock()
        self.done = 0
        self.paused = 0.0  # seconds slept, all told

    def account(self, nbytes: int) -> None:
        """``nbytes`` were read and hashed: pause as the share and the bandwidth say; Stopped if pled is stopping."""
        self.done += nbytes
        wall = self.clock() - self.start_wall
        cpu = self.cpu_clock() - self.start_cpu
        pause = max(cpu / self.cpu_share, self.done / self.bandwidth) - wall
        if pause > 0:
            self.paused += pause
            self.sleep(pause)
        if self.should_stop():
            raise Stopped("pled is stopping")


def _read(fd: int, offset: int, size: int, buffer: memoryview) -> memoryview:
    n = os.preadv(fd, [buffer[:size]], offset)
    if n != size:
        raise OSError(f"the region ended at byte {offset + n} while it was verified")
    return buffer[:size]


def _first_last(a: memoryview, b: bytes | memoryview) -> tuple[int, int]:
    """The first and last index where ``a`` and ``b`` (same length, known to differ) differ."""
    lo = next(i for i in range(len(a)) if a[i] != b[i]) if len(a) <= 4096 else _narrow(a, b, True)
    hi = next(i for i in range(len(a) - 1, -1, -1) if a[i] != b[i]) if len(a) <= 4096 else _narrow(a, b, False)
    return lo, hi


def _narrow(a: memoryview, b, first: bool) -> int:
    lo, hi = 0, len(a)
    while hi - lo > 4096:  # by halves, comparing slices in C
        mid = (lo + hi) // 2
        left_differs = a[lo:mid] != b[lo:mid]
        right_differs = a[mid:hi] != b[mid:hi]
        if (first and left_differs) or (not first and not right_differs):
            hi = mid
        else:
            lo = mid
    rng = range(lo, hi) if first else range(hi - 1, lo - 1, -1)
    return next(i for i in rng if a[i] != b[i])


def verify(fd: int, manifest: region.Manifest, header: bytes, throttle: Throttle) -> Outcome:
    """Compare the region in ``fd`` with its staging digests and ``header`` (bytes [0, len(header)) as staged)."""
    start, cpu0 = time.monotonic(), time.thread_time()
    buffer = memoryview(bytearray(CHUNK))
    found: list[Difference] = []
    done = 0
    for offset in range(0, len(header), CHUNK):  # the header and manifest: the copy pled kept
        size = min(CHUNK, len(header) - offset)
        got = _read(fd, offset, size, buffer)
        want = memoryview(header)[offset: offset + size]
        if got != want:
            lo, hi = _first_last(got, want)
            found.append(Difference(offset + lo, offset + hi + 1, "header"))
        done += size
        throttle.account(size)
    shards = manifest.shards
    for p in manifest.pieces():
        algo = p.digest.partition(":")[0]
        if algo not in HEX_LENGTH:
            continue  # not staged by this pled (nothing to compare with); never a writable table's
        hasher = new_hasher(algo)
        for offset in range(p.offset, p.offset + p.nbytes, CHUNK):
            size = min(CHUNK, p.offset + p.nbytes - offset)
            hasher.update(_read(fd, offset, size, buffer))
            done += size
            throttle.account(size)
        if f"{algo}:{hasher.hexdigest()}" != p.digest:
            found.append(_locate(fd, p, shards[p.file], buffer, throttle))
    return Outcome(tuple(found), done, time.monotonic() - start, time.thread_time() - cpu0)


def _locate(fd: int, piece, shard, buffer: memoryview, throttle: Throttle) -> Difference:
    """The bytes of ``piece`` that differ from its source file (still as staged), else the piece's whole range."""
    whole = Difference(piece.offset, piece.offset + piece.nbytes, piece.name)
    try:
        src = open_regular(shard.path)
    except BoundaryError:
        return whole
    behind = None
    try:
        st = os.fstat(src)
        if (st.st_size, st.st_mtime_ns) != (shard.size, shard.mtime_ns):
            return whole
        # a sidecar's shard is pled's alone; of a checkpoint's file, only what this read brought in is dropped
        behind = DropBehind(src, [(piece.begin, piece.begin + piece.nbytes)], shard.path,
                            everything=piece.begin == 0 and piece.nbytes == shard.size)
        first = last = -1
        for at in range(0, piece.nbytes, CHUNK):
            size = min(CHUNK, piece.nbytes - at)
            data = os.pread(src, size, piece.begin + at)
            if len(data) != size:
                return whole
            behind.read(piece.begin + at, piece.begin + at + size)
            got = _read(fd, piece.offset + at, size, buffer)
            if got != data:
                lo, hi = _first_last(got, data)
                first = at + lo if first < 0 else first
                last = at + hi
            throttle.account(size)
    except OSError:
        return whole
    finally:
        if behind is not None:
            behind.close()
        os.close(src)
    if first < 0:  # the file now matches what the region holds: the digest is what differs; name the piece
        return whole
    return Difference(piece.offset + first, piece.offset + last + 1, piece.name)
