"""The segmented LoRA expand in triton (the layout, work units and latency options: `engine.kernels_triton`).

Expand reads `b_stack[S, N0+...+N(L-1), R]` (the slices' B stacked along the output axis) and adds into
the fused output `y[T, N0+...]` in place; slice l uses columns [l*R, l*R + ranks[s]) of h. The programs
of a (chunk, slice)'s units split its columns, each looping over the rank in blocks of 16. With bt the
rank-major view of B (`bt[s, r, n] = b_stack[s, n, r]`):

    for chunk c, slice l, column range Np:          # a rank-64 chunk: 4x the programs of a rank-16 one
        s = chunk_slot[c]
        for t in tokens of c:
            y[t, Np] += scalings[s] * h[t, l*R : l*R + ranks[s]] @ bt[s, :ranks[s], Np]

B should be stored rank-major (storage `[S, R, N]`, passed as `store.transpose(-1, -2)`: N contiguous), as
the engine's stacks are: a rank-r slot's B is then r contiguous rows, expand reads only the rows below the
rank, 16 bytes wide along N, and a rank-8 adapter in a rank-64 stack moves only its own bytes. Out-major B
(R contiguous) is accepted too; there the last rank block is read up to its end (zero by the layout
contract, and met by h masked to zero) to keep its loads 16 bytes wide along R, and a low rank wastes most of
every 32-byte sector. Tokens with slot -1 are in no chunk: their h rows stay zero and their y rows untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from engine.kernels_triton import (
    _TILE_PER_THREAD,
    MAX_SLICES,
    RANK_BLOCK,
    ExpandConfig,
    _await_previous,
    _chunk_row,
    _dot_precision,
    _exit_in_order,
    _latency,
    _locate,
    _programs,
    _scanned_chunks,
    _static_loops,
    _upcast_dots,
    b_rank_major,
    default_configs,
)
from engine.lora_plan import SegmentPlan


@triton.jit
def _b_block(
    b_cols: tl.tensor,
    n_ok: tl.tensor,
    stride_br: tl.tensor,
    rank: tl.tensor,
    rb: tl.tensor,
    R_SLICE: tl.constexpr,
    RANK_MAJOR: tl.constexpr,
) -> tl.tensor:
    """Rank rows [rb*RANK_BLOCK, +RANK_BLOCK) of a B^T tile, [RANK_BLOCK, BLOCK_N] (`b_cols`: the tile's
    columns at rank 0, [1, BLOCK_N]). Rank-major B (N contiguous): rows past the rank are masked off, so a
    low-rank adapter reads only its own rows; the mask is constant along N and the loads stay 16 bytes wide.
    Out-major B (R contiguous): rows past the rank are zero by the layout and meet zeros of h, so only the
    stack's edge masks them, as a mask at the rank would make the loads along R 2 bytes wide."""
    offs_r = rb * RANK_BLOCK + tl.arange(0, RANK_BLOCK)
    ptrs = b_cols + offs_r[:, None] * stride_br
    if RANK_MAJOR:
        return tl.load(ptrs, mask=(offs_r < rank)[:, None] & n_ok[None, :], other=0.0)
    if R_SLICE // RANK_BLOCK * RANK_BLOCK == R_SLICE:  # (the interpreter lacks int % constexpr)
        return tl.load(ptrs, mask=n_ok[None, :], other=0.0)
    return tl.load(ptrs, mask=(offs_r < R_SLICE)[:, None] & n_ok[None, :], other=0.0)


@triton.jit
def _h_block(h_rows: tl.tensor, rank: tl.tensor, rb: tl.tensor, B_DTYPE: tl.constexpr) -> tl.tensor:
    """Columns [rb*RANK_BLOCK, +RANK_BLOCK) of h (`h_rows`: the rows' starts, [M, 1] or a scalar pointer),
    zero past the rank, rounded as the reference rounds h to the activations' dtype and back to fp32. A tile's
    padding rows point at token 0: read, never stored."""
    offs_r = rb * RANK_BLOCK + tl.arange(0, RANK_BLOCK)
    h = tl.load(h_rows + offs_r, mask=offs_r < rank, other=0.0)
    return h.to(B_DTYPE).to(tl.float32)


@triton.jit
def _col_dots(bt: tl.tensor, h: tl.tensor) -> tl.tensor:
    """h . bt[:, n] in fp32, per column n."""
    return tl.sum(bt.to(tl.float32) * h.to(tl.float32)[:, None], axis=0)


@triton.jit
def _token_delta(
    bt0: tl.tensor,
    h0: tl.tensor,
    b_cols: tl.tensor,
    n_ok: tl.tensor,
    stride_br: tl.tensor,
    h_row: tl.tensor,
    rank: tl.tensor,
    R_BLOCKS: tl.constexpr,
    R_SLICE: tl.constexpr,
    RANK_MAJOR: tl.constexpr,
    STATIC_LOOPS: tl.constexpr,
) -> tl.tensor:
    """B[cols, :rank] @ h[:rank] for one token, given rank block 0 of B^T and h; later blocks only up to the
    rank (a branch, not a mask: blocks past it cost no instructions)."""
    delta = _col_dots(bt0, h0)
    if R_BLOCKS > 1:
        for rb in range(1, R_BLOCKS if STATIC_LOOPS else tl.cdiv(rank, RANK_BLOCK)):
            bt = _b_block(b_cols, n_ok, stride_br, rank, rb, R_SLICE, RANK_MAJOR)
            delta += _col_dots(bt, _h_block(h_row, rank, rb, bt.dtype))
    return delta


@triton.jit
def _tile_add(
    y_rows: tl.tensor,
    cols: tl.tensor,
    n_ok: tl.tensor,
    tok_ok: tl.tensor,
    scale: tl.tensor,
    bt0: tl.tensor,
    h0: tl.tensor,
    b_cols: tl.tensor,
    stride_br: tl.tensor,
    h_rows: tl.tensor,
    rank: tl.tensor,
    R_BLOCKS: tl.constexpr,
    R_SLICE: tl.constexpr,
    RANK_MAJOR: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    STATIC_LOOPS: tl.constexpr,
) -> None:
    """y[toks, cols] += scale * h[toks, :rank] @ B^T[:rank, cols] for one column tile, on tensor cores, rank
    block by rank block as in `_token_delta` (given block 0 of B^T and h), read-modify-write in y's dtype."""
    if UPCAST:
        bt0 = bt0.to(tl.float32)
    delta = tl.dot(h0, bt0, input_precision=PRECISION)
    if R_BLOCKS > 1:
        for rb in range(1, R_BLOCKS if STATIC_LOOPS else tl.cdiv(rank, RANK_BLOCK)):
            bt = _b_block(b_cols, n_ok, stride_br, rank, rb, R_SLICE, RANK_MAJOR)
            h = _h_block(h_rows, rank, rb, bt.dtype).to(bt.dtype)
            if UPCAST:
                h, bt = h.to(tl.float32), bt.to(tl.float32)
            delta = tl.dot(h, bt, delta, input_precision=PRECISION)
    mask = tok_ok[:, None] & n_ok[None, :]
    old = tl.load(y_rows + cols[None, :], mask=mask, other=0.0)
    tl.store(y_rows + cols[None, :], (old.to(tl.float32) + scale * delta).to(old.dtype), mask=mask)


@triton.jit
def _half_block_token(
    y_row: tl.tensor,
    h_row: tl.tensor,
    b_base: tl.tensor,
    stride_br: tl.tensor,
    rank: tl.tensor,
    scale: tl.tensor,
    n_begin: tl.tensor,
    n_stop: tl.tensor,
    n_start: tl.tensor,
    B_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_ITERS: tl.constexpr,
    STATIC_LOOPS: tl.constexpr,
    USE_PDL: tl.constexpr,
    GDC: tl.constexpr,
) -> None:
    """One token's expand for a chunk of rank <= 8 whose program has more than one column tile (HALF_BLOCKS,
    rank-major B with contiguous columns): tiles of 8 rank rows by 2 * BLOCK_N columns, the registers of a
    16-row tile, so that each load in flight carries as many bytes as a rank-16 chunk's. In 16-row tiles half
    the rows of such a chunk are masked off, and its program makes a round trip to memory per tile for half the
    bytes. Sums the same terms as `_token_delta` (the 16-row tile's other rows are zero there).

    Only where a program has several tiles: with one, a wide tile would be half masked along N, and measured
    slower (Llama-7B q/k/v, 64 rank-8 adapters in a rank-64 stack: 32.6 against 29.9 us of expand a layer on
    an H100, bench/RESULTS-gpu.md stop 31)."""
    HALF: tl.constexpr = RANK_BLOCK // 2
    WIDE: tl.constexpr = 2 * BLOCK_N
    offs_r = tl.arange(0, HALF)
    r_ok = offs_r < rank
    rows = b_base + offs_r[:, None].to(tl.int64) * stride_br
    PEELED: tl.constexpr = 1 if USE_PDL else 0
    if PEELED:  # as the 16-row body: the first tile before the wait
        offs0 = n_begin + tl.arange(0, WIDE)
        ok0 = offs0 < n_stop
        cols0 = (n_start + offs0).to(tl.int64)
        bt0 = tl.load(rows + cols0[None, :], mask=r_ok[:, None] & ok0[None, :], other=0.0)
        _await_previous(GDC)
    h = tl.load(h_row + offs_r, mask=r_ok, other=0.0).to(B_DTYPE).to(tl.float32)
    if PEELED:
        old0 = tl.load(y_row + cols0, mask=ok0, other=0.0)
        tl.store(y_row + cols0, (old0.to(tl.float32) + scale * _col_dots(bt0, h)).to(old0.dtype), mask=ok0)
    for i in range(PEELED, (N_ITERS + 1) // 2 if STATIC_LOOPS else tl.cdiv(n_stop - n_begin, WIDE)):
        offs = n_begin + i * WIDE + tl.arange(0, WIDE)
        ok = offs < n_stop
        cols = (n_start + offs).to(tl.int64)
        bt = tl.load(rows + cols[None, :], mask=r_ok[:, None] & ok[None, :], other=0.0)
        old = tl.load(y_row + cols, mask=ok, other=0.0)
        tl.store(y_row + cols, (old.to(tl.float32) + scale * _col_dots(bt, h)).to(old.dtype), mask=ok)


@triton.jit
def _expand_kernel(
    y_ptr: tl.tensor,
    h_ptr: tl.tensor,
    b_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    scalings_ptr: tl.tensor,
    order_ptr: tl.tensor,
    chunks_ptr: tl.tensor,
    num_real_ptr: tl.tensor,
    n_chunks: tl.tensor,
    n0: tl.tensor,
    n1: tl.tensor,
    n2: tl.tensor,
    n3: tl.tensor,
    stride_yt: tl.tensor,
    stride_ht: tl.tensor,
    stride_bs: tl.tensor,
    stride_bn: tl.tensor,
    stride_br: tl.tensor,
    SLICES: tl.constexpr,
    R_BLOCKS: tl.constexpr,
    UNIT_R: tl.constexpr,
    R_UNITS: tl.constexpr,
    CHUNKS: tl.constexpr,
    N_TILES: tl.constexpr,
    N_ITERS: tl.constexpr,
    R_SLICE: tl.constexpr,
    RANK_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    STATIC_LOOPS: tl.constexpr,
    USE_PDL: tl.constexpr,
    GDC: tl.constexpr,
    SHORT_CHAIN: tl.constexpr,
    HALF_BLOCKS: tl.constexpr,
) -> None:
    # Work unit = (chunk, slice, UNIT_R rank rows); the programs of a (chunk, slice)'s units split its column
    # tiles, so a chunk of rank 64 gets 4x the programs of one of rank 16 and each loops over 4 rank blocks.
    num_real = tl.load(num_real_ptr)
    past, chunk, rank, j, nb, per, sub = _locate(
        chunks_ptr, ranks_ptr, num_real, n_chunks, SLICES, R_UNITS, UNIT_R, N_TILES, CHUNKS
    )
    sl = j // nb
    tiles_per_part = tl.cdiv(N_TILES, nb * per)
    n_size = tl.where(sl == 0, n0, tl.where(sl == 1, n1, tl.where(sl == 2, n2, n3)))
    n_begin = ((j % nb) * per + sub) * tiles_per_part * BLOCK_N
    if past | (n_begin >= n_size):
        _exit_in_order(GDC)
        return
    n_start = tl.where(sl > 0, n0, 0) + tl.where(sl > 1, n1, 0) + tl.where(sl > 2, n2, 0)
    n_stop = tl.minimum(n_begin + tiles_per_part * BLOCK_N, n_size)
    slot, start, length, first_tok = _chunk_row(chunks_ptr, chunk)
    offs_n0 = n_begin + tl.arange(0, BLOCK_N)
    n0_ok = offs_n0 < n_stop
    cols0 = (n_start + offs_n0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    tok_ok = offs_m < length
    if SHORT_CHAIN:  # loads that need only the chunk row: in flight beside the rank
        scale = tl.load(scalings_ptr + slot)
        if BLOCK_M != 1:
            tok_m = tl.load(order_ptr + start + offs_m, mask=tok_ok, other=0).to(tl.int64)
    if CHUNKS == 0:
        rank = tl.load(ranks_ptr + slot)
        if rank == 0:
            _exit_in_order(GDC)
            return
    if not SHORT_CHAIN:
        scale = tl.load(scalings_ptr + slot)
    b_base = b_ptr + slot * stride_bs
    b_cols0 = b_base + cols0[None, :] * stride_bn
    # With PDL the first column tile runs ahead of the loop: its first rank block of B is read before the
    # previous kernel has finished. (Reading its y before the rank arrives, for the short chain, cost 165
    # registers against 96.)
    PEELED: tl.constexpr = 1 if USE_PDL else 0
    if BLOCK_M == 1 and HALF_BLOCKS and rank <= RANK_BLOCK // 2 and n_stop - n_begin > BLOCK_N:
        tok = first_tok if SHORT_CHAIN else tl.load(order_ptr + start).to(tl.int64)
        _half_block_token(
            y_ptr + tok * stride_yt, h_ptr + tok * stride_ht + sl * R_SLICE, b_base, stride_br, rank, scale,
            n_begin, n_stop, n_start, b_ptr.dtype.element_ty, BLOCK_N, N_ITERS, STATIC_LOOPS, USE_PDL, GDC,
        )  # fmt: skip
    elif BLOCK_M == 1:
        # One token: a plain matrix-vector product, no tensor-core tile padded to 16 tokens. Compile-time
        # trip counts only in the interpreter (see _shrink_kernel); compiled code loops exactly.
        tok = first_tok if SHORT_CHAIN else tl.load(order_ptr + start).to(tl.int64)
        y_1 = y_ptr + tok * stride_yt
        if PEELED:
            bt0 = _b_block(b_cols0, n0_ok, stride_br, rank, 0, R_SLICE, RANK_MAJOR)
            _await_previous(GDC)
        h_row = h_ptr + tok * stride_ht + sl * R_SLICE
        h0_1 = _h_block(h_row, rank, 0, b_ptr.dtype.element_ty)
        if PEELED:
            old0_1 = tl.load(y_1 + cols0, mask=n0_ok, other=0.0)
            delta0_1 = _token_delta(
                bt0, h0_1, b_cols0, n0_ok, stride_br, h_row, rank, R_BLOCKS, R_SLICE, RANK_MAJOR, STATIC_LOOPS
            )
            tl.store(y_1 + cols0, (old0_1.to(tl.float32) + scale * delta0_1).to(old0_1.dtype), mask=n0_ok)
        for i in range(PEELED, N_ITERS if STATIC_LOOPS else tl.cdiv(n_stop - n_begin, BLOCK_N)):
            offs_n = n_begin + i * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < n_stop
            cols = (n_start + offs_n).to(tl.int64)
            b_cols = b_base + cols[None, :] * stride_bn
            bt = _b_block(b_cols, n_ok, stride_br, rank, 0, R_SLICE, RANK_MAJOR)
            old_1 = tl.load(y_1 + cols, mask=n_ok, other=0.0)
            delta_1 = _token_delta(
                bt, h0_1, b_cols, n_ok, stride_br, h_row, rank, R_BLOCKS, R_SLICE, RANK_MAJOR, STATIC_LOOPS
            )
            tl.store(y_1 + cols, (old_1.to(tl.float32) + scale * delta_1).to(old_1.dtype), mask=n_ok)
    else:
        if not SHORT_CHAIN:
            tok_m = tl.load(order_ptr + start + offs_m, mask=tok_ok, other=0).to(tl.int64)
        if PEELED:
            bt0 = _b_block(b_cols0, n0_ok, stride_br, rank, 0, R_SLICE, RANK_MAJOR)
            _await_previous(GDC)
        h_rows = h_ptr + tok_m[:, None] * stride_ht + sl * R_SLICE
        h0 = _h_block(h_rows, rank, 0, b_ptr.dtype.element_ty).to(b_ptr.dtype.element_ty)
        if UPCAST:
            h0 = h0.to(tl.float32)
        y_rows = y_ptr + tok_m[:, None] * stride_yt
        if PEELED:
            _tile_add(
                y_rows, cols0, n0_ok, tok_ok, scale, bt0, h0, b_cols0, stride_br, h_rows, rank,
                R_BLOCKS, R_SLICE, RANK_MAJOR, PRECISION, UPCAST, STATIC_LOOPS,
            )  # fmt: skip
        for i in range(PEELED, N_ITERS if STATIC_LOOPS else tl.cdiv(n_stop - n_begin, BLOCK_N)):
            offs_n = n_begin + i * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < n_stop
            cols = (n_start + offs_n).to(tl.int64)
            b_cols = b_base + cols[None, :] * stride_bn
            bt = _b_block(b_cols, n_ok, stride_br, rank, 0, R_SLICE, RANK_MAJOR)
            _tile_add(
                y_rows, cols, n_ok, tok_ok, scale, bt, h0, b_cols, stride_br, h_rows, rank,
                R_BLOCKS, R_SLICE, RANK_MAJOR, PRECISION, UPCAST, STATIC_LOOPS,
            )  # fmt: skip


def expand(
    y: torch.Tensor,
    h: torch.Tensor,
    b_stack: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    plan: SegmentPlan,
    *,
    slice_sizes: Sequence[int] | None = None,
    config: ExpandConfig | None = None,
    pdl: bool | None = None,
    short_chain: bool | None = None,
) -> None:
    """y[:, slice l] += scaling * B_l @ h_l for the plan's tokens, in place (module docstring).

    `b_stack` is `[S, N, R]` with its N or its R axis contiguous: rank-major storage `[S, R, N]` (the
    engine's) is passed as `store.transpose(-1, -2)`. `pdl` and `short_chain` as in `shrink`.
    """
    cfg = config or default_configs(plan.block_m)[1]
    latency = _latency(y.device, pdl, short_chain)
    sizes = list(slice_sizes) if slice_sizes is not None else [b_stack.shape[1]]
    r_slice = b_stack.shape[2]
    if not 1 <= len(sizes) <= MAX_SLICES or sum(sizes) != b_stack.shape[1] or y.shape[1] != b_stack.shape[1]:
        raise ValueError("slice_sizes must add up to b_stack's and y's output width")
    if y.stride(-1) != 1 or h.stride(-1) != 1:
        raise ValueError("y and h need a contiguous last dimension")
    rank_major = b_rank_major(b_stack)
    if h.shape[1] != len(sizes) * r_slice:
        raise ValueError("h has L*R columns for L slices of rank R")
    # B tiles in registers are one rank block wide whatever the stack's R (sm_90, bf16: 512 x 64 tiles spilled).
    r_blocks = triton.cdiv(r_slice, RANK_BLOCK.value)
    block_n = cfg.block_n
    if plan.block_m == 1:  # as in shrink: the per-token body's B tile lives in registers
        block_n = max(16, min(block_n, 2 * _TILE_PER_THREAD * 32 * cfg.num_warps // RANK_BLOCK.value))
    elif latency.pdl_order or r_blocks > 1:
        # The tile body holds the first B tile across the wait (PDL; sm_90: fp32 512 x 16 spilled) or carries
        # its accumulator through the loop over rank blocks (sm_90: bf16 512 columns took 211 registers, 256
        # took 128; fp32 512 and 256 spilled), beside h and a y tile.
        per_thread = _TILE_PER_THREAD * 2 // b_stack.element_size() // (2 if r_blocks > 1 else 1)
        block_n = max(16, min(block_n, per_thread * 32 * cfg.num_warps // RANK_BLOCK.value))
    n_tiles = triton.cdiv(max(sizes), block_n)
    most_units = plan.num_chunks * len(sizes) * triton.cdiv(r_slice, cfg.unit_rows)
    programs = _programs(y.device, cfg.programs_per_sm, most_units)
    fewest_parts = min(max(programs // most_units, 1), n_tiles)
    _expand_kernel[(programs,)](
        y,
        h,
        b_stack,
        ranks,
        scalings,
        plan.token_order,
        plan.chunks,
        plan.num_real,
        plan.num_chunks,
        *(sizes + [0] * (MAX_SLICES - len(sizes))),
        y.stride(0),
        h.stride(0),
        b_stack.stride(0),
        b_stack.stride(1),
        b_stack.stride(2),
        SLICES=len(sizes),
        R_BLOCKS=r_blocks,
        UNIT_R=cfg.unit_rows,
        R_UNITS=triton.cdiv(r_slice, cfg.unit_rows),
        CHUNKS=_scanned_chunks(plan),
        N_TILES=n_tiles,
        N_ITERS=triton.cdiv(n_tiles, fewest_parts) if _static_loops() else 0,
        R_SLICE=r_slice,
        RANK_MAJOR=rank_major,
        BLOCK_M=plan.block_m,
        BLOCK_N=block_n,
        PRECISION=_dot_precision(y.dtype),
        UPCAST=_upcast_dots(),
        STATIC_LOOPS=_static_loops(),
        USE_PDL=latency.pdl_order,
        GDC=latency.gdc,
        SHORT_CHAIN=latency.short_chain,
        HALF_BLOCKS=cfg.half_blocks and rank_major and plan.block_m == 1,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **latency.launch(),
    )
