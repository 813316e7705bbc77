# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM 0.33.0's two PLE lookup kernels, with the decoders they call, carried for bench/device/check.py.

Carried from vLLM 0.33.0 (https://github.com/vllm-project/vllm, the ``vllm==0.33.0`` wheel), under the Apache
License 2.0 (pled's own licence too: LICENSE); copyright the contributors to the vLLM project. The device machine
cannot take vLLM itself (its Python files and its ``_C`` library are over a call's 64 MiB), so these travel instead:

- ``_e2m1_inline``, ``_e4m3_inline``: vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py
  (lines 28-62), unchanged;
- ``_lookup_nvfp4_ple_embedding_kernel``: vllm/models/qwen4_exp/common/ngram_embedding.py (lines 521-557), unchanged;
- ``_lookup_ple_embedding_from_pinned_kernel``: vllm/models/qwen4_exp/common/ngram_embedding.py (lines 592-623),
  unchanged;
- ``lookup_rows`` and ``lookup_nvfp4``: the launches of ``Qwen4ExpPLEEmbeddingMethod.lookup_from_pinned`` (lines
  267-283) and ``Qwen4ExpPLENvFp4EmbeddingMethod.lookup_from_pinned`` (lines 492-508) of the same file, with the
  layer's attributes passed as arguments (pled's change).

pled's only other change: ``triton`` and ``triton.language`` are imported directly, not through
``vllm.triton_utils``. tests/test_device_check.py holds each carried function to vLLM 0.33.0's text where that
wheel is unpacked (``make vllm-env``) and runs the kernels in Triton's CPU interpreter against pled's numpy
reference (pled/shared/dequant.py).
"""
import triton
import triton.language as tl


def lookup_rows(weight, ids, output, row_bytes: int, vocab_start: int, vocab_end: int) -> None:
    """Rows ``ids`` of ``weight`` (a uint8 CUDA view of ``row_bytes``-byte rows ``[vocab_start, vocab_end)``) into
    ``output`` as raw bytes; ids outside the range give zero rows. As vLLM's fp8 and bf16 lookup."""
    _lookup_ple_embedding_from_pinned_kernel[(ids.numel(),)](
        weight,
        ids,
        output,
        row_bytes,
        vocab_start,
        vocab_end,
        BLOCK_D=triton.next_power_of_2(row_bytes),
    )


def lookup_nvfp4(weight, weight_scale, weight_scale_2, ids, output, embedding_dim: int, vocab_start: int,
                 vocab_end: int) -> None:
    """Rows ``ids`` of an nvfp4 table (``weight`` [rows, dim/2] uint8, ``weight_scale`` [rows, dim/16] e4m3 as
    uint8, ``weight_scale_2`` the float32 global scale) decoded into ``output`` [n, dim] in its dtype; ids outside
    ``[vocab_start, vocab_end)`` give zero rows. As vLLM's nvfp4 lookup."""
    _lookup_nvfp4_ple_embedding_kernel[(ids.numel(),)](
        weight,
        weight_scale,
        weight_scale_2,
        ids,
        output,
        embedding_dim,
        vocab_start,
        vocab_end,
        BLOCK_D=triton.next_power_of_2(embedding_dim),
    )


# -- carried unchanged from vLLM 0.33.0 ---------------------------------------------------------------------------
# vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py


@triton.jit
def _e2m1_inline(nibble):
    """Decode an NVFP4 nibble (4 bits: 1 sign + 3 magnitude) to float32.

    Uses direct IEEE 754 bit construction.
    For magnitudes 2-7 the FP32 bit pattern is 0x3F000000 + (mag << 22),
    which is a single shift + add + bitcast.  Magnitudes 0 (zero) and 1
    (E2M1 subnormal = 0.5) are patched with two tl.where ops.
    """
    magnitude = nibble & 0x07
    sign = (nibble >> 3) & 1

    fp32_bits = 0x3F000000 + (magnitude.to(tl.int32) << 22)
    val = fp32_bits.to(tl.float32, bitcast=True)

    val = tl.where(magnitude == 0, 0.0, val)
    val = tl.where(magnitude == 1, 0.5, val)

    return tl.where(sign == 1, -val, val)


@triton.jit
def _e4m3_inline(byte):
    """Decode an FP8 E4M3FN byte to float32 without an FP8 pointer type.

    Typed FP8 loads need SM89+ in Triton; reading the scale as uint8 and
    decoding here keeps the caller portable.
    """
    bits = byte.to(tl.int32)
    exponent = (bits >> 3) & 0xF
    mantissa = (bits & 0x7).to(tl.float32)
    normal = (1.0 + mantissa * 0.125) * tl.exp2((exponent - 7).to(tl.float32))
    val = tl.where(exponent == 0, mantissa * 0.001953125, normal)
    val = tl.where((bits & 0x7F) == 0x7F, float("nan"), val)
    return tl.where((bits & 0x80) != 0, -val, val)


# vllm/models/qwen4_exp/common/ngram_embedding.py


@triton.jit
def _lookup_nvfp4_ple_embedding_kernel(
    weight_ptr,
    scale_ptr,
    global_scale_ptr,
    ids_ptr,
    output_ptr,
    embedding_dim,
    vocab_start,
    vocab_end,
    BLOCK_D: tl.constexpr,
):
    """Decode owned NVFP4 PLE rows; write zeros for rows another rank owns."""
    row = tl.program_id(0).to(tl.int64)
    idx = tl.load(ids_ptr + row).to(tl.int64)
    owned = (idx >= vocab_start) & (idx < vocab_end)
    local_idx = tl.where(owned, idx - vocab_start, 0)
    offsets = tl.arange(0, BLOCK_D)
    in_row = offsets < embedding_dim
    mask = owned & in_row
    packed = tl.load(
        weight_ptr + local_idx * (embedding_dim // 2) + offsets // 2,
        mask=mask,
        other=0,
    )
    # The low nibble holds the even element and the high nibble the odd one.
    codes = (packed >> ((offsets % 2) * 4)) & 0xF
    scales = _e4m3_inline(
        tl.load(
            scale_ptr + local_idx * (embedding_dim // 16) + offsets // 16,
            mask=mask,
            other=0,
        )
    )
    global_scale = tl.load(global_scale_ptr).to(tl.float32)
    values = _e2m1_inline(codes) * scales * global_scale
    tl.store(output_ptr + row * embedding_dim + offsets, values, mask=in_row)


@triton.jit
def _lookup_ple_embedding_from_pinned_kernel(
    weight_ptr: tl.pointer_type(tl.uint8),  # type: ignore[valid-type]
    ids_ptr,
    output_ptr: tl.pointer_type(tl.uint8),  # type: ignore[valid-type]
    row_bytes,
    tp_vocab_start,
    tp_vocab_end,
    BLOCK_D: tl.constexpr,
):
    """Copy TP-owned PLE rows as raw bytes from a CUDA view of pinned host memory.

    Byte pointers keep the storage dtype out of the kernel signature, so
    dtypes Triton cannot lower on the GPU (FP8 E4M3FN before SM89) still work.
    """
    row_id = tl.program_id(0).to(tl.int64)
    global_idx = tl.load(ids_ptr + row_id)
    in_range = (global_idx >= tp_vocab_start) & (global_idx < tp_vocab_end)
    local_idx = tl.where(in_range, global_idx - tp_vocab_start, 0)
    offsets = tl.arange(0, BLOCK_D)
    store_mask = offsets < row_bytes
    load_mask = store_mask & in_range
    values = tl.load(
        weight_ptr + local_idx * row_bytes + offsets,
        mask=load_mask,
        other=0,
    )
    tl.store(
        output_ptr + row_id * row_bytes + offsets,
        values,
        mask=store_mask,
    )
