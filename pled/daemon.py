"""``pled serve``: preflight, stage every table, then hold the regions until SIGTERM.

Signal handlers only record the signal; the loop does the work (as gunicorn's
arbiter does). Serving the regions to clients plugs into the same loop.
"""
from __future__ import annotations

import logging
import os
import selectors
import signal
import time

import psutil

from . import preflight, region, staging
from .config import Config
from .errors import ConfigError
from .sidecar import Sidecar, open_table
from .sizes import gib, rate

log = logging.getLogger(__name__)


def open_tables(config: Config) -> dict[str, Sidecar]:
    if not config.tables:
        raise ConfigError(config.source, "no [[table]] configured; add one with a name and a path")
    return {t.name: open_table(t.path) for t in config.tables}


def run_preflight(config: Config, sidecars: dict[str, Sidecar], proc_root: str = "/") -> preflight.Verdict:
    needs = {name: region.plan(name, s).region_bytes for name, s in sidecars.items()}
    return preflight.check(needs, config.headroom_margin, proc_root)


class Daemon:
    def __init__(self, config: Config, *, proc_root: str = "/", sys_root: str = "/") -> None:
        self.config = config
        self.proc_root = proc_root
        self.sys_root = sys_root
        self.regions: dict[str, staging.Region] = {}
        self._signals: list[int] = []
        self._started = time.monotonic()

    # Signal handlers record; the loop acts.
    def _on_signal(self, signum: int, frame) -> None:
        self._signals.append(signum)

    @property
    def stopping(self) -> bool:
        return any(s in (signal.SIGTERM, signal.SIGINT) for s in self._signals)

    def run(self) -> int:
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old_wakeup = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            log.info("pled %d starting with %s: %d table(s)", os.getpid(), self.config.source, len(self.config.tables))
            self._stage_all()
            if not self.stopping:
                self._serve(rfd)
            log.info("stopping: releasing %d table(s) (%s)", len(self.regions),
                     gib(sum(r.manifest.region_bytes for r in self.regions.values())))
            return 0
        except staging.StagingCancelled as err:
            log.info("%s; stopping", err)
            return 0
        finally:
            for r in self.regions.values():
                r.close()
            for s, handler in old.items():
                signal.signal(s, handler)
            signal.set_wakeup_fd(old_wakeup)
            os.close(rfd)
            os.close(wfd)

    def _stage_all(self) -> None:
        sidecars = open_tables(self.config)
        verdict = run_preflight(self.config, sidecars, self.proc_root)
        for problem in verdict.problems:
            log.warning("preflight could not read %s", problem)
        if verdict.ok:
            log.info("%s", verdict.message)
        else:
            log.error("%s", verdict.message)
        verdict.raise_if_refused()
        for name, sidecar in sidecars.items():
            n = len(sidecar.shards)

            def on_shard(shard, offset, seconds, name=name, n=n):
                log.info("table %s: shard %d/%d %s %s in %.0f ms (%s)", name, shard.index + 1, n, shard.name,
                         gib(shard.size), seconds * 1000, rate(shard.size, seconds))

            r = staging.stage(name, sidecar, huge_pages=self.config.huge_pages, sys_root=self.sys_root,
                              on_shard=on_shard, should_stop=lambda: self.stopping)
            self.regions[name] = r
            log.info("%s", staging.describe_ready(r))

    def _serve(self, wakeup_fd: int) -> None:
        total = sum(r.manifest.region_bytes for r in self.regions.values())
        rss = psutil.Process().memory_info().rss
        log.info("ready: %d table(s), %s in sealed memfds, staged in %.1f s; pled's own memory %s RSS",
                 len(self.regions), gib(total), time.monotonic() - self._started, gib(rss))
        with selectors.DefaultSelector() as sel:
            sel.register(wakeup_fd, selectors.EVENT_READ)
            while not self.stopping:
                for key, _ in sel.select(timeout=None):
                    if key.fd == wakeup_fd:
                        self._drain(wakeup_fd)

    def _drain(self, wakeup_fd: int) -> None:
        try:
            while os.read(wakeup_fd, 512):
                pass
        except BlockingIOError:
            pass
        while self._signals and self._signals[0] == signal.SIGHUP:
            self._signals.pop(0)
            log.info("SIGHUP: nothing to reload yet; tables stay as they are")
