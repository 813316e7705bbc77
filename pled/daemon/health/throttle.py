"""Log lines that could repeat without end (a flood of clients, a bug hit on every call): a budget per key.

One mechanism, two uses: ``Budget`` for lines each worth reading until there are too many (64 at once, then one
a second: a client attached), ``Throttle`` for lines that say the same thing again (one a minute)."""
from __future__ import annotations

import time

EVERY = 60.0


class Budget:
    """``log(key, logger.method, fmt, *args)`` writes up to ``burst`` lines for ``key`` at once, then ``rate`` a
    second; the next line written for that key says how many were held back meanwhile."""

    def __init__(self, burst: int = 64, rate: float = 1.0) -> None:
        self.burst = burst
        self.rate = rate
        # key -> (lines it may write now, when that was worked out, lines held back since, when one was last written)
        self._state: dict = {}

    def log(self, key, emit, fmt: str, *args, **kw) -> bool:
        now = time.monotonic()
        left, then, held, written = self._state.get(key, (self.burst, now, 0, now))
        left = min(self.burst, left + (now - then) * self.rate)
        if left < 1:
            self._state[key] = (left, now, held + 1, written)
            return False
        if len(self._state) > 1024:  # keys carry peers' uids or method names: keep the table small
            self._state.clear()
        self._state[key] = (left - 1, now, 0, now)
        if held:
            fmt, args = fmt + self._held_note, (*args, *self._held_args(held, now - written))
        emit(fmt, *args, **kw)
        return True

    _held_note = " (%d more like it held back: at most %d at once, then %g a second)"

    def _held_args(self, held: int, since: float) -> tuple:
        return held, self.burst, self.rate


class Throttle(Budget):
    """One line per key every ``every`` seconds at most (a budget of one, refilled once a period); the next line
    for that key says how many were held back in the time since the last."""

    def __init__(self, every: float = EVERY) -> None:
        super().__init__(burst=1, rate=1 / every)
        self.every = every

    _held_note = " (%d more like it in the last %.0f s)"

    def _held_args(self, held: int, since: float) -> tuple:
        return held, since
