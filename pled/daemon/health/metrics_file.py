"""The metrics file (config ``metrics_file``): pled's metrics for node exporter's textfile collector.

The loop makes a snapshot of Status, without the stat of the source files that a hung file system could hold
(``snapshot``), on each turn that follows a change: one it is told of (``changed``: a staging ended, a client
attached or left, a reload put a config in force) or a count (``Counters.version``), at most every MIN_GAP so a
burst of clients makes one file, and at least every ``metrics_interval`` seconds. A thread of its own renders the
newest snapshot (pled/shared/metrics.py) and writes it:

    .<name>.tmp beside the file, mode 0644 set by pled (the unit's UMask=0077 would give 0600, and node exporter
    runs as another user), written, fsync'd, then renamed over the file: a reader sees the old file or the new
    one, never half of one. prometheus_client's write_to_textfile renames too but leaves the mode to the umask.

The loop never waits for the writer: one that hangs (a file system that stops answering) only lags, and is handed
the newest snapshot when it comes back. At stop the writer gets a last snapshot (a table whose first staging failed,
the final counts) and JOIN_SECONDS, and is then left behind, named in the log.
A file that cannot be written (a missing or read-only directory, a full disk, something not a regular file planted
at the temporary name) is said once: one warning naming it and why (again only if the reason changes), and Status's
``daemon.metrics_file_error`` until it is written again, which is one line too; pled serves on either way. The
temporary file is opened without following a symlink and without blocking (``O_NONBLOCK``: a FIFO planted there by
whoever may write the directory would block ``open(O_WRONLY)`` until a reader came), then checked with ``fstat`` to
be a regular file; whatever was at the name is removed after a failed write, so the next write can succeed.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable

from pled.daemon.health.counters import Counters
from pled.daemon.health.throttle import Throttle
from pled.shared import metrics
from pled.shared.errors import PledError

log = logging.getLogger(__name__)

MIN_GAP = 0.1  # seconds between two snapshots at least, however often things change
JOIN_SECONDS = 1.0  # at stop, how long to wait for a write under way
MODE = 0o644  # world-readable: node exporter reads it as its own user


def write_atomically(path: str, data: bytes) -> None:
    """``data`` as the file ``path``, mode MODE, by a rename: the file is the old one or the new one, never half."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp")  # not *.prom: the textfile collector skips it
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, MODE)
    except OSError:
        _remove(tmp)  # a symlink (ELOOP) or a FIFO without a reader (ENXIO) planted at pled's own temporary name
        raise
    try:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO with a reader, a socket: never written to
                raise OSError(errno.EINVAL, f"{tmp} is not a regular file (something else put it there; removed)")
            os.fchmod(fd, MODE)  # the umask took bits off the mode open() asked for
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class MetricsFile:
    def __init__(self, path: str | None, interval: float, *, snapshot: Callable[[], dict], counters: Counters) -> None:
        """``snapshot()``: Status without the sources' stat, made in the loop thread; ``counters``: any count is a
        change. ``path`` None: no metrics file."""
        self.path = path
        self.interval = interval
        self._snapshot = snapshot
        self._counters = counters
        self._dirty = True  # something changed since the last snapshot
        self._seen = -1  # counters.version at the last snapshot
        self._last = float("-inf")  # when the last snapshot was made
        self._cond = threading.Condition()
        self._job: tuple[str, dict] | None = None  # the newest snapshot not yet written, and where it goes
        self._closed = False
        self._thread: threading.Thread | None = None
        self._writing: tuple[str, float] | None = None  # (path, since when) of the write under way
        self._throttle = Throttle()  # the writer thread's, for a bug
        self._snapshot_throttle = Throttle()  # the loop's
        self._failing: tuple[str, str] | None = None  # (path, why) of the last write, where it failed

    @property
    def error(self) -> str | None:
        """Why the metrics file cannot be written ("PATH: why"), until it is written again; None while it is."""
        failing = self._failing
        return None if failing is None else f"{failing[0]}: {failing[1]}"

    def configure(self, path: str | None, interval: float) -> None:
        """The settings of a config a reload put in force; the next turn writes the file anew."""
        self.path, self.interval, self._dirty = path, interval, True

    def changed(self) -> None:
        self._dirty = True

    def tick(self, now: float) -> None:
        """A turn of the loop: a snapshot for the writer if something changed or the interval is over."""
        if self.path is None or self._closed:
            return
        since = now - self._last
        fresh = self._dirty or self._counters.version != self._seen
        if since < self.interval and not (fresh and since >= MIN_GAP):
            return
        self._dirty, self._seen, self._last = False, self._counters.version, now
        self._hand()

    def _hand(self) -> None:
        """A snapshot for the writer, which it takes in place of one it has not taken yet (out of date)."""
        if self.path is None:
            return
        try:
            job = (self.path, self._snapshot())
        except Exception as err:  # a bug: logged once a minute, and the rest of the loop's turn goes on
            self._snapshot_throttle.log("snapshot", log.exception, "the metrics' snapshot failed: %s", err)
            return
        with self._cond:
            self._job = job
            self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pled-metrics", daemon=True)
            self._thread.start()

    # -- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                job, self._job = self._job, None
                if job is None:  # closed, and the last snapshot written
                    return
                self._writing = (job[0], time.monotonic())
            try:
                self._write(*job)
            finally:
                self._writing = None

    def _write(self, path: str, status: dict) -> None:
        try:
            write_atomically(path, metrics.render(status))
        except (OSError, PledError) as err:  # PledError: prometheus-client is not installed
            why = getattr(err, "strerror", None) or str(err)
            if self._failing != (path, why):  # said once (Status keeps saying it): again only for another reason
                log.warning("cannot write the metrics file %s: %s; serving on, and trying again at each change and "
                            "every %g s", path, why, self.interval)
            self._failing = (path, why)
            return
        except Exception as err:  # a bug: the same one line a minute, never a dead writer
            self._failing = (path, f"{type(err).__name__}: {err}")
            self._throttle.log((path, type(err).__name__), log.exception, "writing the metrics file %s failed: %s",
                               path, err)
            return
        if self._failing is not None and self._failing[0] == path:
            self._failing = None
            log.info("metrics file %s written again", path)

    # -- at stop -----------------------------------------------------------------------------

    def close(self, timeout: float = JOIN_SECONDS) -> None:
        """At stop: the last figures written (a table that failed, the final counts), then the writer stops; it
        gets ``timeout`` seconds, then is left behind (a daemon thread). Safe to repeat."""
        if self._closed:
            return
        self._hand()
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is None:
            return
        self._thread.join(timeout)
        writing = self._writing
        if self._thread.is_alive() and writing is not None:
            log.warning("stopping without waiting for the metrics file's writer: it has been writing %s for %.0f s "
                        "(a file system that does not answer?)", writing[0], time.monotonic() - writing[1])
