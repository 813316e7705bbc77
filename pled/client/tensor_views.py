"""The torch and numpy views of a mapped table's bytes (pled.client.mapped_table's Table makes them): the dtype of
each safetensors dtype, a tensor at any byte offset of the mapping that keeps the mapping alive while it lives,
and the read-only name-to-view mapping. torch is imported only when a view is asked for."""
from __future__ import annotations

import mmap
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from pled.shared import region

if TYPE_CHECKING:
    import torch

# The torch dtype of each safetensors dtype, as safetensors names it (a torch without one cannot view the files
# that hold it: ``unviewable``). F4 is two values a byte, last dimension halved, as safetensors' own reader does it.
_TORCH_DTYPES = {
    "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "U16": "uint16", "U32": "uint32",
    "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
    "F4": "float4_e2m1fn_x2",
}



def torch_dtype(code: str):
    """The torch dtype of safetensors dtype ``code``; None where this torch has none (or there is no torch)."""
    try:
        import torch
    except ImportError:
        return None
    name = _TORCH_DTYPES.get(code)
    return getattr(torch, name, None) if name else None


def numpy_dtype(code: str):
    """numpy's dtype for safetensors dtype ``code``, looked up as safetensors' reader looks it up, so that one this
    numpy lacks fails alike: AttributeError for F8 and F4, TypeError for BF16 (unless ml_dtypes is loaded)."""
    if code == "BF16":
        return np.dtype("bfloat16")
    return bool if code == "BOOL" else getattr(np, _TORCH_DTYPES[code])  # numpy's names are torch's


def _no_view(entry: region.TensorEntry) -> str | None:
    if torch_dtype(entry.dtype) is None:
        return f"its tensor {entry.name!r} is {entry.dtype}, which this process's torch has no dtype for"
    if entry.dtype == "F4" and (not entry.shape or entry.shape[-1] % 2):  # safetensors' reader refuses it too
        return f"its F4 tensor {entry.name!r} has an odd last dimension {list(entry.shape)}, which torch cannot pack"
    return None


def _make_view(buffer: mmap.mmap, entry: region.TensorEntry) -> torch.Tensor:
    """The tensor at ``entry``: a view of ``buffer`` at any byte offset (the format does not align tensors, and
    torch reads an unaligned view as it is), shaped as safetensors' own reader shapes it."""
    import torch

    dtype = getattr(torch, _TORCH_DTYPES[entry.dtype])
    shape = tuple(entry.shape)
    if entry.dtype == "F4":  # two values a byte: safetensors halves the last dimension (Table.unviewable: odd ones)
        shape = shape[:-1] + (shape[-1] // 2,)
    if not entry.nbytes // dtype.itemsize:
        return torch.empty(shape, dtype=dtype)
    return _bytes(buffer, entry.offset, entry.nbytes).view(dtype).reshape(shape)


def _bytes(buffer: mmap.mmap, offset: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of the mapping from ``offset`` as a uint8 tensor that keeps the mapping exported while it lives
    (through the numpy array under it), so ``Table.close`` cannot unmap memory a tensor still points into: the
    mapping then goes with the last such tensor. (``torch.frombuffer`` keeps no export: a view of it outlived
    the mapping and faulted.) Its storage starts at ``offset``, so any dtype views it at any byte offset."""
    import torch

    with warnings.catch_warnings():  # the buffer is read-only on purpose: the mapping is PROT_READ
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8, count=nbytes, offset=offset))


class TensorViews(Mapping):
    """Read-only mapping of tensor names to a Table's views (its one cache, ``Table.view``)."""

    def __init__(self, view: Callable[[int], torch.Tensor], entries: dict[str, int]) -> None:
        self._view = view
        self._entries = entries

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._view(self._entries[name])

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
