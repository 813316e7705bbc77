"""The daemon's loop: one selector in the main thread, and nothing but a signal can end it.

The Loop alone holds the selector: whoever wants to hear of an fd (the signal pipe, the stager's event pipe,
the server's listener and connections) asks the Loop to ``watch`` it, with a callback that gets the ready
events; ``want`` changes which events, ``unwatch`` stops. A callback that raises is logged (once a minute for
the same fault) and the loop goes on, as does a tick that raises. The server guards its own connections the
same way, so one client's trouble ends that client's connection, not the loop.
"""
from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections.abc import Callable

from pled.daemon.health.throttle import Throttle
from pled.shared.boundary import clip

log = logging.getLogger(__name__)

READ = selectors.EVENT_READ
WRITE = selectors.EVENT_WRITE
Callback = Callable[[int], None]  # called with the events that are ready (READ, WRITE)


def drain(fd: int) -> None:
    """Read a non-blocking wakeup pipe empty."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


class Loop:
    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()  # owns the epoll fd until close()
        self._throttle = Throttle()
        self._closed = False

    def watch(self, fileobj, callback: Callback, events: int = READ) -> None:
        self._sel.register(fileobj, events, callback)

    def want(self, fileobj, events: int) -> None:
        """Watch ``fileobj`` (already watched) for ``events`` from now on."""
        key = self._sel.get_key(fileobj)
        if key.events != events:
            self._sel.modify(fileobj, events, key.data)

    def unwatch(self, fileobj) -> None:
        self._sel.unregister(fileobj)

    def run(self, stop: threading.Event, interval: float, tick: Callable[[float], None]) -> None:
        """Dispatch ready fds and call ``tick(now)`` at least every ``interval`` seconds, until ``stop`` is set."""
        while not stop.is_set():
            for key, mask in self._sel.select(timeout=interval):
                self._guarded(key.data, mask)
                if stop.is_set():
                    break
            self._guarded(lambda _mask: tick(time.monotonic()), 0)

    def _guarded(self, callback: Callback, mask: int) -> None:
        try:
            callback(mask)
        except Exception as err:  # the loop's boundary: log it, keep serving
            where = getattr(callback, "__qualname__", "callback")
            self._throttle.log((where, type(err).__name__), log.exception, "the loop caught %s in %s: %s; serving on",
                               type(err).__name__, where, clip(err))

    def close(self) -> None:
        """Close the selector; safe to repeat."""
        if not self._closed:
            self._closed = True
            self._sel.close()
