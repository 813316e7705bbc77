"""The tables pled holds: each one's state and generation, and how they are reported (Status, STATUS=).

A ``TableState`` is made and changed by the registry (registry.py) in the loop thread, with one exception:
while a staging thread copies the table it counts its progress in the table's ``CopyProgress``, which that
thread alone writes. The state (``State``) follows from both: ready or failed once the registry says so,
else staging once the copy has begun, else waiting.

Status says whether each table's source files are still as staged (``sources``). That is a stat of every
shard, and a file system can hang (an NFS or FUSE mount that stops answering): the stats run in a worker
thread (SourceCheck), one check at a time per table, and the loop waits for one at most SOURCES_WAIT; past
that, Status shows the last answer with its age and how long the check has been waiting.
"""
from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum

from pled import __version__
from pled.daemon.memory import pageplan
from pled.daemon.memory.pageplan import PagePlan
from pled.daemon.sources.checkpoint import Source
from pled.shared import protocol, region
from pled.shared.boundary import clip
from pled.shared.pagecache import cached_bytes_fd
from pled.shared.region import Region
from pled.shared.sizes import gib

log = logging.getLogger(__name__)

SOURCES_WAIT = 0.25  # seconds the loop waits for a check of the sources it started, before Status answers without it
SOURCES_FRESH = 0.5  # seconds an answer is given again without a new check (a flood of Status calls)


def check_sources(shards) -> str:
    """Whether the files a generation was staged from are still there as they were (a worker thread's job)."""
    missing, changed, unreadable = [], [], []
    for s in shards:
        name = clip(os.path.basename(s.path), 80)
        try:
            st = os.stat(s.path)
        except FileNotFoundError:
            missing.append(name)
            continue
        except (OSError, ValueError) as err:  # a directory turned into a file, a symlink loop, ...
            unreadable.append(f"{name} ({getattr(err, 'strerror', None) or err})")
            continue
        if (st.st_size, st.st_mtime_ns) != (s.size, s.mtime_ns):
            changed.append(name)
    parts = [f"{what}: {', '.join(names)}" for what, names in
             (("missing", missing), ("changed", changed), ("unreadable", unreadable)) if names]
    return "; ".join(parts) or "unchanged"


class SourceCheck:
    """check_sources in a thread of its own, at most one at a time: a hung file system holds one thread per
    table, whatever the number of Status calls, and never the loop. An answer whose check began less than
    SOURCES_FRESH ago is given again without a new check: a flood of Status calls starts no thread per call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: tuple[threading.Event, float] | None = None  # (set when done, started)
        self._answer: tuple[str, float, float] | None = None  # the last answer, when it was found, when its check began
        self._done = threading.Event()  # set: what start() returns where a fresh answer needs no check
        self._done.set()

    def start(self, shards) -> tuple[threading.Event, float]:
        """Check now, unless a check is under way or the last answer is fresh: (an event set when the check is done,
        when it started)."""
        with self._lock:
            answer = self._answer
            if self._running is None and answer is not None and time.monotonic() - answer[2] < SOURCES_FRESH:
                return self._done, answer[2]
            if self._running is None:
                self._running = (threading.Event(), time.monotonic())
                threading.Thread(target=self._run, args=(tuple(shards), *self._running), name="pled-sources",
                                 daemon=True).start()
            return self._running

    def _run(self, shards, done: threading.Event, started: float) -> None:
        try:
            answer = check_sources(shards)
        except Exception as err:  # a bug: Status says so rather than waiting for ever
            answer = f"not checked: {type(err).__name__}: {clip(err)}"
        with self._lock:
            self._answer, self._running = (answer, time.monotonic(), started), None
        done.set()

    def result(self, shards) -> str:
        """A fresh answer if one comes within SOURCES_WAIT of its check's start, else the last one and its age."""
        done, started = self.start(shards)
        done.wait(max(0.0, started + SOURCES_WAIT - time.monotonic()))
        with self._lock:
            answer, running = self._answer, self._running
        now = time.monotonic()
        if answer is not None and (running is None or answer[2] >= started):
            return answer[0]
        waiting = f"the check has been waiting {now - running[1]:.0f} s for the file system"
        if answer is None:
            return f"not checked: {waiting}"
        return f"{answer[0]} (checked {now - answer[1]:.0f} s ago; {waiting})"


class State(StrEnum):
    """Where a table is: WAITING (planned) -> STAGING (its copy has begun) -> READY (sealed, served), or FAILED."""

    WAITING = "waiting"
    STAGING = "staging"
    READY = "ready"
    FAILED = "failed"


@dataclass(eq=False)
class CopyProgress:
    """How far a staging thread has copied a table: that thread alone writes it, the loop only reads it."""

    begun: bool = False
    shards_done: int = 0
    bytes_done: int = 0  # bytes copied from the sources by this process

    def shard_copied(self, nbytes: int) -> None:
        self.shards_done += 1
        self.bytes_done += nbytes


@dataclass(eq=False)
class TableState:
    name: str
    sidecar: Source  # its files: a sidecar, or a checkpoint's PLE tables
    manifest: region.Manifest  # as planned; once staged, the region's own (with the content digests)
    generation: int = 1
    origin: str = "staged"  # or "adopted" from systemd's fd store
    copy: CopyProgress = field(default_factory=CopyProgress)
    outcome: State | None = None  # READY or FAILED, set by the registry; None while planned or staging
    region: Region | None = None
    error: str = ""
    resident_share: float | None = None  # at the last check
    resident_bytes: int | None = None  # at the last check (every RESIDENCY_EVERY s, or the first Status)
    resident_at: float = 0.0  # when (time.monotonic())
    source_check: SourceCheck = field(default_factory=SourceCheck, repr=False)
    pages: PagePlan | None = None  # the pages it is staged on, as decided before staging; None when adopted
    _pages_status: tuple | None = field(default=None, init=False, repr=False)  # (region, its page keys in Status)
    # A writable table (gpu_access = "writable"; not write-sealed): its header and manifest as staged, kept before it
    # was served, for the scheduled verify; what the last verify found (``modified``: None while nothing differs).
    header: bytes | None = field(default=None, repr=False)
    modified: dict | None = None  # {"start", "end", "what", "writers": [pids], "found_seconds_ago" at Status}
    modified_at: float = 0.0
    verifies: int = 0  # scheduled verifies ended
    verify_due: float = 0.0  # time.monotonic() of the next one
    verifying: bool = False  # one under way (in a worker thread)
    last_verify: dict | None = None  # {"seconds", "cpu_seconds", "bytes", "at"} of the last one

    @property
    def writable(self) -> bool:
        """Its region is served without the write seal (gpu_access = "writable"): writers may change it."""
        r = self.region
        return r is not None and not r.closed and not region.seals(r.fd) & fcntl.F_SEAL_WRITE

    @property
    def state(self) -> State:
        if self.outcome is not None:
            return self.outcome
        return State.STAGING if self.copy.begun else State.WAITING

    @property
    def shards_done(self) -> int:
        return self.copy.shards_done

    @property
    def bytes_done(self) -> int:
        return self.copy.bytes_done

    def progress(self) -> dict:
        return {
            "table": self.name, "state": self.state.value, "shards_done": self.shards_done,
            "shards": len(self.manifest.shards), "bytes_done": self.bytes_done, "bytes": self.manifest.source_bytes,
        }

    def measure(self) -> int:
        """Bytes of the region in memory now (cachestat on the memfd); kept, with the share, for Status and STATUS=.
        It costs the kernel a walk of the region's pages (35 ms for 4 GiB here), so Status reports the last one."""
        resident = cached_bytes_fd(self.region.fd)
        self.resident_bytes, self.resident_at = resident, time.monotonic()
        self.resident_share = resident / self.manifest.region_bytes
        return resident

    def last_residency(self) -> int:
        """The last measure (measured now where this generation has none yet)."""
        return self.measure() if self.resident_bytes is None else self.resident_bytes

    def pages_status(self, r: Region) -> dict:
        """Status's page and NUMA keys for its region ``r`` (pageplan.status_fields), read from the memfd once."""
        if self._pages_status is None or self._pages_status[0] is not r:
            self._pages_status = (r, pageplan.status_fields(r.fd, self.manifest.region_bytes, r.stats, self.pages))
        return self._pages_status[1]

    def sources(self) -> str:
        """Whether the files this generation was staged from are still there as they were: from a worker
        thread, waited for at most SOURCES_WAIT (the loop never stats a source file itself)."""
        return self.source_check.result(self.manifest.shards)

    def describe(self, sources: bool = True) -> dict:
        """The table in Status; without ``sources`` (the metrics' snapshot) nothing here can block."""
        out = {
            **self.progress(), "origin": self.origin, "layout": self.manifest.layout, "rows": self.manifest.rows,
            "row_width": self.manifest.row_width, "region_bytes": self.manifest.region_bytes,
            "generation": self.generation, "fingerprint": self.manifest.fingerprint,
            "content_digest": self.manifest.content_digest or None, **({"sources": self.sources()} if sources else {}),
            "form": self.manifest.form,
            **({"arrays": [{"prefix": a.prefix, "param": a.param, "dtype": a.dtype, "rows": a.shape[0],
                            "width": a.shape[1], "bytes": a.nbytes} for a in self.manifest.arrays]}
               if self.manifest.arrays else {}),
            "error": self.error or None,
        }
        r = self.region
        if r is not None and not r.closed:
            stats = r.stats
            seconds = stats.seconds if stats else 0.0
            out.update(
                resident_bytes=self.last_residency(),
                resident_measured_seconds_ago=round(time.monotonic() - self.resident_at, 1),
                **self.pages_status(r),  # huge_page_bytes, page_size, page_size_bytes, huge_page_policy, _note, numa
                sealed=region.is_sealed(r.fd),
                staging_seconds=round(stats.seconds, 3) if stats else None,
                staging_bytes_per_second=round(self.manifest.source_bytes / seconds) if seconds else None,
            )
            out["resident_share"] = self.resident_share
            writable = self.writable
            out["gpu_access"] = "writable" if writable else "read-only"
            if writable:
                out["modified"] = self.modified is not None
                if self.modified is not None:
                    out["modification"] = self.modified | {
                        "found_seconds_ago": round(time.monotonic() - self.modified_at, 1)}
                last = self.last_verify
                out["verify"] = {"verifies": self.verifies, **({
                    "last_seconds_ago": round(time.monotonic() - last["at"], 1), "last_seconds": last["seconds"],
                    "last_cpu_seconds": last["cpu_seconds"], "last_bytes": last["bytes"]} if last else {})}
        return out


def check_residency(tables: list[TableState]) -> None:
    for t in tables:
        if t.region is None:
            continue
        t.measure()
        share = t.resident_share
        if share < protocol.FULLY_RESIDENT:
            log.warning("table %s is only %.1f%% resident (%s of %s); its pages were swapped out: set "
                        "MemorySwapMax=0 for pled.service or turn swap off", t.name, share * 100,
                        gib(share * t.manifest.region_bytes), gib(t.manifest.region_bytes))


def serving_line(tables: list[TableState], clients: int) -> str:
    """STATUS= while serving: what is held, how much of it is resident, how many clients."""
    total = sum(t.manifest.region_bytes for t in tables)
    shares = [t.resident_share for t in tables if t.resident_share is not None]
    resident = f", {min(shares):.0%} resident" if shares else ""
    return f"serving {len(tables)} table(s), {gib(total)}{resident}; {clients} client(s)"


def status_reply(*, started: float, socket: str, tables: list[TableState], connections, reload: dict | None,
                 daemon: dict, sources: bool = True) -> dict:
    """The io.pled.Status reply (``daemon``: the daemon's own figures); ``sources=False`` leaves out the stat of
    the source files (the metrics' snapshot)."""
    for t in tables if sources else ():  # every table's check under way at once: one SOURCES_WAIT at most for all
        t.source_check.start(t.manifest.shards)
    connections = list(connections)
    clients = [
        {"pid": c.peer.pid, "uid": c.peer.uid, "command": c.peer.command, "tables": sorted(c.attached),
         "generations": dict(c.attached), "connected_seconds": round(time.monotonic() - c.since, 1)}
        for c in connections if c.attached
    ]
    return {
        "version": __version__, "pid": os.getpid(), "uptime_seconds": round(time.monotonic() - started, 1),
        "socket": socket,
        "tables": [t.describe(sources) | {"clients": sum(1 for c in connections if t.name in c.attached)}
                   for t in tables],
        "clients": clients, "reload": reload, "daemon": daemon,
    }
