"""The daemon's loop: one selector in the main thread, and nothing but a signal can end it.

Each watched fd has a callback; a callback that raises is logged (once a minute for the same fault) and
the loop goes on, as does a tick that raises. The server guards its own connections the same way, so one
client's trouble ends that client's connection, not the loop.
"""
from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from typing import Callable

from pled.shared.boundary import clip
from pled.daemon.throttle import Throttle

log = logging.getLogger(__name__)


def drain(fd: int) -> None:
    """Read a non-blocking wakeup pipe empty."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


class Loop:
    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self._throttle = Throttle()

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        self.sel.register(fd, selectors.EVENT_READ, lambda _mask: callback())

    def run(self, stop: threading.Event, interval: float, tick: Callable[[float], None]) -> None:
        """Dispatch ready fds and call ``tick(now)`` at least every ``interval`` seconds, until ``stop`` is set."""
        while not stop.is_set():
            for key, mask in self.sel.select(timeout=interval):
                self._guarded(key.data, mask)
                if stop.is_set():
                    break
            self._guarded(lambda _mask: tick(time.monotonic()), 0)

    def _guarded(self, callback, mask: int) -> None:
        try:
            callback(mask)
        except Exception as err:  # the loop's boundary: log it, keep serving
            where = getattr(callback, "__qualname__", "callback")
            self._throttle.log((where, type(err).__name__), log.exception, "the loop caught %s in %s: %s; serving on",
                               type(err).__name__, where, clip(err))

    def close(self) -> None:
        self.sel.close()
