"""Log lines that could repeat without end (a flood of clients, a bug hit on every call) at most once a minute."""
from __future__ import annotations

import time

EVERY = 60.0


class Throttle:
    """``log(key, logger.method, fmt, *args)`` writes the line if ``key`` was not logged in the last ``every``
    seconds; the next line for that key says how many were held back meanwhile."""

    def __init__(self, every: float = EVERY) -> None:
        self.every = every
        self._last: dict = {}  # key -> (when logged, lines held back since)

    def log(self, key, emit, fmt: str, *args, **kw) -> bool:
        now = time.monotonic()
        when, held = self._last.get(key, (None, 0))
        if when is not None and now - when < self.every:
            self._last[key] = (when, held + 1)
            return False
        if len(self._last) > 1024:  # keys carry peers' method names: keep the table small
            self._last.clear()
        self._last[key] = (now, 0)
        if held:
            fmt += " (%d more like it in the last %.0f s)"
            args = (*args, held, now - when)
        emit(fmt, *args, **kw)
        return True


class Budget:
    """For lines each worth reading until there are too many (a client attached): ``log(key, ...)`` writes up to
    ``burst`` lines for ``key`` at once, then ``rate`` a second; the next line written says how many were held back."""

    def __init__(self, burst: int = 64, rate: float = 1.0) -> None:
        self.burst = burst
        self.rate = rate
        self._state: dict = {}  # key -> (lines it may write now, when that was worked out, lines held back since)

    def log(self, key, emit, fmt: str, *args, **kw) -> bool:
        now = time.monotonic()
        left, then, held = self._state.get(key, (self.burst, now, 0))
        left = min(self.burst, left + (now - then) * self.rate)
        if left < 1:
            self._state[key] = (left, now, held + 1)
            return False
        if len(self._state) > 1024:  # one key per peer uid: keep the table small
            self._state.clear()
        self._state[key] = (left - 1, now, 0)
        if held:
            fmt += " (%d more like it held back: at most %d at once, then %g a second)"
            args = (*args, held, self.burst, self.rate)
        emit(fmt, *args, **kw)
        return True
