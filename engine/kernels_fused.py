"""Fused shrink + expand: one launch per projection group, no h round trip through memory.

Opt-in (`kernels.lora_apply(..., fused=True)`): correct, but 1.2-1.4x slower than the separate kernels of
`engine.kernels_shrink` and `engine.kernels_expand` at Llama-7B decode shapes on an H200 (bench/RESULTS-gpu.md),
hence not the default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels_triton import (
    _TILE_PER_THREAD,
    MAX_SLICES,
    _chunk_row,
    _dot_precision,
    _programs,
    _share,
    _upcast_dots,
    b_rank_major,
)
from engine.lora_plan import SegmentPlan


@dataclass(frozen=True, slots=True)
class FusedConfig:
    """Launch shape of the fused kernel: `programs_per_sm` x SMs programs share out (chunk, slice) units,
    each unit's column tiles (`block_n` wide) split over the programs it gets."""

    block_k: int = 256
    block_n: int = 512
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2


def default_fused_config(block_m: int) -> FusedConfig:
    """Launch shape per chunk height, from bench/engine_gpu.py on an H200 (decode batch 64, rank 16)."""
    if block_m == 1:
        return FusedConfig(block_k=512, block_n=256, num_warps=4, programs_per_sm=2)
    if block_m <= 16:
        return FusedConfig(block_k=256, block_n=512, num_warps=4, programs_per_sm=2)
    return FusedConfig(block_k=64, block_n=64, num_warps=4, programs_per_sm=2)


@triton.jit
def _fused_kernel(
    y_ptr: tl.tensor,
    x_ptr: tl.tensor,
    a_ptr: tl.tensor,
    b_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    scalings_ptr: tl.tensor,
    order_ptr: tl.tensor,
    chunks_ptr: tl.tensor,
    num_real_ptr: tl.tensor,
    K: tl.tensor,
    n0: tl.tensor,
    n1: tl.tensor,
    n2: tl.tensor,
    n3: tl.tensor,
    stride_yt: tl.tensor,
    stride_xt: tl.tensor,
    stride_as: tl.tensor,
    stride_ar: tl.tensor,
    stride_bs: tl.tensor,
    stride_bn: tl.tensor,
    stride_br: tl.tensor,
    SLICES: tl.constexpr,
    N_TILES: tl.constexpr,
    N_ITERS: tl.constexpr,
    K_ITERS: tl.constexpr,
    R_SLICE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
) -> None:
    # Work unit = (chunk, slice); its programs split the slice's column tiles and each recomputes the unit's
    # h over the whole K (A's rank rows are small and shared in L2), so nothing is exchanged between programs.
    num_real = tl.load(num_real_ptr)
    parts, unit, part = _share(tl.program_id(0), tl.num_programs(0), num_real * SLICES, N_TILES)
    tiles_per_part = tl.cdiv(N_TILES, parts)
    chunk = unit // SLICES
    sl = unit % SLICES
    n_size = tl.where(sl == 0, n0, tl.where(sl == 1, n1, tl.where(sl == 2, n2, n3)))
    n_begin = part * tiles_per_part * BLOCK_N
    if (chunk >= num_real) | (n_begin >= n_size):
        return
    n_start = tl.where(sl > 0, n0, 0) + tl.where(sl > 1, n1, 0) + tl.where(sl > 2, n2, 0)
    n_stop = tl.minimum(n_begin + tiles_per_part * BLOCK_N, n_size)
    slot, start, length, _ = _chunk_row(chunks_ptr, chunk)
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:
        return
    scale = tl.load(scalings_ptr + slot)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    a_rows = a_ptr + slot * stride_as + (sl * R_SLICE + offs_r)[:, None].to(tl.int64) * stride_ar
    # B^T tiles [BLOCK_R, BLOCK_N]: rows past the rank are not read (rank-major B: whole rows skipped).
    b_rows = b_ptr + slot * stride_bs + offs_r[:, None] * stride_br
    if BLOCK_M == 1:
        # One token: matrix-vector products, no tensor-core tile padded to 16 tokens.
        tok = tl.load(order_ptr + start).to(tl.int64)
        acc_1 = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for i in range(K_ITERS):
            offs_k = i * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            xt = tl.load(x_ptr + tok * stride_xt + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            at = tl.load(a_rows + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            acc_1 += tl.sum(at.to(tl.float32) * xt[None, :], axis=1)
        h_1 = acc_1.to(b_ptr.dtype.element_ty).to(tl.float32)  # rounded as the reference rounds h
        for j in range(N_ITERS if UPCAST else tl.cdiv(n_stop - n_begin, BLOCK_N)):
            offs_n = n_begin + j * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < n_stop
            cols = (n_start + offs_n).to(tl.int64)
            bt = tl.load(b_rows + cols[None, :] * stride_bn, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            delta_1 = tl.sum(bt.to(tl.float32) * h_1[:, None], axis=0)
            y_1 = y_ptr + tok * stride_yt + cols
            old_1 = tl.load(y_1, mask=n_ok, other=0.0)
            tl.store(y_1, (old_1.to(tl.float32) + scale * delta_1).to(old_1.dtype), mask=n_ok)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        tok_ok = offs_m < length
        tok_m = tl.load(order_ptr + start + offs_m, mask=tok_ok, other=0).to(tl.int64)
        x_rows = x_ptr + tok_m[:, None] * stride_xt
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for i in range(K_ITERS):
            offs_k = i * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            xt = tl.load(x_rows + offs_k[None, :], mask=tok_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_rows + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                xt, at = xt.to(tl.float32), at.to(tl.float32)
            acc = tl.dot(xt, tl.trans(at), acc, input_precision=PRECISION)
        h = acc.to(b_ptr.dtype.element_ty)  # as the reference rounds h to the activations' dtype
        if UPCAST:
            h = h.to(tl.float32)
        y_rows = y_ptr + tok_m[:, None] * stride_yt
        # The interpreter needs compile-time trip counts (see _shrink_kernel); compiled code loops exactly.
        for j in range(N_ITERS if UPCAST else tl.cdiv(n_stop - n_begin, BLOCK_N)):
            offs_n = n_begin + j * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < n_stop
            cols = (n_start + offs_n).to(tl.int64)
            bt = tl.load(b_rows + cols[None, :] * stride_bn, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                bt = bt.to(tl.float32)
            delta = tl.dot(h, bt, input_precision=PRECISION)
            y_mask = tok_ok[:, None] & n_ok[None, :]
            old = tl.load(y_rows + cols[None, :], mask=y_mask, other=0.0)
            tl.store(y_rows + cols[None, :], (old.to(tl.float32) + scale * delta).to(old.dtype), mask=y_mask)


# Shared memory for one pipeline stage of the fused tile body's x and A tiles (3 stages stay well under
# the H200's 227 KiB; fp32 rank-64 tiles of 256 columns needed 260 KiB).
_STAGE_BYTES = 32 * 1024


def fused(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    plan: SegmentPlan,
    *,
    slice_sizes: Sequence[int] | None = None,
    config: FusedConfig | None = None,
) -> None:
    """y[:, slice l] += scaling * B_l @ (A_l @ x) for the plan's tokens, in place, in one launch.

    Same layouts and semantics as `shrink` then `expand` (module docstring; `b_stack` rank-major or
    out-major), but h never leaves registers: each program computes its (chunk, slice)'s h over the whole K,
    then its share of the slice's columns.
    """
    cfg = config or default_fused_config(plan.block_m)
    sizes = list(slice_sizes) if slice_sizes is not None else [b_stack.shape[1]]
    num_tokens, k_dim = x.shape
    r_slice = b_stack.shape[2]
    if not 1 <= len(sizes) <= MAX_SLICES or sum(sizes) != b_stack.shape[1] or y.shape[1] != b_stack.shape[1]:
        raise ValueError("slice_sizes must add up to b_stack's and y's output width")
    if a_stack.shape[1] != len(sizes) * r_slice or a_stack.shape[2] != k_dim or y.shape[0] != num_tokens:
        raise ValueError("a_stack must be [S, L*R, K] for L slices of rank R and x's K")
    if any(t.stride(-1) != 1 for t in (y, x, a_stack)):
        raise ValueError("y, x and a_stack need a contiguous last dimension")
    b_rank_major(b_stack)  # N or R contiguous
    block_r = max(triton.next_power_of_2(r_slice), 16)
    block_m = 1 if plan.block_m == 1 else max(16, triton.next_power_of_2(plan.block_m))
    # Both bodies hold a whole B tile in registers: cap it below spilling (a rank-64 stack with 1024-wide
    # tiles ran 29x slower). The tile body also stages x and A tiles in shared memory per pipeline stage.
    limit = _TILE_PER_THREAD * 32 * cfg.num_warps // block_r
    block_n = max(16, min(cfg.block_n, 2 * limit))
    if block_m == 1:
        block_k = max(16, min(cfg.block_k, limit))
    else:
        per_stage = (block_m + block_r) * x.element_size()
        block_k = max(16, min(cfg.block_k, triton.next_power_of_2(_STAGE_BYTES // per_stage + 1) // 2))
    n_tiles = triton.cdiv(max(sizes), block_n)
    units = plan.num_chunks * len(sizes)
    programs = _programs(y.device, cfg.programs_per_sm, units)
    fewest_parts = min(max(programs // units, 1), n_tiles)
    _fused_kernel[(programs,)](
        y,
        x,
        a_stack,
        b_stack,
        ranks,
        scalings,
        plan.token_order,
        plan.chunks,
        plan.num_real,
        k_dim,
        *(sizes + [0] * (MAX_SLICES - len(sizes))),
        y.stride(0),
        x.stride(0),
        a_stack.stride(0),
        a_stack.stride(1),
        b_stack.stride(0),
        b_stack.stride(1),
        b_stack.stride(2),
        SLICES=len(sizes),
        N_TILES=n_tiles,
        N_ITERS=triton.cdiv(n_tiles, fewest_parts),
        K_ITERS=triton.cdiv(k_dim, block_k),
        R_SLICE=r_slice,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        PRECISION=_dot_precision(x.dtype),
        UPCAST=_upcast_dots(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
