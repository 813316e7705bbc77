"""A table mapped into this process: the daemon's sealed memfd, read-only, its tensors as zero-copy views.

The mapping is PROT_READ over a write-sealed memfd: a write through a tensor faults, it never
reaches the table, and the mapping stays valid if the daemon goes away. How the fd arrived (the
wire connection, pled.client.connection) is not this module's business: ``attach()`` in pled.client
hands over the fd and the connection to close with the table.

This module never imports the daemon's code; torch is imported only when tensors or gathers are
asked for, or whether a shard's tensors can be viewed (it comes from the vLLM environment).
"""
from __future__ import annotations

import errno
import mmap
import os
import time
from typing import TYPE_CHECKING

import numpy as np

from pled.client.connection import BadRegion, ClientError, NotWritable
from pled.client.tensor_views import (  # noqa: F401 (torch_dtype and numpy_dtype: the seams find them here)
    TensorViews,
    _bytes,
    _make_view,
    _no_view,
    numpy_dtype,
    torch_dtype,
)
from pled.shared import hugepages, region
from pled.shared.errors import RegionError

if TYPE_CHECKING:
    import torch

    from pled.client.gather import Gatherer, Scratch

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+
PAGE = mmap.PAGESIZE

class Table:
    """One mapped table. ``attachment`` (anything with close(), the daemon connection) is closed with it.

    The region's header and manifest are checked before it is mapped (``region.read_manifest``: bounds, schema,
    every shard and tensor inside the region); a region that fails is ``BadRegion``, and the fd and the
    attachment are closed. Whether the fd is sealed is ``attach()``'s check (tests map unsealed copies here)."""

    _fd = -1
    _map: mmap.mmap | None = None
    _attachment = None
    _gatherer: Gatherer | None = None
    _views: list[torch.Tensor | None] | None = None  # the one cache of tensor views, by entry; None once closed
    # shard index -> why its tensors cannot all be viewed here (None: they can); made on first use
    _unviewable: dict[int, str | None] | None = None

    def __init__(self, fd: int, generation: int, populate: bool, attachment=None, *, gpu_access: str = "read-only",
                 gpu_routes: tuple[str, ...] = ("read-only", "pageable"), writer: bool = False,
                 manifest_sha256: bytes | None = None) -> None:
        self._attachment = attachment
        self._fd = fd  # owned from here on: a failure below closes it with the rest
        self.generation = generation
        self.populate_seconds = 0.0
        # The GPU side (the daemon's Attach reply): "writable" where the table's config opts in; ``writer``: this
        # process got the read-write fd (a writer the config names) and maps it shared and writable until protect().
        self.gpu_access = gpu_access
        self.gpu_routes = tuple(gpu_routes)
        self.writer = writer
        self.protected = not writer
        try:
            try:
                self.manifest = region.read_manifest(fd, manifest_sha256)  # a writable one: as pled staged it
                self._map = (mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED,
                                       prot=mmap.PROT_READ | mmap.PROT_WRITE) if writer else region.map_readonly(fd))
            except (RegionError, OSError) as err:
                raise BadRegion(f"{err}; refusing to map it") from err
            self._views = [None] * len(self.manifest.tensors)
            self._by_shard: list[list[int]] = [[] for _ in self.manifest.shards]
            for index, entry in enumerate(self.manifest.tensors):
                self._by_shard[entry.shard].append(index)
            self._names: TensorViews | None = None
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

    def require_writer(self, what: str = "write this table") -> None:
        """NotWritable unless this process holds the table's read-write mapping (not yet protected)."""
        if not self.writer:
            why = ("it is not writable (gpu_access = \"read-only\" in pled's config)" if self.gpu_access != "writable"
                   else f"uid {os.geteuid()} is not one of its writers (the table's writers = [...] in pled's config)")
            raise NotWritable(f"cannot {what}: table {self.manifest.table}: {why}")
        if self.protected:
            raise NotWritable(f"cannot {what}: table {self.manifest.table}'s mapping in this process was made "
                              "read-only (Table.protect())")

    def protect(self) -> None:
        """Make this process's mapping read-only (mprotect PROT_READ): the writable route calls it right after it
        registered the table with the GPU. Idempotent; a non-writer's mapping is read-only already."""
        if self.protected:
            return
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.mprotect(self.address, len(self.buffer), mmap.PROT_READ) != 0:
            err = ctypes.get_errno()
            raise ClientError(f"making table {self.manifest.table} read-only in this process failed: "
                              f"{os.strerror(err)} (mprotect, errno {err})")
        self.protected = True

    @property
    def address(self) -> int:
        """Where the mapping starts in this process: tensors point at address + their offset."""
        # a read-only buffer has no ctypes address; numpy reads it without a copy
        return int(np.frombuffer(self.buffer, dtype=np.uint8, count=1).ctypes.data)

    def populate(self) -> float:
        """Make the first gather run at full speed: fault every page in (MADV_POPULATE_READ, one call into
        the kernel), then read one byte of every page, so the CPU has walked every page table once too
        (docs/BENCHMARKS.md shows what each step buys). One read per huge page where the table is on huge
        pages (``page_size``). On reserved huge pages (hugetlb) every page exists already, so this maps them and
        reserves nothing: it works on a full pool and in a cgroup whose hugetlb limit is 0. Returns the seconds it
        took (also in ``populate_seconds``)."""
        start = time.perf_counter()
        try:
            self.buffer.madvise(MADV_POPULATE_READ)
        except OSError as err:
            if err.errno != errno.EINVAL:  # EINVAL: a kernel before 5.14; the reads below fault the pages in
                raise ClientError(f"pre-faulting table {self.manifest.table} failed: {err.strerror} "
                                  f"(MADV_POPULATE_READ, errno {err.errno}); "
                                  "attach with populate=False to skip it") from err
        int(np.frombuffer(self.buffer, dtype=np.uint8)[::self.page_size].sum())
        self.populate_seconds = time.perf_counter() - start
        return self.populate_seconds

    @property
    def page_size(self) -> int:
        """The page size this process's mapping of the table got, in bytes: a hugetlb region's own (2 MiB or
        1 GiB, from its memfd); else 2 MiB where transparent huge pages map at least 90% of it (as faulted in so
        far: after ``populate``), else 4 KiB."""
        from pled.shared.pagecache import is_hugetlb, page_size

        if is_hugetlb(self._fd):
            return page_size(self._fd)
        return hugepages.PMD_SIZE if hugepages.pmd_mapped_bytes(self.address) >= 0.9 * len(self.buffer) else PAGE

    def residency(self) -> float:
        """The share of the region in memory now, measured by the kernel (cachestat or mincore)."""
        from pled.shared.pagecache import cached_bytes_fd

        return min(1.0, cached_bytes_fd(self._fd) / self.manifest.region_bytes)

    # -- torch views -------------------------------------------------------------------------

    def view(self, index: int) -> torch.Tensor:
        """The zero-copy view of ``manifest.tensors[index]``, made once and kept."""
        views = self._views
        if views is None:
            raise ValueError(f"table {self.manifest.table} is closed")
        made = views[index]
        if made is None:
            made = views[index] = _make_view(self.buffer, self.manifest.tensors[index])
        return made

    @property
    def tensors(self) -> TensorViews:
        """Tensor name -> zero-copy view, made on first access. Names are unique across the table as they
        stand, else qualified by their shard: ``shard_3/weight_i4``."""
        if self._names is None:
            entries = self.manifest.tensors
            counts: dict[str, int] = {}
            for t in entries:
                counts[t.name] = counts.get(t.name, 0) + 1
            stems: dict[int, str] = {}  # a shard's file stem, worked out only for names that need it
            keyed = {}
            for index, t in enumerate(entries):
                if counts[t.name] == 1:
                    keyed[t.name] = index
                    continue
                stem = stems.get(t.shard)
                if stem is None:
                    stem = stems[t.shard] = os.path.splitext(os.path.basename(self.shards[t.shard].path))[0]
                keyed[f"{stem}/{t.name}"] = index
            self._names = TensorViews(self.view, keyed)
        return self._names

    def shard_tensors(self, index: int) -> dict[str, torch.Tensor]:
        """The tensors of one shard (one source file), by their names in that file."""
        return {self.manifest.tensors[i].name: self.view(i) for i in self._by_shard[index]}

    def shard_entries(self, index: int) -> dict[str, int]:
        """One shard's tensor names -> their index in ``manifest.tensors`` (for ``view``), in manifest order."""
        return {self.manifest.tensors[i].name: i for i in self._by_shard[index]}

    def file_view(self, index: int) -> torch.Tensor:
        """``manifest.tensors[index]`` viewed anew: its bytes as its torch dtype, in the file's shape (an F4 tensor,
        two values a byte, does not take that shape: torch says so, as under safetensors' own reader)."""
        import torch

        entry = self.manifest.tensors[index]
        raw = _bytes(self.buffer, entry.offset, entry.nbytes) if entry.nbytes else torch.empty(0, dtype=torch.uint8)
        return raw.view(dtype=torch_dtype(entry.dtype)).reshape(list(entry.shape))

    def array(self, index: int) -> np.ndarray:
        """``manifest.tensors[index]`` as a read-only numpy view of the mapping, in ``numpy_dtype``'s dtype."""
        entry = self.manifest.tensors[index]
        dtype = numpy_dtype(entry.dtype)
        if not entry.nbytes:
            return np.zeros(entry.shape, dtype=dtype)
        count = entry.nbytes // np.dtype(dtype).itemsize
        return np.frombuffer(self.buffer, dtype=dtype, count=count, offset=entry.offset).reshape(entry.shape)

    def unviewable(self, index: int) -> str | None:
        """Why this process cannot make torch views of every tensor of shard ``index`` (None: it can); worked out
        once a shard."""
        if self._unviewable is None:
            self._unviewable = {}
        if index not in self._unviewable:
            problems = (_no_view(self.manifest.tensors[i]) for i in self._by_shard[index])
            self._unviewable[index] = next((p for p in problems if p), None)
        return self._unviewable[index]

    # -- gather + dequant (the CPU dequant worker's job) -------------------------------------

    def gather(self, row_ids, out: torch.Tensor | None = None, dtype=None) -> torch.Tensor:
        """Rows ``row_ids`` (global, across shards in order) dequantized into ``out`` [n, row_width].

        Scratch space for the largest request so far is kept with the table, so repeated requests
        allocate nothing but the output when ``out`` is not given. Gathers on one Table run one at a time."""
        return self._gather_for().gather(row_ids, out=out, dtype=dtype)

    def warm(self, rows: int) -> list[float]:
        """Pay a gather's first-call costs now: scratch for ``rows`` rows (pages faulted in), torch's
        kernels loaded, and gathers of that many random ids until their time settles (at most 8;
        ``Gatherer.warm``). Returns each warm-up gather's seconds."""
        return self._gather_for().warm(rows)

    @property
    def scratch(self) -> Scratch | None:
        """The gather scratch kept with this table (None before the first gather or warm)."""
        return self._gatherer.scratch if self._gatherer is not None else None

    def _gather_for(self) -> Gatherer:
        if self._gatherer is None:
            from pled.client.gather import Gatherer  # imports torch

            self._gatherer = Gatherer(self.manifest, _bytes(self.buffer, 0, len(self.buffer)))
        return self._gatherer

    # -- life --------------------------------------------------------------------------------

    def close(self, _close=os.close) -> None:
        """Unmap and drop the fd and the attachment. Tensors and arrays still taken from the table keep the
        mapping (not the fd) until the last of them goes; they stay valid.
        (os.close is bound, not looked up: __del__ may run at interpreter exit, after this module's globals.)"""
        self._gatherer = None
        self._names = None
        self._views = None
        m, self._map = self._map, None
        if m is not None:
            try:
                m.close()
            except BufferError:  # tensors still point into it: leave the mapping to die with them
                pass
        fd, self._fd = self._fd, -1
        if fd >= 0:
            _close(fd)
        attachment, self._attachment = self._attachment, None
        if attachment is not None:
            attachment.close()

    def __enter__(self) -> Table:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
