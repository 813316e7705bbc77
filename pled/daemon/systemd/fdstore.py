"""Tables that outlive pled: systemd's fd store, how much of it pled may use, and what to do with the memfds
systemd hands back at start.

Each region pled stages is stored with systemd (FDSTORE=1, FDNAME=pled.<generation>.<table>: ``fd_name``).
When pled starts again systemd passes them back (LISTEN_FDS, read by ``listen_fds`` as
sd_listen_fds_with_names does, into ``StoredFd``s that own their fds). A stored region is adopted,
without copying a byte, only if its header reads, its seals are all there, and its manifest
is exactly what staging the table's files now would produce (same paths, sizes, mtimes,
header fingerprints, offsets) on the pages the config asks for now (shared memory, or reserved huge
pages of the size it names: pageplan.mismatch, from the memfd itself). Anything else is removed from
the store (FDSTOREREMOVE=1) and closed, so the store never holds a table twice or a table nobody configured.

The store holds at most FileDescriptorStoreMax= fds; systemd closes any past that, silently, so a table
sent then would be copied again on the next start without a word. ``FdStore`` counts what pled has
stored against that limit: from $FDSTORE where systemd passes it (254 and later), else the config's
``fdstore_max`` (default: the shipped unit's 64), and says which it assumed. A table that no longer fits
is served all the same and named in the log as one that a restart will copy again. A reload removes a
table's old generation before storing its new one, so a full store still keeps the changed table.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field

from pled.daemon.memory import pageplan
from pled.daemon.systemd.notify import Notifier
from pled.shared import region
from pled.shared.boundary import ascii_count
from pled.shared.errors import RegionError
from pled.shared.region import Manifest, Region
from pled.shared.sizes import gib

log = logging.getLogger(__name__)

DEFAULT_MAX = 64  # units/pled.service: FileDescriptorStoreMax=64
FDS_START = 3  # SD_LISTEN_FDS_START
FDNAME_PREFIX = "pled"


def fd_name(table: str, generation: int) -> str:
    """FDNAME for a table's region: 'pled.<generation>.<table>' (fd names may not hold ':')."""
    return f"{FDNAME_PREFIX}.{generation}.{table}"


def parse_fd_name(name: str) -> tuple[str, int] | None:
    parts = name.split(".", 2)
    generation = ascii_count(parts[1]) if len(parts) == 3 else None  # '²' is a str digit, and int() refuses it
    if generation is None or parts[0] != FDNAME_PREFIX:
        return None
    return parts[2], generation


@dataclass(frozen=True)
class StoredFd:
    """One fd systemd passed at start, and its FDNAME; owned by whoever holds this until adopted or closed."""

    fd: int
    name: str


def listen_fds(env: MutableMapping[str, str] | None = None, unset: bool = True) -> list[StoredFd]:
    """The fds systemd passed us (LISTEN_FDS/LISTEN_FDNAMES), if they are meant for this process.

    As sd_listen_fds_with_names(unset_environment=1): the variables are removed so that no child
    inherits them, and each fd is marked close-on-exec.
    """
    env = os.environ if env is None else env
    pid, count, names = env.get("LISTEN_PID"), env.get("LISTEN_FDS", "0"), env.get("LISTEN_FDNAMES", "")
    if unset:
        for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            env.pop(key, None)
    fds = ascii_count(count, 6)
    if pid != str(os.getpid()) or fds is None:
        return []
    labels = names.split(":") if names else []
    out = []
    for i in range(fds):
        fd = FDS_START + i
        try:
            os.set_inheritable(fd, False)
        except OSError:
            log.warning("LISTEN_FDS names fd %d but it is not open; ignoring it", fd)
            continue
        out.append(StoredFd(fd, labels[i] if i < len(labels) else "unknown"))
    return out


def close_stored(stored: list[StoredFd]) -> None:
    """Close pled's copies and leave systemd's in the store (a refused config: a fixed one may adopt them)."""
    for item in stored:
        os.close(item.fd)


class FdStore:
    """The entries pled keeps in systemd's fd store (by FDNAME), within the store's limit."""

    def __init__(self, notifier: Notifier, env, configured: int = DEFAULT_MAX) -> None:
        self.notifier = notifier
        self.names: set[str] = set()
        given = ascii_count(env.get("FDSTORE", ""))
        if given is not None:
            self.limit, self.source = given, "FDSTORE from systemd"
        else:
            self.limit = configured
            self.source = "fdstore_max in the config; systemd before 254 does not pass FDSTORE"

    @property
    def enabled(self) -> bool:
        return self.notifier.enabled and self.limit > 0

    def announce(self, to_stage: list[str]) -> None:
        """At start, after adoption: the limit assumed, and the tables that will not fit in what is left (in
        staging order), which a restart will copy again."""
        if not self.notifier.enabled:
            return
        log.info("systemd's fd store: up to %d table(s) (%s); %d adopted from it", self.limit, self.source,
                 len(self.names))
        left_out = to_stage[max(0, self.limit - len(self.names)):]
        if left_out:
            wanted = len(self.names) + len(to_stage)
            log.warning("%d table(s) but systemd's fd store holds %d (%s): %s will not be stored, and a restart "
                        "of pled copies them again; raise FileDescriptorStoreMax= (and fdstore_max) to at least %d",
                        wanted, self.limit, self.source, ", ".join(left_out), wanted)

    def adopted(self, name: str) -> None:
        self.names.add(name)

    def drop(self, item: StoredFd, why: str) -> None:
        """A stored fd pled does not adopt: out of the store, and closed."""
        log.info("removing %s from the fd store: %s", item.name, why)
        self.notifier.remove_fd(item.name)
        os.close(item.fd)

    def store(self, table: str, generation: int, region: Region) -> bool:
        if not self.notifier.enabled:
            return False
        name = fd_name(table, generation)
        if len(self.names) >= self.limit:
            log.warning("table %s generation %d (%s) not handed to systemd's fd store: it holds %d of %d (%s); "
                        "a restart of pled copies it again", table, generation, gib(region.manifest.region_bytes),
                        len(self.names), self.limit, self.source)
            return False
        if not self.notifier.store_fd(region.fd, name):
            return False
        self.names.add(name)
        log.info("table %s generation %d handed to systemd's fd store (%d of %d)", table, generation, len(self.names),
                 self.limit)
        return True

    def remove(self, table: str, generation: int) -> None:
        name = fd_name(table, generation)
        self.notifier.remove_fd(name)
        self.names.discard(name)


@dataclass
class Adopted:
    adopted: dict[str, tuple[Region, int]] = field(default_factory=dict)  # table -> (region, generation)
    generations: dict[str, int] = field(default_factory=dict)  # table -> generation a fresh staging gets


def describe_change(old: Manifest, new: Manifest) -> str:
    """What differs between a stored region and the files now: the first thing a person would check."""
    if len(old.shards) != len(new.shards):
        return f"{len(old.shards)} shards then, {len(new.shards)} now"
    for a, b in zip(old.shards, new.shards, strict=True):
        name = os.path.basename(b.path)
        if a.path != b.path:
            return f"shard {b.index} was {a.path}, is {b.path}"
        if a.size != b.size:
            return f"{name}: {a.size} bytes then, {b.size} now"
        if a.mtime_ns != b.mtime_ns:
            return f"{name}: modified since"
        if a.fingerprint != b.fingerprint:
            return f"{name}: its header changed"
        if (a.dev, a.ino) != (b.dev, b.ino):
            return f"{name}: replaced by another file"
    return "its layout changed"


def adopt_stored(stored: list[StoredFd], planned: dict[str, Manifest], store: FdStore,
                 pages: Callable[[str, int], str] | None = None, writable: frozenset[str] = frozenset()) -> Adopted:
    """The regions systemd kept for us: those that match what staging the files now would give are adopted,
    every other one is removed from the store and closed. ``planned``: on 2 MiB boundaries (a hugetlb region's
    is compared rounded up to its pages); ``pages(table, page_size)``: why a region on hugetlb pages of that size
    (0: shared memory) is not what the config asks for now, "" where it is. A writable table's region
    (gpu_access = "writable": not write-sealed) is never adopted: a writer may have changed it while pled was not
    watching, and its staging digests went with the old process; nor is a write-sealed one for a table now
    configured writable (its writers could not map it)."""
    out = Adopted()
    drop = store.drop
    for item in stored:
        parsed = parse_fd_name(item.name)
        if parsed is None:
            drop(item, "not a pled table")
            continue
        table, generation = parsed
        out.generations[table] = max(out.generations.get(table, 1), generation + 1)
        if table not in planned:
            drop(item, f"table {table} is no longer in the config")
            continue
        try:
            if region.seals(item.fd) & region.SEALS == region.WRITABLE_SEALS:  # all but the write seal
                drop(item, f"table {table} generation {generation} was writable (gpu_access = \"writable\"): a "
                           f"writer may have changed it while pled was stopped; staging it anew")
                continue
            if table in writable:
                drop(item, f"table {table} is now gpu_access = \"writable\" and generation {generation} is "
                           f"write-sealed; staging it anew")
                continue
            region.check_sealed_memfd(item.fd)  # first, as a client does: once sealed, what is read cannot change
            if os.fstat(item.fd).st_mode & 0o222:  # stored by a pled before regions were made 0444, as staging does:
                os.fchmod(item.fd, 0o444)  # else a client could reopen its fd O_RDWR through /proc (seals hold)
            manifest = region.read_manifest(item.fd)  # bounded and checked: every fault in it is a RegionError
        except (RegionError, OSError) as err:
            drop(item, f"not a usable region ({err})")
            continue
        if manifest.table != table:
            drop(item, f"it holds table {manifest.table}, not {table}")
            continue
        page_size = pageplan.page_size_of(item.fd)
        why = pages(table, page_size) if pages is not None else ""
        if why:
            drop(item, f"table {table} generation {generation}: {why}; staging it anew")
            continue
        if manifest.identity() != planned[table].paged(page_size).identity():
            drop(item, f"the sources of table {table} changed since generation {generation} was staged "
                       f"({describe_change(manifest, planned[table])}); staging it anew")
            continue
        if table in out.adopted:
            previous, previous_gen = out.adopted[table]
            keep_new = generation > previous_gen
            loser = StoredFd(previous.release(), fd_name(table, previous_gen)) if keep_new else item
            if keep_new:
                out.adopted[table] = (Region(item.fd, manifest), generation)
                store.names.discard(fd_name(table, previous_gen))
                store.adopted(item.name)
            drop(loser, f"table {table} is stored twice; keeping generation {max(generation, previous_gen)}")
            continue
        out.adopted[table] = (Region(item.fd, manifest), generation)
        store.adopted(item.name)
    return out
