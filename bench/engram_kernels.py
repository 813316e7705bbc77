# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM 0.33.0's Engram lookup kernel, carried for bench/device/engram.py (the device check's Engram section).

Carried from vLLM 0.33.0 (https://github.com/vllm-project/vllm, the ``vllm==0.33.0`` wheel), under the Apache
License 2.0 (pled's own licence too: LICENSE); copyright the contributors to the vLLM project. The device machine
cannot take vLLM itself (over a call's 64 MiB), so this travels instead:

- ``_engram_lookup_kernel``: vllm/models/deepseek_v41/common/engram.py (lines 629-730), unchanged;
- ``_SORTED_IS_CONSTEXPR``: the same file (lines 624-626); vLLM's is true only for Triton 3.8 on ROCm, pled's is
  ``False`` (the device check runs on CUDA, and ``vllm.platforms`` does not travel);
- ``lookup``: the launch of ``ParallelEngramEmbedding.lookup`` (lines 1180-1235 of the same file) for a table in
  host memory (``cpu_offload``, no peer rows), with the layer's attributes passed as arguments (pled's change).

pled's only other change: ``triton`` and ``triton.language`` are imported directly, not through
``vllm.triton_utils``. tests/test_device_check_engram.py holds the carried kernel to vLLM 0.33.0's text where that
wheel is unpacked (``make vllm-env``).
"""
import triton
import triton.language as tl

_SORTED_IS_CONSTEXPR = tl.constexpr(False)


def lookup(weight, scales, indices, out, vocab_start: int, vocab_end: int, head_start: int, local_heads: int,
           total_heads: int, dim: int, block_size: int, num_sms: int, sort: bool = False) -> None:
    """Rows ``indices`` ([tokens, total_heads] global row ids, heads ``[head_start, head_start + local_heads)``
    looked up) of an Engram table (``weight`` [rows, dim] float8_e4m3fn and ``scales`` [rows, dim/block_size] ue8m0
    bytes, rows ``[vocab_start, vocab_end)``, CUDA views) into ``out``: [tokens, local_heads, dim] bf16 (dequantized)
    or, uint8, each row's ``dim`` value bytes then its scale bytes; ids outside the range give zero rows. As
    ``ParallelEngramEmbedding.lookup`` with ``cpu_offload`` (``sort`` is its sorted path for large batches)."""
    import torch

    rows = indices.shape[0] * local_heads
    if not rows:
        return
    ids_stride_t, ids_stride_h = indices.stride()
    dst = indices
    if sort:
        local = indices[:, head_start:head_start + local_heads] - vocab_start
        if (pad := local_heads - local.shape[1]) > 0:
            local = torch.nn.functional.pad(local, (0, pad), value=-1)
        indices, dst = local.flatten().sort()
        dst = dst.int()
    tiles = triton.cdiv(rows, 16)
    grid = min(tiles, num_sms)
    _engram_lookup_kernel[(grid,)](
        weight,
        scales,
        indices,
        dst,
        out,
        vocab_start,
        vocab_end,
        rows,
        ids_stride_t,
        ids_stride_h,
        HEAD_START=head_start,
        LOCAL_HEADS=local_heads,
        TOTAL_HEADS=total_heads,
        DIM=dim,
        QUANT_BLOCK=block_size,
        BLOCK_R=16,
        GRID=grid,
        SORTED=sort,
        PACKED=out.dtype == torch.uint8,
        OUT_STRIDE=out.stride(0),
        PEER_ROWS=0,
    )


# -- carried unchanged from vLLM 0.33.0 ---------------------------------------------------------------------------
# vllm/models/deepseek_v41/common/engram.py


@triton.jit(
    do_not_specialize=[
        "vocab_start",
        "vocab_end",
        "num_rows",
        "ids_stride_t",
        "ids_stride_h",
        "GRID",
        *(() if _SORTED_IS_CONSTEXPR else ("SORTED",)),
    ]
)
def _engram_lookup_kernel(
    weight,
    scales,
    ids,
    sorted_dst,
    out,
    vocab_start,
    vocab_end,
    num_rows,
    ids_stride_t,
    ids_stride_h,
    HEAD_START: tl.constexpr,
    LOCAL_HEADS: tl.constexpr,
    TOTAL_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    QUANT_BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GRID,
    SORTED: tl.constexpr if _SORTED_IS_CONSTEXPR else None,  # type: ignore[valid-type]
    PACKED: tl.constexpr,
    OUT_STRIDE: tl.constexpr,
    PEER_ROWS: tl.constexpr = 0,
):
    """Gather FP8 rows as packed values/scales or dequantized BF16.

    Only this rank's heads are read; padded heads write zeros for all-gather.
    `weight`/`scales` may address pinned host memory through UVA. If SORTED,
    `ids` holds rows relative to vocab_start in table order and `sorted_dst`
    their output rows.
    """
    cols = tl.arange(0, DIM)
    scale_cols = cols // QUANT_BLOCK
    for base in tl.range(tl.program_id(0) * BLOCK_R, num_rows, GRID * BLOCK_R):
        rows = base + tl.arange(0, BLOCK_R)
        valid = rows < num_rows
        if SORTED:
            local = tl.load(ids + rows, mask=valid, other=-1).to(tl.int64)
            dst = tl.load(sorted_dst + rows, mask=valid, other=0).to(tl.int32)
            owned = (local >= 0) & (local < vocab_end - vocab_start)
        else:
            head = HEAD_START + rows % LOCAL_HEADS
            token = (rows // LOCAL_HEADS).to(tl.int64)
            index = tl.load(
                ids + token * ids_stride_t + head * ids_stride_h,
                mask=valid & (head < TOTAL_HEADS),
                other=-1,
            ).to(tl.int64)
            dst = rows
            owned = valid & (head < TOTAL_HEADS)
            owned &= (index >= vocab_start) & (index < vocab_end)
            local = index - vocab_start
        local = tl.where(owned, local, 0)
        if PEER_ROWS:
            # `weight` holds each rank's buffer: PEER_ROWS rows, then scales.
            owner = local // PEER_ROWS
            peer = tl.load(weight + owner, mask=owned, other=0)
            local -= owner * PEER_ROWS
            row_weight = peer.to(tl.pointer_type(tl.float8e4nv))
            row_scales = (peer + PEER_ROWS * DIM).to(tl.pointer_type(tl.uint8))
        else:
            row_weight, row_scales = weight, scales
        row_weight += local * DIM
        row_scales += local * (DIM // QUANT_BLOCK)
        values = tl.load(
            row_weight[:, None] + cols[None, :], mask=owned[:, None], other=0.0
        )
        scale = tl.load(
            row_scales[:, None] + scale_cols[None, :], mask=owned[:, None], other=0
        )
        if PACKED:
            width: tl.constexpr = DIM + DIM // QUANT_BLOCK
            dst = dst.to(tl.int64)
            dst = dst // LOCAL_HEADS * OUT_STRIDE + dst % LOCAL_HEADS * width
            tl.store(
                out + dst[:, None] + cols[None, :],
                values.to(tl.uint8, bitcast=True),
                mask=valid[:, None],
            )
            tl.store(
                out + dst[:, None] + DIM + scale_cols[None, :],
                scale,
                mask=valid[:, None] & (cols[None, :] % QUANT_BLOCK == 0),
            )
        else:
            # ue8m0 is a power of two, so its byte *is* the fp32 exponent field.
            scale = (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            tl.store(
                out + dst[:, None] * DIM + cols[None, :],
                (values.to(tl.float32) * scale).to(tl.bfloat16),
                mask=valid[:, None],
            )
