"""The client library: attach to a table pled holds, zero copy, read-only.

    from pled.client import attach
    with attach("ples_int4") as table:          # maps the daemon's sealed memfd
        table.tensors["shard_0/weight_i4"]      # torch views into the mapping, no copy
        table.gather(row_ids, out=pinned_buf)   # CPU gather + dequant, [n, 160]

Every process that attaches maps the same physical pages. The mapping is
PROT_READ over a write-sealed memfd: a write through a tensor faults, it never
reaches the table. The mapping stays valid if the daemon goes away.

This module never imports the daemon's code; torch is imported only when
tensors or gathers are asked for (it comes from the vLLM environment).
"""
from __future__ import annotations

import json
import mmap
import os
import socket as socket_mod
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

from . import hugepages, protocol, region
from .errors import PledError

if TYPE_CHECKING:
    import torch

DEFAULT_SOCKET = "/run/pled/pled.sock"
ENV_SOCKET = "PLED_SOCKET"
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+
PAGE = mmap.PAGESIZE
_HINT = "check `systemctl status pled` and `journalctl -u pled`"


class ClientError(PledError):
    """Root of what attach() and call() raise."""


class DaemonUnavailable(ClientError):
    """Nothing is serving at the socket."""


class PermissionDenied(ClientError):
    """pled refused this process's uid."""


class NoSuchTable(ClientError):
    """pled does not serve a table of that name."""


class NotReady(ClientError):
    """The table is still being staged; ``progress`` says how far."""

    def __init__(self, message: str, progress: dict) -> None:
        super().__init__(message)
        self.progress = progress


class ReloadFailed(ClientError):
    """pled could not reload; it serves what it served before."""


class ProtocolError(ClientError):
    """The daemon answered something this client does not understand."""


def socket_path(path: str | None = None) -> str:
    return path or os.environ.get(ENV_SOCKET) or DEFAULT_SOCKET


class Connection:
    """One blocking connection to the daemon. A Table keeps its own open while attached."""

    _sock = None

    def __init__(self, path: str | None = None, timeout: float = 10.0) -> None:
        self.path = socket_path(path)
        sock = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM | socket_mod.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError) as err:
            sock.close()
            raise DaemonUnavailable(f"pled is not running at {self.path} ({err.strerror}); start it with "
                                    f"`systemctl start pled`, or {_HINT}") from err
        except PermissionError as err:
            sock.close()
            raise PermissionDenied(f"cannot connect to {self.path}: the socket's permissions refuse uid {os.geteuid()}; "
                                   f"run as a member of the socket's group, or ask the operator") from err
        except OSError as err:
            sock.close()
            raise DaemonUnavailable(f"cannot connect to pled at {self.path}: {err}; {_HINT}") from err
        self._sock = sock
        self._buf = bytearray()

    def call(self, method: str, **parameters) -> tuple[dict, list[int]]:
        """Send one call; return the reply's parameters and the fds that came with it (the caller owns them)."""
        try:
            self._sock.sendall(protocol.call(method, **parameters))
            raw, fds = self._receive()
        except (TimeoutError, socket_mod.timeout) as err:
            raise DaemonUnavailable(f"pled at {self.path} did not answer {method} in time; {_HINT}") from err
        except (ConnectionResetError, BrokenPipeError) as err:
            raise DaemonUnavailable(f"pled at {self.path} closed the connection during {method}; {_HINT}") from err
        try:
            message = json.loads(raw)
            if not isinstance(message, dict):
                raise ValueError("reply is not an object")
            if "error" in message:
                _close_all(fds)
                raise _error(message["error"], message.get("parameters") or {}, self.path)
            return message.get("parameters") or {}, fds
        except (ValueError, UnicodeDecodeError) as err:
            _close_all(fds)
            raise ProtocolError(f"pled at {self.path} sent a reply that is not valid JSON ({err})") from err

    def _receive(self) -> tuple[bytes, list[int]]:
        fds: list[int] = []
        while True:
            end = self._buf.find(b"\0")
            if end >= 0:
                raw = bytes(self._buf[:end])
                del self._buf[: end + 1]
                return raw, fds
            if len(self._buf) > protocol.MAX_REPLY:
                _close_all(fds)
                raise ProtocolError(f"reply from {self.path} exceeds {protocol.MAX_REPLY} bytes")
            data, new_fds, flags, _ = socket_mod.recv_fds(self._sock, 1 << 20, 4)
            fds += new_fds
            if flags & socket_mod.MSG_CTRUNC:  # the kernel dropped fds it could not deliver
                _close_all(fds)
                raise ProtocolError(f"file descriptors from {self.path} were truncated (MSG_CTRUNC)")
            if not data:
                _close_all(fds)
                raise DaemonUnavailable(f"pled at {self.path} closed the connection; {_HINT}")
            self._buf += data

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _error(name: str, params: dict, path: str) -> ClientError:
    if name == protocol.PERMISSION_DENIED:
        return PermissionDenied(f"pled at {path} refused uid {params.get('uid', os.geteuid())}: run it in pled's group "
                                f"(SupplementaryGroups=pled), or ask the operator to add it or one of its groups to "
                                f"allow_uids / allow_groups in /etc/pled/pled.toml")
    if name == protocol.NO_SUCH_TABLE:
        return NoSuchTable(f"pled at {path} serves no table {params.get('table')!r} (it serves: "
                           f"{', '.join(params.get('tables') or []) or 'none'}); check the name and `pled status`")
    if name == protocol.NOT_READY:
        return NotReady(f"table {params.get('table')!r} is still being staged ({params.get('shards_done')}/"
                        f"{params.get('shards')} shards); attach with wait=True or try again", params)
    if name == protocol.RELOAD_FAILED:
        return ReloadFailed(f"reload failed, pled serves what it served before: {params.get('reason')}")
    return ProtocolError(f"pled at {path} answered {name}: {params}")


def call(method: str, socket: str | None = None, timeout: float = 10.0, **parameters) -> dict:
    """One call on a fresh connection (Status, Ping)."""
    conn = Connection(socket, timeout)
    try:
        params, fds = conn.call(method, **parameters)
        _close_all(fds)
        return params
    finally:
        conn.close()


_TORCH_DTYPES = {
    "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "U16": "uint16", "U32": "uint32",
    "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


class Table:
    """One attached table: a read-only shared mapping of the daemon's memfd."""

    _fd = -1
    _map = None
    _conn = None
    _row_starts = None  # pled.gather's cache of each shard's first row

    def __init__(self, conn: Connection, fd: int, generation: int, populate: bool) -> None:
        self._conn = conn
        self._fd = fd  # owned from here on: a failure below closes it with the rest
        self.generation = generation
        self._tensors: dict | None = None
        self._by_shard: list[dict] | None = None
        self.populate_seconds = 0.0
        try:
            self.manifest = region.read_manifest(fd)
            self._map = region.map_readonly(fd)
            if populate:
                self.populate()
        except BaseException:
            self.close()
            raise

    @property
    def name(self) -> str:
        return self.manifest.table

    @property
    def shards(self) -> tuple[region.ShardEntry, ...]:
        return self.manifest.shards

    @property
    def fd(self) -> int:
        return self._fd

    @property
    def buffer(self) -> mmap.mmap:
        """The read-only mapping itself (for numpy.frombuffer or memoryview); tensors are views of it."""
        if self._map is None:
            raise ValueError(f"table {self.manifest.table} is closed")
        return self._map

    @property
    def closed(self) -> bool:
        return self._map is None

    def populate(self) -> float:
        """Make the first gather run at full speed: fault every page in (MADV_POPULATE_READ, one call into
        the kernel), then read one byte of every page, so the CPU has walked every page table once too. On
        this project's VM a populated 4 GiB table with 4 KiB pages still ran its first request at 0.06 of its
        speed until that walk had happened; the walk costs about 50 ms per GiB, and one read per 2 MiB where
        the table is on huge pages. Returns the seconds it took (also in ``populate_seconds``)."""
        start = time.perf_counter()
        try:
            self._map.madvise(MADV_POPULATE_READ)
        except OSError:
            pass  # kernels before 5.14: the reads below fault the pages in instead
        huge = hugepages.pmd_mapped_bytes(self.address) >= 0.9 * self.manifest.region_bytes
        stride = hugepages.PMD_SIZE if huge else PAGE
        try:
            import numpy as np

            int(np.frombuffer(self._map, dtype=np.uint8)[::stride].sum())
        except ImportError:
            view = memoryview(self._map)
            try:
                sum(view[::stride])
            finally:
                view.release()
        self.populate_seconds = time.perf_counter() - start
        return self.populate_seconds

    def residency(self) -> float:
        """The share of the region in memory now, measured by the kernel (cachestat or mincore)."""
        from .pagecache import cached_bytes_fd

        return min(1.0, cached_bytes_fd(self._fd) / self.manifest.region_bytes)

    # -- torch views -------------------------------------------------------------------------

    def _view(self, entry: region.TensorEntry) -> "torch.Tensor":
        import torch

        dtype = getattr(torch, _TORCH_DTYPES[entry.dtype])
        count = entry.nbytes // dtype.itemsize
        if not count:
            return torch.empty(entry.shape, dtype=dtype)
        with warnings.catch_warnings():  # the buffer is read-only on purpose: the mapping is PROT_READ
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self._map, dtype=dtype, count=count, offset=entry.offset).reshape(entry.shape)

    @property
    def tensors(self) -> "TensorViews":
        """Tensor name -> zero-copy view, made on first access. Names are unique across the table as they
        stand, else qualified by their shard: ``shard_3/weight_i4``."""
        if self._tensors is None:
            entries = self.manifest.tensors
            counts: dict[str, int] = {}
            for t in entries:
                counts[t.name] = counts.get(t.name, 0) + 1
            keyed = {}
            for t in entries:
                stem = os.path.splitext(os.path.basename(self.shards[t.shard].path))[0]
                keyed[t.name if counts[t.name] == 1 else f"{stem}/{t.name}"] = t
            self._tensors = TensorViews(self, keyed)
        return self._tensors

    def shard_tensors(self, index: int) -> dict[str, "torch.Tensor"]:
        """The tensors of one shard (one source file), by their names in that file."""
        if self._by_shard is None:
            self._by_shard = [None] * len(self.shards)
        if self._by_shard[index] is None:
            self._by_shard[index] = {t.name: self._view(t) for t in self.manifest.tensors if t.shard == index}
        return self._by_shard[index]

    @property
    def address(self) -> int:
        """Where the mapping starts in this process: tensors point at address + their offset."""
        import numpy as np  # a read-only buffer has no ctypes address; numpy reads it without a copy

        return int(np.frombuffer(self._map, dtype=np.uint8, count=1).ctypes.data)

    # -- gather + dequant (the CPU dequant worker's job) -------------------------------------

    def gather(self, row_ids, out: "torch.Tensor | None" = None, dtype=None) -> "torch.Tensor":
        """Rows ``row_ids`` (global, across shards in order) dequantized into ``out`` [n, row_width]."""
        from . import gather as gather_mod

        return gather_mod.gather(self, row_ids, out=out, dtype=dtype)

    # -- life --------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap and drop the fd and the connection. Views taken from ``tensors`` must be gone first."""
        self._tensors = None
        self._by_shard = None
        m, self._map = self._map, None
        if m is not None:
            try:
                m.close()
            except BufferError:  # tensors still point into it: leave the mapping to die with them
                pass
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def __enter__(self) -> "Table":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class TensorViews(Mapping):
    """Read-only mapping of tensor names to views into a Table's mapping, each made when first asked for."""

    def __init__(self, table: Table, entries: dict[str, region.TensorEntry]) -> None:
        self._table = table
        self._entries = entries
        self._made: dict[str, "torch.Tensor"] = {}

    def __getitem__(self, name: str) -> "torch.Tensor":
        view = self._made.get(name)
        if view is None:
            view = self._made[name] = self._table._view(self._entries[name])
        return view

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def attach(table: str, socket: str | None = None, timeout: float = 10.0, populate: bool = True, wait: bool = False) -> Table:
    """Attach to ``table``; with ``wait`` a table still being staged is waited for (up to ``timeout``)."""
    conn = Connection(socket, timeout)
    try:
        params, fds = conn.call(protocol.ATTACH, table=table, **({"wait": True} if wait else {}))
        if len(fds) != 1:
            _close_all(fds)
            raise ProtocolError(f"pled at {conn.path} sent {len(fds)} file descriptors for table {table!r}, expected 1")
        fd = fds[0]
        if not region.is_sealed(fd):
            os.close(fd)
            raise ProtocolError(f"the region pled sent for table {table!r} is not sealed; refusing to map it")
        t = Table(conn, fd, int(params.get("generation", 0)), populate)
        if t.manifest.fingerprint != params.get("fingerprint") or t.manifest.table != table:
            t.close()
            raise ProtocolError(f"the region sent for table {table!r} does not match the reply (fingerprint or name)")
        return t
    except BaseException:
        conn.close()
        raise
