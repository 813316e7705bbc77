"""attach(): a table pled holds, mapped zero copy and read-only (re-exported as pled.client.attach).

    from pled.client import attach
    with attach("ples_int4") as table:          # maps the daemon's sealed memfd
        table.tensors["shard_0/weight_i4"]      # torch views into the mapping, no copy
        table.gather(row_ids, out=pinned_buf)   # CPU gather + dequant, [n, 160]
        table.page_size                         # the pages it got: 4096, 2 MiB (THP or hugetlb), 1 GiB (hugetlb)

Every process that attaches maps the same physical pages. ``attach`` joins the two halves:
the wire connection (pled.client.connection), held open for as long as the table is attached, and
the mapped table (pled.client.mapped_table). This module never imports the daemon's code.
"""
from __future__ import annotations

import fcntl
import os

from pled.client.connection import (
    DEFAULT_SOCKET,
    ENV_SOCKET,
    BadRegion,
    ClientError,
    Connection,
    DaemonUnavailable,
    NoSuchTable,
    NotReady,
    NotWritable,
    PermissionDenied,
    ProtocolError,
    ReloadFailed,
    call,
    close_all,
    socket_path,
)
from pled.client.mapped_table import Table, TensorViews
from pled.shared import protocol, region
from pled.shared.boundary import OutOfTime, deadline as parse_deadline
from pled.shared.errors import RegionError

__all__ = ["attach", "call", "socket_path", "Table", "TensorViews", "Connection", "DEFAULT_SOCKET", "ENV_SOCKET",
           "ClientError", "DaemonUnavailable", "PermissionDenied", "NotWritable", "NoSuchTable", "NotReady",
           "ReloadFailed", "ProtocolError", "BadRegion"]


def attach(table: str, socket: str | None = None, timeout: float = 10.0, populate: bool = True, wait: bool = False,
           warm_rows: int = 0) -> Table:
    """Attach to ``table``; with ``wait`` a table still being staged is waited for (up to ``timeout``).

    ``warm_rows``: make gather scratch for requests of that many rows now and run such gathers until
    their time settles, so that the first real request runs at full speed (see ``Table.warm``).

    ``timeout`` bounds the whole attach, from the connect to the reply and the parse and checks of the region's
    manifest (past it: DaemonUnavailable); pre-faulting (``populate``) and ``warm_rows`` are not bounded by it.
    Nothing pled sends is trusted: the fd must be a sealed memfd and its manifest must check out
    (``region.check_sealed_memfd``, ``region.read_manifest``) before anything is mapped; whatever is wrong is a
    ClientError (``BadRegion`` for the region) and every fd received is closed."""
    conn = Connection(socket, timeout)
    try:
        params, fds = conn.call(protocol.ATTACH, table=table, **({"wait": True} if wait else {}))
        if len(fds) != 1:
            close_all(fds)
            raise ProtocolError(f"pled at {conn.path} sent {len(fds)} file descriptors for table {table!r}, expected 1")
        fd = fds[0]
        try:
            generation = params.get("generation", 0)
            if type(generation) is not int or generation < 0:
                raise ProtocolError(f"pled at {conn.path} sent generation {generation!r:.40} for table {table!r}, "
                                    f"not a count")
            gpu_access, gpu_routes, writer = _gpu_side(params, conn.path, table, fd)
            staged = _staged_manifest(params, conn.path, table) if gpu_access == "writable" else None
            if gpu_access == "writable":  # its writers may change it; nothing read below can shrink or vanish
                region.check_sealed_memfd(fd, writable=True)
            else:
                region.check_sealed_memfd(fd)  # first: once sealed, nothing read below can change or shrink
        except RegionError as err:
            os.close(fd)
            raise BadRegion(f"the region pled at {conn.path} sent for table {table!r} is refused: {err}; "
                            f"refusing to map it") from err
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        conn.close()
        raise
    try:
        with parse_deadline(conn.deadline):  # bounds the manifest's parse and checks; pre-faulting looks at no clock
            t = Table(fd, generation, populate, attachment=conn, gpu_access=gpu_access, gpu_routes=gpu_routes,
                      writer=writer, manifest_sha256=staged)  # closes fd and conn if it fails
    except BadRegion as err:
        raise BadRegion(f"the region pled at {conn.path} sent for table {table!r} is refused: {err}") from err
    except OutOfTime as err:
        raise DaemonUnavailable(f"attaching table {table!r} from pled at {conn.path} took more than {timeout:g} s: "
                                f"reading the region's manifest did not end in time ({err})") from err
    try:
        if t.manifest.fingerprint != params.get("fingerprint") or t.manifest.table != table:
            raise ProtocolError(f"the region sent for table {table!r} does not match the reply (fingerprint or name)")
        if warm_rows:
            t.warm(warm_rows)
    except BaseException:
        t.close()
        raise
    return t


_ACCESS = ("read-only", "writable")
_ROUTES = ("read-only", "pageable", "writable")


def _staged_manifest(params: dict, path: str, table: str) -> bytes:
    """A writable table's ``manifest_sha256``: the manifest as pled staged it, which the region's header (in reach
    of the table's writers) must record."""
    digest = params.get("manifest_sha256")
    if not isinstance(digest, str) or len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        raise ProtocolError(f"pled at {path} sent manifest_sha256 {digest!r:.80} for writable table {table!r}, not "
                            "the 64 hex digits of its staged manifest")
    return bytes.fromhex(digest)


def _gpu_side(params: dict, path: str, table: str, fd: int) -> tuple[str, tuple[str, ...], bool]:
    """The reply's gpu_access, gpu_routes and writer (a pled before them: read-only, its two routes, no writer),
    checked; a writer's fd must be open read-write, anyone else's read-only."""
    access = params.get("gpu_access", "read-only")
    routes = params.get("gpu_routes", ["read-only", "pageable"])
    writer = params.get("writer", False)
    if access not in _ACCESS or type(writer) is not bool or (writer and access != "writable"):
        raise ProtocolError(f"pled at {path} sent gpu_access {access!r:.40} and writer {writer!r:.20} for table "
                            f"{table!r}, not what this client knows")
    if (not isinstance(routes, list) or not 0 < len(routes) <= len(_ROUTES) or len(set(map(str, routes))) != len(routes)
            or not all(isinstance(r, str) and r in _ROUTES for r in routes)):
        raise ProtocolError(f"pled at {path} sent gpu_routes {routes!r:.80} for table {table!r}, not a list of "
                            f"distinct routes among {', '.join(_ROUTES)}")
    mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    if mode != (os.O_RDWR if writer else os.O_RDONLY) and not (not writer and access == "read-only"):
        raise ProtocolError(f"pled at {path} sent table {table!r}'s fd open "
                            f"{'read-write' if mode == os.O_RDWR else 'read-only'} "
                            f"to {'a writer' if writer else 'a client that is not a writer'}")
    return access, tuple(routes), writer
