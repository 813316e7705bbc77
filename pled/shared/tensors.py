"""Tensors as pled reads them from what it does not trust (a safetensors header, a region's manifest): the dtypes
it knows, and the checks of a shape that come before any arithmetic on it.

A shape is refused before its size is worked out when it has more than ``MAX_DIMS`` dimensions, an extent that is
not a non-negative integer, or one of more than ``MAX_EXTENT_BITS`` bits: so the product of the extents costs at
most a few microseconds (64 factors of 64 bits), and no number in an error message is too long to print.
"""
from __future__ import annotations

import math

# Bits per element of every dtype the safetensors format defines (and so a region may hold): pled's sidecar and
# checkpoint readers stage exactly these, and a client refuses a region with any other.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "I64": 64, "U64": 64, "F64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
MAX_DIMS = 64  # more than any tensor has
MAX_EXTENT_BITS = 64  # an extent of 2**64 or more is no tensor's: refused before any product


def shape_problem(shape: object) -> str | None:
    """Why ``shape`` is not a shape pled accepts (None: it is one): a list or tuple of at most MAX_DIMS integers
    (not booleans), each from 0 to 2**64 - 1. Costs O(len(shape)) and stops at MAX_DIMS + 1 items."""
    if not isinstance(shape, (list, tuple)):
        return "is not a list of integers"
    if len(shape) > MAX_DIMS:
        return f"has {len(shape)} dimensions; at most {MAX_DIMS} are accepted"
    for extent in shape:
        if type(extent) is not int:
            return "is not a list of integers"
        if extent < 0:
            return "has a negative extent"
        if extent.bit_length() > MAX_EXTENT_BITS:
            return f"has an extent of {extent.bit_length()} bits; at most {MAX_EXTENT_BITS} are accepted"
    return None


def nbits(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    """Bits of a tensor of ``dtype`` and ``shape`` (both checked first: DTYPE_BITS, ``shape_problem``)."""
    return math.prod(shape) * DTYPE_BITS[dtype]
