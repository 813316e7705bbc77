"""attach(): a table pled holds, mapped zero copy and read-only (re-exported as pled.client.attach).

    from pled.client import attach
    with attach("ples_int4") as table:          # maps the daemon's sealed memfd
        table.tensors["shard_0/weight_i4"]      # torch views into the mapping, no copy
        table.gather(row_ids, out=pinned_buf)   # CPU gather + dequant, [n, 160]

Every process that attaches maps the same physical pages. ``attach`` joins the two halves:
the wire connection (pled.client.connection), held open for as long as the table is attached, and
the mapped table (pled.client.mapped_table). This module never imports the daemon's code.
"""
from __future__ import annotations

import os

from pled.shared import protocol, region
from pled.client.connection import (DEFAULT_SOCKET, ENV_SOCKET, ClientError, Connection, DaemonUnavailable,
    NoSuchTable, NotReady, PermissionDenied, ProtocolError, ReloadFailed, call, close_all, socket_path)
from pled.client.mapped_table import Table, TensorViews

__all__ = ["attach", "call", "socket_path", "Table", "TensorViews", "Connection", "DEFAULT_SOCKET", "ENV_SOCKET",
           "ClientError", "DaemonUnavailable", "PermissionDenied", "NoSuchTable", "NotReady", "ReloadFailed",
           "ProtocolError"]


def attach(table: str, socket: str | None = None, timeout: float = 10.0, populate: bool = True, wait: bool = False,
           warm_rows: int = 0) -> Table:
    """Attach to ``table``; with ``wait`` a table still being staged is waited for (up to ``timeout``).

    ``warm_rows``: make gather scratch for requests of that many rows now and run such gathers until
    their time settles, so that the first real request runs at full speed (see ``Table.warm``)."""
    conn = Connection(socket, timeout)
    try:
        params, fds = conn.call(protocol.ATTACH, table=table, **({"wait": True} if wait else {}))
        if len(fds) != 1:
            close_all(fds)
            raise ProtocolError(f"pled at {conn.path} sent {len(fds)} file descriptors for table {table!r}, expected 1")
        fd = fds[0]
        if not region.is_sealed(fd):
            os.close(fd)
            raise ProtocolError(f"the region pled sent for table {table!r} is not sealed; refusing to map it")
    except BaseException:
        conn.close()
        raise
    t = Table(fd, int(params.get("generation", 0)), populate, attachment=conn)  # closes conn if it fails
    try:
        if t.manifest.fingerprint != params.get("fingerprint") or t.manifest.table != table:
            raise ProtocolError(f"the region sent for table {table!r} does not match the reply (fingerprint or name)")
        if warm_rows:
            t.warm(warm_rows)
    except BaseException:
        t.close()
        raise
    return t
