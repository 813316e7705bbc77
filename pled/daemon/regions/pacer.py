"""Staging's pace: the chunk it copies (and drops from the page cache) at a time, and the config's
``staging_bandwidth``, so that pled does not take the whole disk from a vLLM that is loading its checkpoint."""
from __future__ import annotations

import time
from collections.abc import Callable

from pled.shared import hugepages

CHUNK = 64 * 1024 * 1024


class Pacer:
    """Holds staging to ``bandwidth`` bytes/s on average (the config's staging_bandwidth), so that
    pled does not take the whole disk from a vLLM that is loading its checkpoint meanwhile."""

    def __init__(self, bandwidth: int | None, should_stop: Callable[[], bool], chunk: int = CHUNK) -> None:
        self.bandwidth = bandwidth
        self.should_stop = should_stop
        # A whole number of huge pages: the page cache holds files in folios of up to 2 MiB, and dropping a
        # chunk's pages leaves any folio that runs past either end of it.
        chunk = chunk if not bandwidth else min(chunk, bandwidth // 8)
        self.chunk = max(hugepages.PMD_SIZE, chunk // hugepages.PMD_SIZE * hugepages.PMD_SIZE)
        self._start = time.monotonic()
        self._done = 0

    def account(self, nbytes: int) -> None:
        if not self.bandwidth:
            return
        self._done += nbytes
        due = self._start + self._done / self.bandwidth
        while not self.should_stop():
            left = due - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))
