"""Which files pled holds for this process, and what to do when it cannot serve them.

Shared by every seam that serves a file from pled (vLLM's weight iterator, ``safetensors.safe_open``) in
any process of the vLLM environment: vLLM's own processes, which load pled as a plugin, and those that do
not (a spawned PLE offload worker), which get it from the start-up hook (pled.autoload).

Enabled by ``PLED_SOCKET`` (with ``PLED_TABLES=a,b``, ``PLED_FALLBACK=disk`` and ``PLED_ANSWER_TIMEOUT``) or,
in a process where vLLM's config is already set, by ``--additional-config '{"pled": {"socket": ..., "tables":
[...], "fallback": "disk", "answer_timeout": 10}}'``, unless vLLM's plugin allow-list ``VLLM_PLUGINS`` is set and
leaves pled out: then pled is off in the process, with one warning. The tables are attached on the first file
asked for, once per process. If pled is configured but cannot serve, the file's load fails with pled's message,
unless the fallback is ``"disk"``: then a warning, and the file is read as usual. Neither torch nor vLLM is
imported here.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pled.shared.region import ShardEntry

log = logging.getLogger("vllm.pled")  # under vLLM's own logger, so its handlers print our lines
HINT = "check `systemctl status pled` and `pled status`"

_lock = threading.RLock()


class PledUnavailable(RuntimeError):
    """pled is configured for this process but cannot serve what it should."""


def emit(level: int, message: str, *args) -> None:
    """A log line through vLLM's handlers where there are any; else one line on stderr (a spawned worker
    that configured no logging still says what pled did)."""
    if log.hasHandlers():
        log.log(level, message, *args)
    elif level >= logging.INFO:
        prefix = "" if level < logging.WARNING else f"{logging.getLevelName(level)} "
        sys.stderr.write(f"{prefix}{message % args}\n")
        sys.stderr.flush()


@dataclass
class Settings:
    socket: str
    tables: list[str] | None
    fallback: str | None  # "disk", or None: fail the load
    populate: bool = True
    source: str = "PLED_SOCKET"
    answer_timeout: float = 10.0  # seconds pled has to answer one call (PLED_ANSWER_TIMEOUT, "answer_timeout")


def _vllm_additional_config() -> dict:
    """pled's part of vLLM's --additional-config, if vLLM is loaded here and its config is set (never
    imports vLLM itself: a process that has not would pay seconds for nothing)."""
    if "vllm.config.vllm" not in sys.modules:
        return {}
    try:
        cfg = sys.modules["vllm.config.vllm"].get_current_vllm_config_or_none()
    except Exception:  # a vLLM whose config module differs: the environment still applies
        return {}
    if cfg is not None and isinstance(getattr(cfg, "additional_config", None), dict):
        return cfg.additional_config.get("pled") or {}
    return {}


_left_out_said = False


def left_out_by_vllm() -> str | None:
    """vLLM's plugin allow-list, when it is set and leaves pled out (vLLM's own rule: ``VLLM_PLUGINS`` split
    on commas, names compared exactly; set but empty allows nothing); else None."""
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is None or "pled" in allowed.split(","):
        return None
    return allowed


def settings() -> Settings | None:
    """pled's settings for this process; None: pled is not enabled here.

    vLLM's allow-list wins: where ``VLLM_PLUGINS`` is set and does not name ``pled``, pled is off in this
    process however it was enabled (``PLED_SOCKET`` or ``--additional-config``), and says so once."""
    global _left_out_said
    extra = _vllm_additional_config()
    socket = extra.get("socket") or os.environ.get("PLED_SOCKET")
    if not socket:
        return None
    allowed = left_out_by_vllm()
    if allowed is not None:
        if not _left_out_said:
            _left_out_said = True
            emit(logging.WARNING, "pled: VLLM_PLUGINS=%r leaves pled out, so pled is off in this process (pid %d) "
                 "though %s is set: the tables are read from disk; add pled to VLLM_PLUGINS to serve them from "
                 "shared memory", allowed, os.getpid(),
                 "--additional-config's pled socket" if extra.get("socket") else "PLED_SOCKET")
        return None
    tables = extra.get("tables")
    if tables is None and os.environ.get("PLED_TABLES"):
        tables = [t for t in os.environ["PLED_TABLES"].split(",") if t]
    fallback = extra.get("fallback") or os.environ.get("PLED_FALLBACK") or None
    if fallback not in (None, "disk"):
        raise PledUnavailable(f'pled: fallback must be "disk" or unset, not {fallback!r}')
    return Settings(socket, tables, fallback, bool(extra.get("populate", True)),
                    "--additional-config" if extra.get("socket") else "PLED_SOCKET", _answer_timeout(extra))


ANSWER_TIMEOUT = 10.0  # the default bound on one unanswered call: a pled that answers at all answers in milliseconds
MAX_ANSWER_TIMEOUT = 3600.0
STAGING_WAIT = 600.0  # how long a table pled says is still being staged is waited for (its progress said meanwhile)
PROGRESS_EVERY = 5.0  # seconds between two lines of a staging table's progress
POLL_EVERY = 1.0  # seconds between two asks whether a table still being staged is ready


def _answer_timeout(extra: dict) -> float:
    """The bound on one call pled does not answer, in seconds: --additional-config's ``"answer_timeout"`` (a JSON
    number), else ``PLED_ANSWER_TIMEOUT`` (decimal digits, one optional fraction), else ANSWER_TIMEOUT; anything
    else, or a bound outside (0, MAX_ANSWER_TIMEOUT], is refused in one line naming where it was set."""
    if "answer_timeout" in extra:
        value, where = extra["answer_timeout"], "--additional-config's pled answer_timeout"
        ok = type(value) in (int, float)
    elif os.environ.get("PLED_ANSWER_TIMEOUT") is not None:
        value, where = os.environ["PLED_ANSWER_TIMEOUT"], "PLED_ANSWER_TIMEOUT"
        whole, _, fraction = value.partition(".")
        ok = len(value) <= 20 and whole.isascii() and whole.isdigit() and (fraction == "" or (
            fraction.isascii() and fraction.isdigit()))
        value = float(value) if ok else value
    else:
        return ANSWER_TIMEOUT
    if not ok or not 0 < value <= MAX_ANSWER_TIMEOUT:
        raise PledUnavailable(f"pled: {where} must be a number of seconds above 0 and at most "
                              f"{MAX_ANSWER_TIMEOUT:g}, not {str(value)[:40]!r}")
    return float(value)


@dataclass
class Held:
    table: object  # pled.client.Table (not imported here: held_files is imported at vLLM's start, torch is not)
    shard: ShardEntry
    partial: bool = False  # a checkpoint file of an arrays table: pled holds its PLE tensors, not the rest


@dataclass
class State:
    """What this process has attached: tables, and each held file by real path."""

    settings: Settings
    tables: dict = field(default_factory=dict)
    files: dict[str, Held] = field(default_factory=dict)
    # (table, seam) -> real paths served through that seam and not yet reported
    served: dict[tuple[str, str], set] = field(default_factory=dict)
    reported: set = field(default_factory=set)  # (table, seam) whose every file was reported
    unviewable: set[str] = field(default_factory=set)  # real paths said to be read from disk (a dtype torch lacks)
    # arrays tables (vLLM 0.33's PLE path, pled.client.ple_seams): layer key -> [(table, ArrayEntry)], and where
    # each such table is mapped in this process: [(start, end, table)]
    arrays: dict[str, list] = field(default_factory=dict)
    mapped: list[tuple[int, int, object]] = field(default_factory=list)
    said: set = field(default_factory=set)  # keys of warnings said once a process

    def lookup(self, path: str) -> Held | None:
        """The region holding ``path``, if it is a file pled staged and it is unchanged; else None or an error.

        None too, with one warning per file, where this process cannot view every tensor of the file (a dtype
        its torch lacks): each seam then hands the file to the reader it wraps, which reads it from disk."""
        real = os.path.realpath(path)
        held = self.files.get(real)
        if held is None:
            return None
        st = os.stat(real)
        shard = held.shard
        if (st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino) != (shard.size, shard.mtime_ns, shard.dev, shard.ino):
            what = (f"size {st.st_size}, was {shard.size}" if st.st_size != shard.size
                    else "modified, at the same size" if st.st_mtime_ns != shard.mtime_ns
                    else "replaced by another file (inode) of the same size and mtime")
            self.refuse(f"{real} changed since pled staged it into table {held.table.name} "
                        f"({what}); restart pled to stage it anew, then vLLM")
            return None
        problem = held.table.unviewable(held.shard.index)
        if problem is not None:
            with _lock:
                if real not in self.unviewable:
                    self.unviewable.add(real)
                    emit(logging.WARNING, "pled: %s (table %s): %s; reading it from disk instead", real,
                         held.table.name, problem)
            return None
        return held

    def refuse(self, problem: str, instead: str = "reading from disk instead", once: str | None = None) -> None:
        """Without the fallback, raise PledUnavailable with ``problem``; with ``fallback = "disk"``, warn (once a
        process per ``once`` key, where given) and return: the caller then does what vLLM does without pled."""
        if self.settings.fallback == "disk":
            with _lock:
                if once is not None and once in self.said:
                    return
                self.said.add(once)
            emit(logging.WARNING, "pled: %s; %s (fallback = \"disk\")", problem, instead)
            return
        raise PledUnavailable(f"pled: {problem}; {HINT}, or set \"fallback\": \"disk\" "
                              "(PLED_FALLBACK=disk) to read from disk")

    def holding(self, ptr: int) -> object | None:
        """The arrays table whose mapping holds address ``ptr`` in this process, if any."""
        for start, end, table in self.mapped:
            if start <= ptr < end:
                return table
        return None

    def count(self, held: Held, seam: str) -> None:
        with _lock:
            self.served.setdefault((held.table.name, seam), set()).add(held.shard.path)

    def report(self, seam: str, complete_only: bool = False) -> None:
        """One line per table served through ``seam`` since the last report (with ``complete_only``: only
        for tables whose every file has now been served, each such table once)."""
        from pled.shared.sizes import gib

        with _lock:
            for (name, how), paths in list(self.served.items()):
                t = self.tables[name]
                if how != seam or (complete_only and (len(paths) < len(t.shards) or (name, how) in self.reported)):
                    continue
                if complete_only:
                    self.reported.add((name, how))
                del self.served[(name, how)]
                what = "files" if t.manifest.form == "files" else "checkpoint files' PLE tensors"
                emit(logging.INFO, "pled: pid %d mapped table %s (generation %d): %d of %d %s, %s from shared "
                     "memory, 0 bytes read from disk for them, through %s (pre-fault %.0f ms)", os.getpid(), name,
                     t.generation, len(paths), len(t.shards), what, gib(t.manifest.source_bytes), seam,
                     t.populate_seconds * 1000)

    def report_the_rest(self) -> None:
        """At exit: tables some of whose files were served through safe_open, not yet reported."""
        for seam in {how for _, how in self.served}:
            self.report(seam)


_state: State | None = None


def current() -> State | None:
    """What this process has attached so far (None before the first file or table was asked for); attaches nothing."""
    return _state


def state() -> State | None:
    """Attach (once per process) the tables pled serves; None when pled is not enabled here."""
    global _state
    with _lock:
        s = settings()
        if s is None:
            return None
        if _state is not None and _state.settings.socket == s.socket:
            _state.settings = s  # the fallback as set now (the tables stay those attached)
            return _state
        st = State(s)
        _attach_all(st)  # raises where pled cannot serve and there is no fallback: the next load tries again
        _state = st
        atexit.register(st.report_the_rest)
        return st


def _served_tables(status, socket: str) -> list[str]:
    """The table names in pled's Status reply, checked: a reply of another shape is a ProtocolError (and the
    disk fallback applies), never a KeyError from deep in vLLM's loader."""
    from pled import client

    tables = status.get("tables") if isinstance(status, dict) else None
    names = [t.get("table") if isinstance(t, dict) else None for t in tables] if isinstance(tables, list) else None
    if names is None or not all(isinstance(n, str) for n in names):
        raise client.ProtocolError(f"pled at {socket} answered io.pled.Status with no list of tables")
    return names


def _attach_all(st: State) -> None:
    from pled import client
    from pled.shared import protocol

    s = st.settings
    try:
        names = s.tables
        if names is None:
            names = _served_tables(client.call(protocol.STATUS, socket=s.socket, timeout=s.answer_timeout), s.socket)
        for name in names:
            table = _attach_when_staged(name, s)
            st.tables[name] = table
            partial = table.manifest.form == "arrays"
            for shard in table.shards:
                st.files[shard.path] = Held(table, shard, partial)
            for entry in table.manifest.arrays:
                st.arrays.setdefault(entry.key, []).append((table, entry))
            if partial:
                st.mapped.append((table.address, table.address + len(table.buffer), table))
    except client.NoSuchTable as err:
        st.refuse(f"a configured table is not served: {err}")
    except client.ClientError as err:
        st.refuse(f"configured by {s.source} ({s.socket}) but cannot attach: {err}")


def _attach_when_staged(name: str, s: Settings):
    """Attach table ``name``: each call bounded by ``s.answer_timeout`` (a pled that does not answer is a
    DaemonUnavailable naming the socket and the wait, never a wait of minutes); a table pled says is still being
    staged is asked for again every POLL_EVERY seconds, up to STAGING_WAIT, its progress said every PROGRESS_EVERY."""
    import time

    from pled import client

    began = time.monotonic()
    said = began
    while True:
        try:
            return client.attach(name, socket=s.socket, populate=s.populate, timeout=s.answer_timeout)
        except client.NotReady as err:
            progress = err.progress if isinstance(err.progress, dict) else {}
            waited = time.monotonic() - began
            if progress.get("state") == "failed":
                raise client.NotReady(f"pled at {s.socket} could not stage table {name!r} (its state: failed; "
                                      "`pled status` says why)", progress) from None
            if waited >= STAGING_WAIT:
                raise client.NotReady(f"{err} after waiting {STAGING_WAIT:g} s for it", progress) from None
            if time.monotonic() - said >= PROGRESS_EVERY:
                said = time.monotonic()
                emit(logging.INFO, "pled: table %s is still being staged at %s (%s of %s shards, %s of %s bytes); "
                     "waited %.0f s of %g", name, s.socket, *(_shown(progress.get(k)) for k in
                                                            ("shards_done", "shards", "bytes_done", "bytes")),
                     waited, STAGING_WAIT)
            time.sleep(POLL_EVERY)


def _shown(value) -> str:
    """A figure of pled's progress as a log shows it: an integer, or '?' (a peer's reply may hold anything)."""
    return str(value) if type(value) is int else "?"
