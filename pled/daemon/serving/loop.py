"""The daemon's loop: one selector in the main thread, and nothing but a signal can end it.

The Loop alone holds the selector: whoever wants to hear of an fd (the signal pipe, the stager's event pipe,
the server's listener and connections) asks the Loop to ``watch`` it, with a callback that gets the ready
events; ``want`` changes which events, ``unwatch`` stops; ``soon`` leaves work for the next turn, after the fds
ready then (a connection's further calls). A callback that raises is logged (once a minute for
the same fault) and the loop goes on, as does a tick that raises. The server guards its own connections the
same way, so one client's trouble ends that client's connection, not the loop.
"""
from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections import deque
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


def _ignoring_mask(callback: Callable[[], None]) -> Callback:
    def call(_mask: int) -> None:
        callback()

    call.__qualname__ = getattr(callback, "__qualname__", "soon")  # what the loop's log names, where it raises
    return call


class Loop:
    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()  # owns the epoll fd until close()
        self._throttle = Throttle()
        self._closed = False
        self._soon: deque[Callable[[], None]] = deque()  # work left for the next turn (a connection's further calls)

    def watch(self, fileobj, callback: Callback, events: int = READ) -> None:
        self._sel.register(fileobj, events, callback)

    def want(self, fileobj, events: int) -> None:
        """Watch ``fileobj`` (already watched) for ``events`` from now on."""
        key = self._sel.get_key(fileobj)
        if key.events != events:
            self._sel.modify(fileobj, events, key.data)

    def unwatch(self, fileobj) -> None:
        self._sel.unregister(fileobj)

    def soon(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` in the next turn, after the fds ready then: work one turn leaves for the next, so that
        each ready fd (and each connection's next call) gets its turn in between."""
        self._soon.append(callback)

    def run(self, stop: threading.Event, interval: float, tick: Callable[[float], None]) -> None:
        """Dispatch ready fds and call ``tick(now)`` at least every ``interval`` seconds, until ``stop`` is set."""
        while not stop.is_set():
            left = len(self._soon)  # what earlier turns left; what this one leaves waits for the next
            for key, mask in self._sel.select(timeout=0 if left else interval):
                self._guarded(key.data, mask)
                if stop.is_set():
                    break
            for _ in range(left):
                self._guarded(_ignoring_mask(self._soon.popleft()), 0)
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
