"""``pled verify``: is what sits in memory exactly what is on disk? Shard by shard, byte for byte.

Reads each source file (dropping behind it the pages it brought into the page cache, as staging does)
and compares it with the region the daemon serves; also re-hashes the region and compares it with the digest recorded
when it was staged. Exit 0 when everything matches, 1 on any difference, 3 when pled is not running.

Run under journald (by a unit or a timer: its stderr is the journal), a table that differs is also a journal entry
with the "verify differs" MESSAGE_ID and the table's PLED_TABLE and PLED_GENERATION (the daemon itself never learns
of a verify); in a terminal, what is printed is all.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import time

from pled import client
from pled.daemon.health import journal, logs
from pled.shared import protocol
from pled.shared.boundary import BoundaryError, open_regular, say
from pled.shared.digests import HEX_LENGTH, hash_bytes
from pled.shared.dropbehind import DropBehind
from pled.shared.errors import EX_NOPERM, EX_NOT_RUNNING
from pled.shared.sizes import gib, rate

CHUNK = 16 * 1024 * 1024

log = logging.getLogger(__name__)


def _first_difference(a: memoryview, b: bytes) -> int:
    lo, hi = 0, len(b)
    while hi - lo > 4096:  # narrow down by halves, comparing slices in C
        mid = (lo + hi) // 2
        if a[lo:mid] != b[lo:mid]:
            hi = mid
        else:
            lo = mid
    return next(i for i in range(lo, hi) if a[i] != b[i])


def verify_shard(table: client.Table, index: int, out=sys.stdout, pieces: list | None = None) -> bool:
    """Source file ``index`` of ``table`` against the region: its digests as recorded, then its bytes (the whole
    file; or a checkpoint file's header as staged, then each of its PLE tensors), one line of result. ``pieces``:
    the file's pieces, where the caller has grouped them (else found here)."""
    shard = table.shards[index]
    if pieces is None:
        pieces = [p for p in table.manifest.pieces() if p.file == index]
    name = os.path.basename(shard.path)
    prefix = f"[{index + 1}/{len(table.shards)}] {table.name}/{name}:"
    buf = memoryview(table.buffer)
    try:
        for p in pieces:
            what = "" if p.name == name else f" (tensor {p.name})"
            algo = p.digest.partition(":")[0]
            if algo not in HEX_LENGTH:  # a region pled staged records one for every piece: a server's lie otherwise
                say(f"{prefix}{what} the region records no digest pled knows ({p.digest[:23]!r}): it was not "
                    "staged by pled as it is", file=out)
                return False
            with buf[p.offset : p.offset + p.nbytes] as held:
                got = f"{algo}:{hash_bytes(algo, held)}"
            if got != p.digest:
                say(f"{prefix}{what} the region no longer matches the digest recorded when it was staged "
                    f"({got[:23]}... != {p.digest[:23]}...)", file=out)
                return False
        try:
            fd = open_regular(shard.path)  # a FIFO or a device put in its place is refused, never waited on
        except BoundaryError as err:
            if isinstance(err.__cause__, PermissionError):
                raise err.__cause__ from None  # the run's, not this shard's: said once, with what to do
            if isinstance(err.__cause__, FileNotFoundError):
                say(f"{prefix} the source file is gone; the region still holds generation {table.generation}",
                    file=out)
            else:
                say(f"{prefix} cannot be compared: the source {err}", file=out)
            return False
        start = time.perf_counter()
        try:
            size = os.fstat(fd).st_size
            if size != shard.size:
                say(f"{prefix} DIFFERS: the file has {size} bytes; it had {shard.size} when pled staged it", file=out)
                return False
            if table.manifest.form == "arrays" and not _same_header(fd, shard):
                say(f"{prefix} DIFFERS: its header is not the one pled staged (its tensors renamed, moved or "
                    f"resized): `pled reload` stages the file as it is now", file=out)
                return False
            # Of a checkpoint file, only what this reading brought into the page cache leaves it (dropbehind.py)
            behind = DropBehind(fd, [(p.begin, p.begin + p.nbytes) for p in pieces], shard.path,
                                everything=table.manifest.form == "files")
            try:
                for p in sorted(pieces, key=lambda p: p.begin):
                    if not _compare(fd, p, buf, prefix if p.name == name else f"{prefix} tensor {p.name}", out,
                                    behind):
                        return False
            finally:
                behind.close()
        finally:
            os.close(fd)
        seconds = time.perf_counter() - start
        nbytes = sum(p.nbytes for p in pieces)
        what = "" if table.manifest.form == "files" else f"{len(pieces)} tensors, "
        say(f"{prefix} identical ({what}{gib(nbytes)}, {rate(nbytes, seconds)})", file=out)
        return True
    finally:
        buf.release()


def _same_header(fd: int, shard) -> bool:
    """The file's safetensors header now is the one pled read when it staged it (its sha256, the ShardEntry's
    fingerprint): a checkpoint file's bytes outside its PLE tensors are not in the region to compare."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return False
    length = int.from_bytes(head, "little")
    return length < shard.size and hashlib.sha256(os.pread(fd, length, 8)).hexdigest() == shard.fingerprint


def _compare(fd: int, piece, buf: memoryview, prefix: str, out, behind: DropBehind) -> bool:
    """The file's bytes of ``piece`` against the region's, chunk by chunk, the file's pages dropped behind; the
    first difference named by its byte (counted from the piece's start) and both values."""
    with buf[piece.offset : piece.offset + piece.nbytes] as region_bytes:
        done = 0
        while done < piece.nbytes:
            data = os.pread(fd, min(CHUNK, piece.nbytes - done), piece.begin + done)
            if not data:
                say(f"{prefix} the file ended at byte {piece.begin + done} while being read", file=out)
                return False
            if region_bytes[done : done + len(data)] != data:
                at = done + _first_difference(region_bytes[done : done + len(data)], data)
                say(f"{prefix} DIFFERS at byte {at}: the region has 0x{region_bytes[at]:02x}, "
                    f"the file 0x{data[at - done]:02x}", file=out)
                return False
            behind.read(piece.begin + done, piece.begin + done + len(data))
            done += len(data)
    return True


def verify(socket: str, table: str | None = None, out=sys.stdout, failed: list[str] | None = None) -> int:
    """Every table (or ``table``), each to its end whatever another one gave: 0 all identical, 1 any difference or
    a table that could not be verified (each named on stderr), 3 pled not running, 77 this user may not ask.
    ``failed``: gets the names of the tables that differed or could not be verified."""
    try:
        names: list = [table]
        if not table:
            tables = client.call(protocol.STATUS, socket=socket).get("tables")
            listed = isinstance(tables, list) and all(isinstance(t, dict) for t in tables)
            names = [t.get("table") for t in tables] if listed else []
            if not listed or not all(isinstance(n, str) for n in names):
                say(f"pled verify: the Status reply from {socket} lists no tables this pled can read; is a pled of "
                    "this version serving there?", file=sys.stderr)
                return 1
        ok = True
        for name in names:
            try:
                same = _verify_table(socket, name, out)
            except (client.DaemonUnavailable, client.PermissionDenied):
                raise
            except (client.ClientError, OSError) as err:  # this table: not ready, gone, a file it cannot read
                say(_why(err), file=sys.stderr)
                same = False
            ok = same and ok
            if not same and failed is not None:
                failed.append(name)
        return 0 if ok else 1
    except client.DaemonUnavailable as err:
        say(f"pled verify: {err}", file=sys.stderr)
        return EX_NOT_RUNNING
    except client.PermissionDenied as err:  # not a difference: this user may not ask
        say(f"pled verify: {err}", file=sys.stderr)
        return EX_NOPERM
    except client.ClientError as err:
        say(f"pled verify: {err}", file=sys.stderr)
        return 1


def _verify_table(socket: str, name: str, out) -> bool:
    with client.attach(name, socket=socket, populate=False) as t:
        files = f"{len(t.shards)} {'shards' if t.manifest.form == 'files' else 'checkpoint files'}"
        say(f"table {name} generation {t.generation}: {files}, {gib(t.manifest.source_bytes)}", file=out)
        by_file: dict[int, list] = {}
        for p in t.manifest.pieces():
            by_file.setdefault(p.file, []).append(p)
        results = [verify_shard(t, i, out, by_file.get(i, [])) for i in range(len(t.shards))]
        bad = results.count(False)
        unit = "shard" if t.manifest.form == "files" else "file"
        say(f"table {name}: {f'all {unit}s identical' if not bad else f'{bad} {unit}(s) differ'}", file=out)
        if bad and logs.journal_socket() is not None:
            log.warning("pled verify: table %s generation %d: %d shard(s) differ from its source files", name,
                        t.generation, bad, extra=journal.fields("verify_differs", table=name, generation=t.generation))
        return not bad


def _why(err: BaseException) -> str:
    if isinstance(err, PermissionError):
        return (f"pled verify: cannot read {err.filename} ({err.strerror}); run it as a user who may read the "
                "table's source files (root, or pled's user)")
    if isinstance(err, OSError):
        return f"pled verify: {err.filename or 'a source file'}: {err.strerror or err}"
    return f"pled verify: {err}"
