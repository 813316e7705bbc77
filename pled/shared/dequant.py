"""Reference dequantization of PLE rows with numpy: the meaning of the bytes pled stages.

Used by the demo, the tests and the benchmarks to prove rows read back from a
region are the table's real values. Clients that serve a model dequantize with
torch; this is the slow, obvious version to check them against.
"""
from __future__ import annotations

import numpy as np

# nvfp4 (e2m1): code = magnitude index | sign << 3.
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_LUT = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])


def _e4m3_lut() -> np.ndarray:
    """All 256 float8 e4m3fn values: bias 7, no infinities, 0x7F/0xFF are NaN."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    normal = (1 + man / 8) * np.exp2(exp - 7.0)
    subnormal = (man / 8) * 2.0**-6
    values = sign * np.where(exp == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E4M3_LUT = _e4m3_lut()


def fp8_e4m3(codes: np.ndarray) -> np.ndarray:
    return E4M3_LUT[codes]


def dequant_rows(layout: str, tensors: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` of one shard, dequantized to float32 [len(rows), width]."""
    if layout == "ples_fp8":
        w = fp8_e4m3(tensors["weight_fp8"][rows])
        return w * tensors["weight_scale"][rows][:, None]
    if layout == "ples_int4":
        packed = tensors["weight_i4"][rows]
        nibbles = np.empty((len(rows), packed.shape[1] * 2), dtype=np.int8)
        nibbles[:, 0::2] = packed & 0x0F  # low nibble first
        nibbles[:, 1::2] = packed >> 4
        scale = np.repeat(tensors["weight_scale"][rows].astype(np.float32), 16, axis=1)
        return (nibbles.astype(np.float32) - 8) * scale
    if layout == "ples_nvfp4":
        packed = tensors["weight_e2m1"][rows]
        codes = np.empty((len(rows), packed.shape[1] * 2), dtype=np.uint8)
        codes[:, 0::2] = packed & 0x0F
        codes[:, 1::2] = packed >> 4
        scale = np.repeat(fp8_e4m3(tensors["weight_scale"][rows]), 16, axis=1)
        return E2M1_LUT[codes] * scale * np.float32(tensors["weight_scale_2"])
    raise ValueError(f"no dequantization for layout {layout!r}")


NUMPY_DTYPES = {
    "U8": np.uint8, "I8": np.int8, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "BOOL": np.bool_,
    "F16": np.float16, "BF16": np.uint16, "I16": np.int16, "U16": np.uint16,
    "F32": np.float32, "I32": np.int32, "U32": np.uint32, "F64": np.float64, "I64": np.int64, "U64": np.uint64,
}


def view(buffer, offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A zero-copy numpy view of one tensor inside a buffer (fp8 as its uint8 codes)."""
    count = int(np.prod(shape)) if shape else 1
    return np.frombuffer(buffer, dtype=NUMPY_DTYPES[dtype], count=count, offset=offset).reshape(shape)
