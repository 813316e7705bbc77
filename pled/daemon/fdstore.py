"""Tables that outlive pled: what to do with the memfds systemd hands back at start.

Each region pled stages is stored with systemd (FDSTORE=1, FDNAME=pled.<generation>.<table>).
When pled starts again systemd passes them back (LISTEN_FDS). A stored region is adopted,
without copying a byte, only if its header reads, its seals are all there, and its manifest
is exactly what staging the table's files now would produce (same paths, sizes, mtimes,
header fingerprints, offsets). Anything else is removed from the store (FDSTOREREMOVE=1)
and closed, so the store never holds a table twice or a table nobody configured.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from pled.shared import region
from pled.shared.errors import RegionError
from pled.daemon.notify import Notifier, StoredFd, fd_name, parse_fd_name
from pled.shared.region import Manifest, Region

log = logging.getLogger(__name__)


@dataclass
class Adopted:
    adopted: dict[str, tuple[Region, int]] = field(default_factory=dict)  # table -> (region, generation)
    generations: dict[str, int] = field(default_factory=dict)  # table -> generation a fresh staging gets


def describe_change(old: Manifest, new: Manifest) -> str:
    """What differs between a stored region and the files now: the first thing a person would check."""
    if len(old.shards) != len(new.shards):
        return f"{len(old.shards)} shards then, {len(new.shards)} now"
    for a, b in zip(old.shards, new.shards):
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


def adopt_stored(stored: list[StoredFd], planned: dict[str, Manifest], notifier: Notifier) -> Adopted:
    """The regions systemd kept for us: those that match what staging the files now would give are adopted,
    every other one is removed from the store and closed."""
    out = Adopted()

    def drop(fd: StoredFd, why: str) -> None:
        log.info("removing %s from the fd store: %s", fd.name, why)
        notifier.remove_fd(fd.name)
        os.close(fd.fd)

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
            manifest = region.read_manifest(item.fd)
            if not region.is_sealed(item.fd):
                raise RegionError("its seals are missing")
        except (RegionError, OSError, ValueError, TypeError, KeyError) as err:
            drop(item, f"not a usable region ({err})")
            continue
        if manifest.table != table:
            drop(item, f"it holds table {manifest.table}, not {table}")
            continue
        if manifest.identity() != planned[table].identity():
            drop(item, f"the sources of table {table} changed since generation {generation} was staged "
                       f"({describe_change(manifest, planned[table])}); staging it anew")
            continue
        if table in out.adopted:
            previous, previous_gen = out.adopted[table]
            keep_new = generation > previous_gen
            loser = StoredFd(previous.release(), fd_name(table, previous_gen)) if keep_new else item
            if keep_new:
                out.adopted[table] = (Region(item.fd, manifest), generation)
            drop(loser, f"table {table} is stored twice; keeping generation {max(generation, previous_gen)}")
            continue
        out.adopted[table] = (Region(item.fd, manifest), generation)
    return out
