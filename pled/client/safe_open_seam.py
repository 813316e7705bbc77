"""``safetensors.safe_open`` served from pled for the files a table holds.

Code that reads a sidecar itself (the PLE offload worker: ``from safetensors import safe_open``,
``safe_open(shard, framework="pt")``, ``get_tensor()``) gets an object that behaves as safetensors' own (0.8.0:
the same methods, results and exception types; tests/test_safe_open_fidelity.py), whose tensors (numpy arrays
for "np") are views of pled's region: zero copy, and the file is not read. They are writable as safetensors' are,
copy-on-write (pled.client.private_views): with "pt" and the "mmap" backend every tensor of one handle lies in one
private mapping, so a write shows in that handle's later tensors and slices and nowhere else, as in safetensors'
private mapping of the file; otherwise each tensor is its own, as safetensors' copies are. No write reaches pled's
pages. They stay valid after the handle is closed or dropped. Slices are copies where safetensors copies them
("np", or backend "pread").

Files pled does not hold, loads to a device other than the CPU, arguments pled does not serve (an unknown
keyword, a ``backend`` other than "mmap" or "pread", or any ``backend`` where the installed safe_open takes
none), and files with a dtype this process's torch cannot view (pled.client.held_files.State.lookup) go to the
real ``safe_open`` untouched. A public attribute that safetensors has and the stand-in does not define is taken
from a real ``safe_open`` of the same file, opened once for that handle, with one log line per attribute.
"""
from __future__ import annotations

import functools
import math
import operator
import sys

from pled.client import import_hook  # and pled.client.held_files, once safe_open is called: start-up stays cheap

SEAM = "safe_open"
MODULES = ("safetensors", "safetensors.torch", "safetensors.numpy")
TORCH = ("pt", "torch", "pytorch")  # safetensors' names for its frameworks that pled serves
NUMPY = ("np", "numpy")
BACKENDS = ("mmap", "pread")  # safetensors' storage backends: how it reads the file, nothing pled's memory needs
_fell_through: set[str] = set()  # attributes already logged as taken from the real safe_open


def _error(message: str) -> Exception:
    return __import__("safetensors").SafetensorError(message)  # there wherever this seam runs: it wraps safetensors


def _unsigned(value):
    value = value if value is None else operator.index(value)  # TypeError for what is not an integer
    if value is not None and not 0 <= value < 1 << 64:
        raise OverflowError("can't convert negative int to unsigned" if value < 0 else "int too big to convert")
    return value


def _indexers(shape: tuple, bits: int, index) -> tuple[tuple, list[int]]:
    """safetensors' own slicing (numpy, or the "pread" backend), not numpy's or torch's: its checks in its order,
    and its failures. Returns the index for numpy or torch (ints and slices) and the result's shape."""
    if isinstance(index, list):
        if index:
            raise _error("Non empty lists are not implemented")
        index = slice(0, 0)
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(item is Ellipsis for item in items) > 1:
        raise _error("Only one ellipsis (...) is allowed in slice index")
    out: list = []  # per dimension: an int, or (start, stop, step) with None for an open end
    for item in items:
        if item is Ellipsis:
            out += [(None, None, 1)] * max(len(shape) - len(items) + 1, 0)
        elif isinstance(item, slice):
            start, stop = _unsigned(item.start), _unsigned(item.stop)
            step = 1 if item.step is None else operator.index(item.step)
            if not -(1 << 63) <= step < 1 << 63:
                raise OverflowError("Python int too large to convert to C long")
            if step <= 0:
                raise _error(f"Slice step must be a positive integer, got {step}")
            out.append((start, stop, step))
        else:
            try:
                value = operator.index(item)
            except TypeError:
                value = None
            if value is None or not -(1 << 31) <= value < 1 << 31:
                raise _error(f"Unsupported slice index at position {len(out)}: expected slice, int, or ellipsis")
            size = shape[len(out)] if len(out) < len(shape) else 0
            if value + size < 0:
                raise _error(f"Invalid index {value} for dimension {len(out)} of size {size}")
            out.append(value + size if value < 0 else value)
    shown = ", ".join(str(i) if isinstance(i, int) else f"{'' if i[0] is None else i[0]}:{'' if i[1] is None else i[1]}"
                      + ("" if i[2] == 1 else f":{i[2]}") for i in out)

    def bad(problem: str) -> Exception:
        return _error(f"Error during slicing [{shown}] with shape {list(shape)}: {problem}")

    if len(out) > len(shape):
        raise bad("more slicing indexes than dimensions in tensor")
    ranges = [(i, i + 1, 1) if isinstance(i, int) else (i[0] or 0, size if i[1] is None else i[1], i[2])
              for i, size in zip(out, shape, strict=False)]  # out indexes the leading dimensions
    span, started = bits, False  # bits from one index of the dimension to the next; whether bytes are picked yet
    for dim in reversed(range(len(shape))):  # safetensors checks the last dimension first
        size = shape[dim]
        if dim < len(out):
            start, stop, step = ranges[dim]
            if start >= size or stop > size:  # a slice's start too, even start:start
                beyond = start if start >= size else stop - 1
                raise bad(f"index {beyond} out of bounds for tensor dimension #{dim} of size {size}")
            if span % 8 and not _on_bytes(ranges[dim], size, span, started):
                raise bad("The slice is slicing for subbytes dtypes, and the slice does not end up at a byte "
                          "boundary, this is invalid.")
            started = started or ranges[dim] != (0, size, 1)
        span *= size
    if any(start > stop for start, stop, _ in ranges):
        raise SystemError("Negative size passed to PyByteArray_FromStringAndSize")  # what safetensors 0.8.0 raises
    picks = tuple(i if isinstance(i, int) else slice(*r) for i, r in zip(out, ranges, strict=True))
    shape_out = ([len(range(*r)) for i, r in zip(out, ranges, strict=True) if not isinstance(i, int)]
                 + list(shape[len(out):]))
    return picks, shape_out


def _on_bytes(picked: tuple, size: int, span: int, started: bool) -> bool:
    """Whether safetensors can pick ``range(*picked)`` of a dimension whose indices are ``span`` bits apart (F4's
    last dimension: 4) in whole bytes."""
    start, stop, step = picked
    if not started:
        if picked == (0, size, 1):
            return True
        if step == 1:
            return start * span % 8 == 0 and stop * span % 8 == 0
        return all(n * span % 8 == 0 and (n + 1) * span % 8 == 0 for n in range(start, stop, step))
    return all(n * span % 8 == 0 for n in range(start, stop, step))


class _Slice:
    """safetensors' PySafeSlice: the shape and dtype as the file gives them; indexing as safetensors does it for
    the framework and backend (torch's own indexing for "pt" with "mmap", else safetensors' slicer, a copy)."""

    def __init__(self, handle: PledSafeOpen, index: int) -> None:
        self._handle, self._table, self._index = handle, handle._table, index
        self._numpy, self._slicer = handle._numpy, handle._numpy or handle._pread
        self._entry = handle._table.manifest.tensors[index]

    def get_shape(self) -> list[int]:
        return list(self._entry.shape)

    def get_dtype(self) -> str:
        return self._entry.dtype

    def __getitem__(self, index):
        table, i, e = self._table, self._index, self._entry
        if not self._slicer:
            return self._handle._private().tensor(e, file_shape=True)[index]  # the handle's storage, indexed by torch
        from pled.shared.region import DTYPE_BITS

        picks, shape = _indexers(e.shape, DTYPE_BITS[e.dtype], index)
        if self._numpy:
            return table.array(i)[picks + (Ellipsis,)].copy()  # a copy, as safetensors makes (an array, never a scalar)
        if not math.prod(shape):  # safetensors makes an empty result anew: an F4 one too
            return table.view(i).new_zeros(shape)
        return table.file_view(i)[picks].clone()


class PledSafeOpen:
    """Stands in for safetensors.safe_open on a file pled holds: the same methods, tensors from memory."""

    def __init__(self, held, framework: str, backend: str = "mmap", real=None) -> None:  # held: a held_files.Held
        self._held = held
        self._table = held.table
        self._entries = held.table.shard_entries(held.shard.index)  # name -> index in the table's manifest
        self._partial = held.partial  # a checkpoint file pled holds the PLE tensors of: the rest from the file
        self._numpy = framework in NUMPY
        self._pread = backend == "pread"  # safetensors then slices as for numpy, and reshapes F4 as it does there
        self._open = True
        self._opener = real  # () -> the real safe_open of this file, for attributes this class does not define
        self._real = None
        self._mapping = None  # "pt" with "mmap": the handle's one private mapping of its tensors' bytes, once used
        self._metadata: list | None = None  # [the header's __metadata__], once read

    def _check(self) -> None:
        if not self._open:
            raise _error("File is closed")

    def _find(self, name) -> int | None:
        """The tensor's index in the table's manifest; None for one of a partly held file that pled does not hold."""
        if not isinstance(name, str):
            raise TypeError(f"argument 'name': '{type(name).__name__}' object is not an instance of 'str'")
        self._check()
        if name not in self._entries:
            if self._partial:
                return None
            raise _error(f"File does not contain tensor {name}")
        return self._entries[name]

    def _file(self):
        """The real safe_open of this file (its header read, none of its data), for what pled does not hold."""
        if self._real is None:
            self._real = self._opener()
            if not self._open:
                self._real.__exit__(None, None, None)
        return self._real

    def _private(self):
        """This handle's copy-on-write mapping of the bytes its tensors lie in (made on first use)."""
        if self._mapping is None:
            from pled.client.private_views import PrivateMapping

            tensors = self._table.manifest.tensors
            spans = [(tensors[i].offset, tensors[i].offset + tensors[i].nbytes) for i in self._entries.values()]
            self._mapping = PrivateMapping(self._table, min(lo for lo, _ in spans), max(hi for _, hi in spans))
        return self._mapping

    def _own(self, index: int):
        """A mapping of tensor ``index``'s bytes for one result alone (safetensors copies it for each call)."""
        from pled.client.private_views import PrivateMapping

        e = self._table.manifest.tensors[index]
        return PrivateMapping(self._table, e.offset, e.offset + e.nbytes)

    def keys(self) -> list[str]:
        self._check()
        return self._file().keys() if self._partial else sorted(self._entries)

    def offset_keys(self) -> list[str]:
        self._check()
        if self._partial:
            return self._file().offset_keys()
        tensors = self._table.manifest.tensors
        return sorted(self._entries, key=lambda n: (tensors[self._entries[n]].offset, tensors[self._entries[n]].nbytes))

    def metadata(self) -> dict[str, str] | None:
        self._check()
        if self._partial:  # the file's header is not in an arrays region
            return self._file().metadata()
        if self._metadata is None:  # the file's header, as it lies in the region
            import json

            buf, at = self._table.buffer, self._held.shard.offset
            n = int.from_bytes(buf[at : at + 8], "little")
            self._metadata = [json.loads(bytes(buf[at + 8 : at + 8 + n])).get("__metadata__")]
        return None if self._metadata[0] is None else dict(self._metadata[0])

    def get_tensor(self, name: str):
        index = self._find(name)
        if index is None:
            return self._file().get_tensor(name)
        e = self._table.manifest.tensors[index]
        if self._numpy:
            return self._own(index).array(e)  # a dtype numpy lacks fails as under safetensors
        if self._pread:
            return self._own(index).tensor(e, file_shape=True)
        return self._private().tensor(e)  # a tensor of its own over the handle's storage, as safetensors gives

    def get_tensors(self) -> dict:
        return {name: self.get_tensor(name) for name in self.offset_keys()}

    def get_slice(self, name: str):
        index = self._find(name)
        if index is None:
            return self._file().get_slice(name)
        return _Slice(self, index)

    def prefetch(self, plan=None) -> None:
        """safetensors' prefetch (its main branch, unreleased): nothing to fetch, the tensors are in memory."""
        self._check()

    def __enter__(self) -> PledSafeOpen:
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        self._open = False
        if self._real is not None:
            self._real.__exit__(None, None, None)

    def __getattr__(self, name: str):
        """What safetensors added after this stand-in was written: from a real safe_open of the file."""
        if name.startswith("_") or self.__dict__.get("_opener") is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        value = getattr(self._file(), name)  # the real object's own AttributeError where it has none either
        if name not in _fell_through:
            from pled.client import held_files

            _fell_through.add(name)
            held_files.emit(held_files.logging.WARNING, "pled: safe_open(...).%s is not served by pled; %s (and "
                            "any held file it is used on) is read from disk for it", name, self._held.shard.path)
        return value


def _takes_backend(original) -> bool:
    import inspect

    try:
        return "backend" in inspect.signature(original).parameters
    except (TypeError, ValueError):
        return False


def _serve(original, filename, framework, device, kwargs) -> PledSafeOpen | None:
    if not isinstance(framework, str) or framework not in TORCH + NUMPY:
        return None
    if device is not None and not (isinstance(device, str) and device == "cpu"):
        return None  # safetensors takes None for the CPU too; anything else is another device or its error
    if kwargs and (set(kwargs) != {"backend"} or kwargs["backend"] not in BACKENDS or not _takes_backend(original)):
        return None  # the original's to serve, or to refuse with its own error
    path = filename.__fspath__() if hasattr(filename, "__fspath__") else filename  # a str or an os.PathLike
    if not isinstance(path, str):
        return None
    from pled.client import held_files

    st = held_files.state()
    held = st.lookup(path) if st is not None else None
    if st is None or held is None:
        return None
    opened = PledSafeOpen(held, framework, kwargs.get("backend", "mmap"),
                          functools.partial(original, filename, framework, device, **kwargs))
    st.count(held, SEAM)
    st.report(SEAM, complete_only=True)
    return opened


def wrap(original):
    def safe_open(filename, framework, device="cpu", *args, **kwargs):
        opened = None if args else _serve(original, filename, framework, device, kwargs)
        return opened if opened is not None else original(filename, framework, device, *args, **kwargs)

    safe_open.__wrapped__ = original
    safe_open.__pled__ = True
    safe_open.__doc__ = getattr(original, "__doc__", None)
    return safe_open


def patch(module) -> None:
    """Wrap ``module.safe_open`` (once), sharing the package's wrapper where it has one."""
    target = getattr(module, "safe_open", None)
    if callable(target) and not getattr(target, "__pled__", False):
        module.safe_open = wrap(target)
    # safetensors.torch imported the name from the package before this ran for it: share one wrapper
    pkg = sys.modules.get("safetensors")
    if module.__name__ != "safetensors" and pkg is not None and getattr(pkg.safe_open, "__pled__", False):
        module.safe_open = pkg.safe_open


def install() -> None:
    """Wrap ``safe_open`` in safetensors and its torch/numpy modules, now or when they are imported."""
    for name in MODULES:
        import_hook.after_import(name, patch)
