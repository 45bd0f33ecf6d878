"""The segmented LoRA shrink in triton (the layout, work units and latency options: `engine.kernels_triton`).

Shrink reads `a_stack[S, L*R, K]` (the slices' A stacked along the rank axis) and adds into a zeroed
fp32 `h[T, L*R]` (atomic adds, one per K split):

    for chunk c, slice l, rank block rb < cdiv(ranks[s], 16), K range Kp:    # one program each
        s = chunk_slot[c]; rows = l*R + [rb*16, rb*16 + 16) that are < l*R + ranks[s]
        for t in tokens of c:
            h[t, rows] += a_stack[s, rows, Kp] @ x[t, Kp]

A's rows are masked at each slot's rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels_triton import (
    _TILE_PER_THREAD,
    MAX_SLICES,
    RANK_BLOCK,
    ShrinkConfig,
    _await_previous,
    _chunk_row,
    _dot_precision,
    _exit_in_order,
    _latency,
    _locate,
    _programs,
    _row_dots,
    _scanned_chunks,
    _static_loops,
    _upcast_dots,
    default_configs,
)
from engine.lora_plan import SegmentPlan


@triton.jit
def _shrink_kernel(
    x_ptr: tl.tensor,
    a_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    order_ptr: tl.tensor,
    chunks_ptr: tl.tensor,
    num_real_ptr: tl.tensor,
    h_ptr: tl.tensor,
    K: tl.tensor,
    n_chunks: tl.tensor,
    r_slice: tl.tensor,
    stride_xt: tl.tensor,
    stride_as: tl.tensor,
    stride_ar: tl.tensor,
    stride_ht: tl.tensor,
    SLICES: tl.constexpr,
    R_BLOCKS: tl.constexpr,
    CHUNKS: tl.constexpr,
    K_BLOCKS: tl.constexpr,
    K_ITERS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    STATIC_LOOPS: tl.constexpr,
    USE_PDL: tl.constexpr,
    GDC: tl.constexpr,
    SHORT_CHAIN: tl.constexpr,
) -> None:
    # Work unit = (chunk, slice, rank block); its programs split K.
    num_real = tl.load(num_real_ptr)
    past, chunk, rank, j, nb, splits, split = _locate(
        chunks_ptr, ranks_ptr, num_real, n_chunks, SLICES, R_BLOCKS, BLOCK_R, K_BLOCKS, CHUNKS
    )
    blocks_per_split = tl.cdiv(K_BLOCKS, splits)
    k_begin = split * blocks_per_split * BLOCK_K
    if past | (k_begin >= K):
        _exit_in_order(GDC)
        return
    slot, start, length, first_tok = _chunk_row(chunks_ptr, chunk)
    k_stop = tl.minimum(k_begin + blocks_per_split * BLOCK_K, K)
    offs_k0 = k_begin + tl.arange(0, BLOCK_K)
    k0_ok = offs_k0 < k_stop
    offs_m = tl.arange(0, BLOCK_M)
    tok_ok = offs_m < length
    if SHORT_CHAIN:  # token loads need only the chunk row: in flight beside the rank (or the A tile)
        if BLOCK_M == 1:
            if not USE_PDL:
                xt_1 = tl.load(x_ptr + first_tok * stride_xt + offs_k0, mask=k0_ok, other=0.0)
        else:
            tok_m = tl.load(order_ptr + start + offs_m, mask=tok_ok, other=0).to(tl.int64)
    local = (j % nb) * BLOCK_R + tl.arange(0, BLOCK_R)
    if CHUNKS == 0:
        rank = tl.load(ranks_ptr + slot)
        if (j % nb) * BLOCK_R >= rank:
            _exit_in_order(GDC)
            return  # this rank block lies wholly past the slot's rank
    row_ok = local < rank
    rows = (j // nb) * r_slice + local
    a_rows = a_ptr + slot * stride_as + rows[:, None].to(tl.int64) * stride_ar
    # The first K block may run ahead of the loop: its A tile is read before the previous kernel has
    # finished (PDL), or its x was read before the rank arrived (short chain).
    PEELED: tl.constexpr = 1 if USE_PDL or (SHORT_CHAIN and BLOCK_M == 1) else 0
    # Triton's interpreter cannot loop to a run-time bound under numpy >= 2.4: there the trip count is
    # K_ITERS, an upper bound, and blocks past this split's range are masked off (they move no bytes).
    # (Inline in each range(): the interpreter turns an assigned int into a tensor.)
    if BLOCK_M == 1:
        # One token: a plain dot product per row, no tensor-core tile padded to 16 tokens.
        tok = first_tok if SHORT_CHAIN else tl.load(order_ptr + start).to(tl.int64)
        acc_1 = tl.zeros((BLOCK_R,), dtype=tl.float32)
        if PEELED:
            at_1 = tl.load(a_rows + offs_k0[None, :], mask=row_ok[:, None] & k0_ok[None, :], other=0.0)
            _await_previous(GDC)
            if USE_PDL:
                xt_1 = tl.load(x_ptr + tok * stride_xt + offs_k0, mask=k0_ok, other=0.0)
            acc_1 += _row_dots(at_1, xt_1)
        for i in range(PEELED, K_ITERS if STATIC_LOOPS else tl.cdiv(k_stop - k_begin, BLOCK_K)):
            offs_k = k_begin + i * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_stop
            xt = tl.load(x_ptr + tok * stride_xt + offs_k, mask=k_ok, other=0.0)
            at = tl.load(a_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc_1 += _row_dots(at, xt)
        tl.atomic_add(h_ptr + tok * stride_ht + rows, acc_1, mask=row_ok, sem="relaxed")
    else:
        if not SHORT_CHAIN:
            tok_m = tl.load(order_ptr + start + offs_m, mask=tok_ok, other=0).to(tl.int64)
        x_rows = x_ptr + tok_m[:, None] * stride_xt
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        if PEELED:
            at0 = tl.load(a_rows + offs_k0[None, :], mask=row_ok[:, None] & k0_ok[None, :], other=0.0)
            _await_previous(GDC)
            xt0 = tl.load(x_rows + offs_k0[None, :], mask=tok_ok[:, None] & k0_ok[None, :], other=0.0)
            if UPCAST:
                xt0, at0 = xt0.to(tl.float32), at0.to(tl.float32)
            acc = tl.dot(xt0, tl.trans(at0), acc, input_precision=PRECISION)
        for i in range(PEELED, K_ITERS if STATIC_LOOPS else tl.cdiv(k_stop - k_begin, BLOCK_K)):
            offs_k = k_begin + i * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_stop
            xt = tl.load(x_rows + offs_k[None, :], mask=tok_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                xt, at = xt.to(tl.float32), at.to(tl.float32)
            acc = tl.dot(xt, tl.trans(at), acc, input_precision=PRECISION)
        out = h_ptr + tok_m[:, None] * stride_ht + rows[None, :]
        tl.atomic_add(out, acc, mask=tok_ok[:, None] & row_ok[None, :], sem="relaxed")


def shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    ranks: torch.Tensor,
    plan: SegmentPlan,
    h: torch.Tensor,
    *,
    num_slices: int = 1,
    config: ShrinkConfig | None = None,
    pdl: bool | None = None,
    short_chain: bool | None = None,
) -> None:
    """h[t] += A[slot(t)] @ x[t] for the plan's tokens (module docstring); `h` is fp32 `[T, L*R]`, zeroed
    by the caller (one memset can serve every projection of a step).

    `pdl` and `short_chain` pick the latency options (module docstring); None takes the module's defaults.
    """
    cfg = config or default_configs(plan.block_m)[0]
    latency = _latency(x.device, pdl, short_chain)
    num_tokens, k_dim = x.shape
    lr = a_stack.shape[1]
    if x.stride(-1) != 1 or a_stack.stride(-1) != 1 or h.stride(-1) != 1:
        raise ValueError("x, a_stack and h need a contiguous last dimension")
    if not 1 <= num_slices <= MAX_SLICES or lr % num_slices:
        raise ValueError(f"a_stack rows ({lr}) must split into 1..{MAX_SLICES} equal slices")
    if h.shape != (num_tokens, lr) or h.dtype != torch.float32:
        raise ValueError(f"h must be float32 [{num_tokens}, {lr}]")
    r_slice = lr // num_slices
    block_r = max(min(triton.next_power_of_2(r_slice), cfg.block_r), RANK_BLOCK.value)
    block_k = cfg.block_k
    if plan.block_m == 1:  # the per-token body holds its whole A tile in registers: cap it below spilling
        block_k = max(16, min(block_k, _TILE_PER_THREAD * 32 * cfg.num_warps // block_r))
    r_blocks = triton.cdiv(r_slice, block_r)
    k_blocks = triton.cdiv(k_dim, block_k)
    most_units = plan.num_chunks * num_slices * r_blocks
    programs = _programs(x.device, cfg.programs_per_sm, most_units)
    fewest_splits = min(max(programs // most_units, 1), k_blocks)
    _shrink_kernel[(programs,)](
        x,
        a_stack,
        ranks,
        plan.token_order,
        plan.chunks,
        plan.num_real,
        h,
        k_dim,
        plan.num_chunks,
        r_slice,
        x.stride(0),
        a_stack.stride(0),
        a_stack.stride(1),
        h.stride(0),
        SLICES=num_slices,
        R_BLOCKS=r_blocks,
        CHUNKS=_scanned_chunks(plan),
        K_BLOCKS=k_blocks,
        K_ITERS=triton.cdiv(k_blocks, fewest_splits) if _static_loops() else 0,  # else unused: no recompiles
        BLOCK_M=plan.block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        PRECISION=_dot_precision(x.dtype),
        UPCAST=_upcast_dots(),
        STATIC_LOOPS=_static_loops(),
        USE_PDL=latency.pdl_order,
        GDC=latency.gdc,
        SHORT_CHAIN=latency.short_chain,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **latency.launch(),
    )
