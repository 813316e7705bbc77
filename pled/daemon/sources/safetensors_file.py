"""The safetensors header, parsed and checked by hand.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(``{"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``),
then the data buffer that the offsets index. This module reads only the header,
never the data, and checks every claim the header makes against the file's size,
so a truncated, padded or foreign file is refused with its path and the reason.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass

from pled.shared import region
from pled.shared.boundary import BoundaryError, clip, load_json, open_regular
from pled.shared.errors import SidecarError
from pled.shared.tensors import nbits, shape_problem

# Bits per element, as the safetensors format defines its dtypes.
DTYPE_BITS = region.DTYPE_BITS  # the dtypes a region may hold: one list, which clients check too
# The reference implementation refuses headers over 100 MB; pled reads at most 8 MiB, which holds ~100,000
# tensors (a real checkpoint shard's header is a few hundred KB), and parsing that stays under a second or two.
MAX_HEADER = 8 * 1024 * 1024
MAX_TENSORS = 200_000
HEADER_DEPTH = 4  # the header object, a tensor's object, its shape or offsets list (__metadata__ is flat)
# Values (commas and brackets outside strings) a header may hold: ~7 a tensor, 9 bytes each at the densest, so the
# most an 8 MiB header holds; what json.loads builds without a hook (lists, strings) stays within a few tenths of a
# second of the GIL, which a reload's planning thread holds while it parses.
HEADER_VALUES = MAX_HEADER // 8


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset in the file, not in the data buffer
    nbytes: int


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    size: int  # the whole file
    header_len: int
    data_offset: int  # 8 + header_len
    tensors: tuple[TensorInfo, ...]  # in data order
    metadata: dict
    fingerprint: str  # sha256 of the header bytes: identifies the layout and offsets


def read_header(path: str) -> SafetensorsHeader:
    """Parse and validate ``path``'s header; raise SidecarError naming the file.
    The file is opened as the regular file it must be (boundary.open_regular) and at most
    MAX_HEADER bytes of it are read."""
    try:
        fd = open_regular(path)
    except BoundaryError as err:
        raise SidecarError(path, f"{err}; a shard must be a regular safetensors file") from err
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise SidecarError(path, f"truncated: {size} bytes, too short for a safetensors header")
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise SidecarError(path, f"truncated: {size} bytes, too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise SidecarError(
                path,
                f"not a safetensors file, or truncated: its first 8 bytes claim a {header_len}-byte header "
                f"but the file has {size} bytes",
            )
        if header_len > MAX_HEADER:
            raise SidecarError(path, f"its header is {header_len} bytes; pled reads headers of at most "
                                     f"{MAX_HEADER} bytes (a shard of a real checkpoint has a few hundred KB): "
                                     "split the file")
        raw = _pread_all(fd, header_len, 8)
    except OSError as err:
        raise SidecarError(path, f"cannot be read ({err.strerror or err}); check the file and the disk") from err
    finally:
        os.close(fd)
    if len(raw) != header_len:
        raise SidecarError(path, f"truncated while reading its {header_len}-byte header")
    return parse_header(path, size, raw)


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    chunks, done = [], 0
    while done < length:
        chunk = os.pread(fd, min(length - done, 1 << 24), offset + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def parse_header(path: str, size: int, raw: bytes) -> SafetensorsHeader:
    header_len = len(raw)
    try:
        doc = load_json(raw, max_bytes=MAX_HEADER, max_depth=HEADER_DEPTH, max_values=HEADER_VALUES)
    except BoundaryError as err:
        raise SidecarError(path, f"not a safetensors file: its header {err}") from err
    if not isinstance(doc, dict):
        raise SidecarError(path, "not a safetensors file: its header is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SidecarError(path, "__metadata__ must be an object of strings")
    if len(doc) > MAX_TENSORS:
        raise SidecarError(path, f"its header lists {len(doc)} tensors; pled accepts at most {MAX_TENSORS} per file")
    data_offset = 8 + header_len
    data_size = size - data_offset
    tensors = []
    for name, spec in doc.items():
        tensors.append(_tensor(path, name, spec, data_offset, data_size))
    tensors.sort(key=lambda t: (t.begin, t.nbytes))
    # The data buffer must be covered exactly: no overlap, no hole, nothing after the last tensor.
    end = data_offset
    for t in tensors:
        if t.begin != end:
            what = "overlaps the tensor before it" if t.begin < end else f"leaves a {t.begin - end}-byte hole before it"
            raise SidecarError(path, f"tensor {clip(t.name, 80)!r} {what}; the header does not describe this file")
        end = t.begin + t.nbytes
    if end != size:
        raise SidecarError(
            path,
            f"header describes {end - data_offset} bytes of tensor data but the file holds {data_size}"
            + (" (truncated copy?)" if end > size else " (trailing bytes)"),
        )
    return SafetensorsHeader(
        path=path,
        size=size,
        header_len=header_len,
        data_offset=data_offset,
        tensors=tuple(tensors),
        metadata=metadata,
        fingerprint=hashlib.sha256(raw).hexdigest(),
    )


def _tensor(path: str, name: str, spec: object, data_offset: int, data_size: int) -> TensorInfo:
    def bad(problem: str) -> SidecarError:
        return SidecarError(path, f"tensor {clip(name, 80)!r}: {problem}")

    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise bad("needs exactly dtype, shape and data_offsets")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise bad(f"unknown dtype {clip(dtype, 40)!r}")
    problem = shape_problem(shape)  # the rank and each extent first: no product of an unbounded shape is worked out
    if problem is not None or not isinstance(shape, list):
        raise bad(f"shape {clip(shape, 80)} {problem or 'is not a list of integers'}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"data_offsets {clip(offsets, 80)} is not [begin, end] with 0 <= begin <= end")
    bits = nbits(dtype, shape)  # at most 64 factors of 64 bits: a number of at most 1,240 digits
    if bits % 8:
        raise bad(f"{dtype}{clip(shape, 80)} is not a whole number of bytes")
    if offsets[1] - offsets[0] != bits // 8:
        raise bad(f"{dtype}{clip(shape, 80)} is {clip(bits // 8, 40)} bytes but data_offsets span "
                  f"{offsets[1] - offsets[0]}")
    if offsets[1] > data_size:
        raise bad(f"data ends at byte {offsets[1]} of a {data_size}-byte data buffer (truncated file?)")
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=data_offset + offsets[0], nbytes=bits // 8)


def write(path: str, tensors: list[tuple[str, str, tuple[int, ...], bytes | memoryview]],
          metadata: dict | None = None) -> str:
    """Write a safetensors file (used by the sidecar generator and tests), padding the header to 8 bytes, and fsync it.
    Returns the digest of the file's bytes that pled records while staging, as "<digests.OWN>:<hex>"."""
    from pled.shared.digests import OWN, new_hasher

    digest = new_hasher(OWN)
    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, data in tensors:
        n = memoryview(data).nbytes
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        for chunk in [struct.pack("<Q", len(raw)), raw, *(data for _, _, _, data in tensors)]:
            f.write(chunk)
            digest.update(chunk)
        f.flush()
        # Clean pages: the generator's output must be droppable from page cache like any sidecar on disk.
        os.fsync(f.fileno())
    return f"{OWN}:{digest.hexdigest()}"
