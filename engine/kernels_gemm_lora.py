"""Decode projections with their LoRA inside the base GEMM (CUDA decode steps; `EngineConfig.lora_gemm`, on).

Why: at decode sizes the separate shrink and expand kernels cost about 40 us per Llama-7B layer for one adapter
on an H200, the latency of their chains of dependent loads rather than their bytes (bench/RESULTS-gpu.md). A
triton GEMM streams a projection's weight as fast as cuBLAS does at 64 rows (`.gpu` probe, same file), and its
programs can do the LoRA work beside the weight tiles they already load.

Semantics (pseudo-code). Rows t, columns n of the fused output (the slices' columns side by side: q/k/v,
gate/up), fp32 inside; `s = token_slots[t]`, `r = ranks[s]`, slice l the one holding column n, A stacked as
the shrink kernel takes it (`a_stack[S, L*R, K]`) and `bt[s, j, n]` the rank-major B (`b_stack[s, n, j]`):

    h[t, l*R + j] = a_stack[s, l*R + j] @ x[t]                                   for j < r
    y[t, n] = round(x[t] @ w[n] + bias[n] + (s >= 0) * scalings[s] * h[t, l*R : l*R + r] @ bt[s, :r, n])

for batches whose rows with an adapter all have the same slot (one adapter for the batch, base rows beside
it). Each program computes h for its rows itself, in the same pass over K that streams its weight tile (A is
a few rows beside the tile), and adds h @ B for its columns before it stores: no other launch.

Layout: one program per (tile of BLOCK_M rows, tile of BLOCK_N columns, split of K), BLOCK_N dividing every
slice so a tile lies in one slice (`tiling`), BLOCK_M up to 128 rows (`row_tile`). With PDL (Hopper) the
slots, ranks, scalings, B tile and bias are read before waiting for the kernel before this one. Where K is
split, each program adds its split's share of both `x @ W^T` and `h @ B` (h computed over that split's K
only: the delta is linear in it), and the last of a tile's programs to arrive sums the fp32 partials in split
order and stores (`_arrivals`). The torch definition: `reference_gemm_lora`.

Batches of 2 to 8 adapters take `kernels_gemm_lora_few` (the shrink in spare programs of the same launch),
others the separate kernels. Both versions that took h from the shrink kernel and
added B in the GEMM's epilogue were slower (bench/RESULTS-gpu.md): each row's own B gathered in 16 loads one
after another, x0.50-0.73 of the separate kernels; one tensor-core tile per adapter of up to 8, x0.92-0.94 at
8 adapters x 8 rows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine import kernels_triton
from engine.kernels import lora_expand_reference, lora_shrink_reference
from engine.kernels_triton import MAX_SLICES, RANK_BLOCK

_BLOCK_K = 128
_MIN_TILES = 96
_MAX_RANK = 64
_SHARED_MEMORY_RESERVED = 7 * 1024
_MIN_SPLIT_K = 512
_MAX_STAGES = 5  # at BLOCK_K 128; one more at narrower K tiles (`_pipeline`)
_NUM_WARPS = 4
_MAX_SPLIT_TILES = 4096
# The largest row tile (`row_tile`). A module setting so that benches can capture an engine's graphs with
# tiles of 64, as before, beside one with 128 (bench/engine_gpu_e2e.py --lora-gemm-row-tile).
MAX_BLOCK_M = 128


def reference_gemm_lora(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    slice_sizes: Sequence[int],
) -> torch.Tensor:
    """`gemm_lora` in torch (fp32 inside, the output rounded once)."""
    base = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    r_slice, n0 = b_stack.shape[2], 0
    for sl, width in enumerate(slice_sizes):
        rows = slice(sl * r_slice, (sl + 1) * r_slice)
        h = lora_shrink_reference(x.float(), a_stack[:, rows].float(), ranks, token_slots)
        part = base[:, n0 : n0 + width]  # a view: the reference adds into `base`
        lora_expand_reference(part, h, b_stack[:, n0 : n0 + width].float(), ranks, scalings, token_slots)
        n0 += width
    return base.to(x.dtype)


@triton.jit
def _gemm_lora_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    y_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    a_ptr: tl.tensor,
    b_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    scalings_ptr: tl.tensor,
    partial_ptr: tl.tensor,
    arrivals_ptr: tl.tensor,
    num_tokens: int,
    start1: int,
    start2: int,
    start3: int,
    stride_xm: int,
    stride_wn: int,
    stride_ym: int,
    stride_as: int,
    stride_ar: int,
    stride_bs: int,
    stride_br: int,
    K: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_M: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    GDC: tl.constexpr,
) -> None:
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # BLOCK_N divides N (`tiling`): no column masks
    in_rows = rows < num_tokens
    n0 = pid_n * BLOCK_N
    sl = (n0 >= start1).to(tl.int32) + (n0 >= start2).to(tl.int32) + (n0 >= start3).to(tl.int32)
    rr = tl.arange(0, BLOCK_R)
    # Prologue: everything no kernel of the step writes (slots, ranks, scalings, B, bias come from host copies
    # and adapter fills). With PDL it runs while the kernel before this one finishes; x only after the wait.
    slots = tl.load(slots_ptr + rows, mask=in_rows, other=-1)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_N,), dtype=tl.float32)  # unused
    # One slot for every row that has one: the tile's largest (base rows and padding are -1).
    slot = tl.max(slots, axis=0)
    safe_slot = tl.maximum(slot, 0)
    rank = tl.where(slot >= 0, tl.load(ranks_ptr + safe_slot), 0)
    scale = tl.load(scalings_ptr + safe_slot)
    a_rows = (rr < rank) & (rr < R)
    a_base = a_ptr + safe_slot.to(tl.int64) * stride_as + (sl * R + rr).to(tl.int64) * stride_ar
    # B's columns are contiguous (`checked_layout`): written as such. Through a stride argument equal to 1 the
    # tile was read 2 bytes at a time (16-64 loads a thread): triton specialises an argument equal to 1 only
    # when it is not annotated `int`, as this kernel's are (so that 1 row or 1 split compiles no variant).
    bt = tl.load(
        b_ptr + safe_slot.to(tl.int64) * stride_bs + rr[:, None] * stride_br + cols[None, :],
        mask=a_rows[:, None],
        other=0.0,
    )
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if GDC:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kk = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None] * stride_xm + kk[None, :]
    w_tile = w_ptr + cols[None, :] * stride_wn + kk[:, None]
    a_tile = a_base[None, :] + kk[:, None]
    for k0 in range(0, K_SPLIT, BLOCK_K):
        if EVEN_K:  # every K tile whole (the launch checks): no K mask on the loads of the main loop
            if EVEN_M:  # and every row tile whole: x unmasked too (3 us a Llama-7B layer, bench/RESULTS-gpu.md)
                xt = tl.load(x_tile + k0)
            else:
                xt = tl.load(x_tile + k0, mask=in_rows[:, None], other=0.0)
            wt = tl.load(w_tile + k0)
            at = tl.load(a_tile + k0, mask=a_rows[None, :], other=0.0)
        else:
            in_k = k0 + kk < K
            xt = tl.load(x_tile + k0, mask=in_rows[:, None] & in_k[None, :], other=0.0)
            wt = tl.load(w_tile + k0, mask=in_k[:, None], other=0.0)
            at = tl.load(a_tile + k0, mask=a_rows[None, :] & in_k[:, None], other=0.0)
        if UPCAST:
            acc = tl.dot(xt.to(tl.float32), wt.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        if UPCAST:
            h = tl.dot(xt.to(tl.float32), at.to(tl.float32), h, input_precision=PRECISION)
        else:
            h = tl.dot(xt, at, h, input_precision=PRECISION)
    if GDC:  # the next kernel's programs may take this SM's room from here on, not while the weight streams
        tl.extra.cuda.gdc_launch_dependents()
    hs = tl.where((slots == slot)[:, None] & (slot >= 0), h * scale, 0.0)
    if UPCAST:
        acc = tl.dot(hs, bt.to(tl.float32), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(hs.to(bt.dtype), bt, acc, input_precision=PRECISION)
    out_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tile = pid_m * tl.num_programs(1) + pid_n
    _store_tile(acc, bias, out_ptrs, in_rows[:, None], partial_ptr, arrivals_ptr, tile, pid_k, SPLIT_K, HAS_BIAS)


@triton.jit
def _store_tile(
    acc: tl.tensor,
    bias: tl.tensor,
    out_ptrs: tl.tensor,
    out_mask: tl.tensor,
    partial_ptr: tl.tensor,
    arrivals_ptr: tl.tensor,
    tile: tl.tensor,
    pid_k: tl.tensor,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
) -> None:
    """Store a program's fp32 output tile `acc` (plus `bias`) at `out_ptrs`, rounded to their dtype. Where K is
    split, each split stores its partial tile (x @ W^T and h @ B are both linear in the K range); the last to
    arrive at output tile `tile` sums them in split order (the same bits whichever arrives last), stores, and
    resets the tile's arrival count for the next call. The barrier orders every thread's partial before the
    release. Shared with `kernels_gemm_lora_few`."""
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += bias[None, :]
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=out_mask)
    else:
        tile_elems: tl.constexpr = acc.shape[0] * acc.shape[1]
        within = tl.arange(0, acc.shape[0])[:, None] * acc.shape[1] + tl.arange(0, acc.shape[1])[None, :]
        partials = partial_ptr + tile.to(tl.int64) * (SPLIT_K * tile_elems) + within
        tl.store(partials + pid_k * tile_elems, acc)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.load(partials, cache_modifier=".cg")
            for part in tl.static_range(1, SPLIT_K):
                total += tl.load(partials + part * tile_elems, cache_modifier=".cg")
            if HAS_BIAS:
                total += bias[None, :]
            tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(arrivals_ptr + tile, 0, sem="relaxed", scope="gpu")


def fits(slice_sizes: Sequence[int], rank: int) -> bool:
    """Whether `gemm_lora` takes a group of these slices from a stack of this rank per slice: a common column
    tile (`block_n_for`), and rank 64 or less (the B tile and h stay in registers beside the accumulator;
    larger ranks were never compiled here and keep the separate kernels)."""
    return rank <= _MAX_RANK and block_n_for(slice_sizes, sum(slice_sizes)) is not None


def block_n_for(slice_sizes: Sequence[int], total: int) -> int | None:
    """The column tile for these slices without a split of K: the widest of 128 / 64 / 32 / 16 that divides every
    slice (a tile never straddles two) and still gives 96 or more tiles, so a decode GEMM's programs cover most of
    the GPU's SMs (fewer stream too little of the weight at once); None if none divides. Measured at 64 rows on
    an H200 (bench/RESULTS-gpu.md): 128 columns for 12k-22k outputs, 32 for 4k (where `tiling` splits K
    instead, when K is long enough)."""
    dividing = _dividing(slice_sizes)
    if not dividing:
        return None
    return next((block for block in dividing if total // block >= _MIN_TILES), dividing[-1])


def _dividing(slice_sizes: Sequence[int]) -> list[int]:
    """The column tiles, widest first, that divide every slice."""
    return [block for block in (128, 64, 32, 16) if all(size % block == 0 for size in slice_sizes)]


def tiling(slice_sizes: Sequence[int], total: int, k_dim: int) -> tuple[int, int] | None:
    """(column tile, splits of K) for these slices; None if no column tile divides them.

    The widest dividing tile that gives 96 or more programs, unsplit or with K split in two (each half at least
    `_MIN_SPLIT_K` long); else `block_n_for`'s narrow tile, unsplit. Where the wide tiles are too few (Llama-7B's
    o and down: 4096 outputs), halving K beats narrowing the tiles: each program reads x and A for half of K
    beside twice the columns. Swept at 64 rows on an H200 (bench/RESULTS-gpu.md): o 14.5 us with (64, 2) against
    16.1 with (32, 1) and 15.9 with (128, 4); down 28.8 against 38.0 and 30.4 (cuBLAS, no LoRA: 12.2 and 29.6)."""
    for block in _dividing(slice_sizes):
        tiles = total // block
        if tiles >= _MIN_TILES:
            return block, 1
        if 2 * tiles >= _MIN_TILES and k_dim >= 2 * _MIN_SPLIT_K:
            return block, 2
    narrow = block_n_for(slice_sizes, total)
    return None if narrow is None else (narrow, 1)


def checked_layout(
    x: torch.Tensor,
    w: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    sizes: list[int],
    split_k: int | None,
) -> tuple[int, int, int]:
    """(rank per slice, column tile, splits of K) of a LoRA GEMM over these operands (`tiling`; `split_k`
    overrides the splits). Raises ValueError where they disagree or do not fit (`fits`), or B's columns are not
    contiguous (the kernels read them so). Shared with `kernels_gemm_lora_few`."""
    k_dim, n_dim = x.shape[1], w.shape[0]
    lr = a_stack.shape[1]
    r_slice = lr // len(sizes)
    if w.shape[1] != k_dim or sum(sizes) != n_dim or b_stack.shape[1] != n_dim or not 1 <= len(sizes) <= MAX_SLICES:
        raise ValueError("w, slice_sizes and b_stack must agree on the output width, w and x on the input width")
    if lr % len(sizes) or b_stack.shape[2] != r_slice:
        raise ValueError("a_stack holds L*R rows and b_stack R columns for L slices of rank R")
    if x.stride(-1) != 1 or w.stride(-1) != 1 or a_stack.stride(-1) != 1:
        raise ValueError("x, w and a_stack need a contiguous last dimension")
    if b_stack.stride(1) != 1:  # the kernels read B's columns as contiguous
        raise ValueError("b_stack must be the [S, N, R] view of rank-major storage (its columns contiguous)")
    layout = tiling(sizes, n_dim, k_dim)
    if layout is None or r_slice > _MAX_RANK:
        raise ValueError(f"slices {sizes} at rank {r_slice}: no common column tile of 16 or more, or rank > 64")
    block_n, split = layout
    if split_k is not None:
        block_n, split = (_dividing(sizes)[0] if split_k > 1 else block_n_for(sizes, n_dim) or block_n), split_k
    return r_slice, block_n, split


def slice_starts(sizes: list[int]) -> list[int]:
    """The first column of each slice after the first, padded with the output width to `MAX_SLICES` - 1."""
    return [sum(sizes[:i]) for i in range(1, len(sizes))] + [sum(sizes)] * (MAX_SLICES - len(sizes))


def row_tile(num_tokens: int) -> tuple[int, int]:
    """(BLOCK_M, warps) for `num_tokens` rows: every row in one tile up to 128, so that each column tile's weight
    is streamed by one program. A decode batch of 64 plus a joining request's rows (65-128: a LoRA row beside
    64 base rows, or a prompt folded into the decode graph) in two tiles of 64 doubled the programs, and the
    GEMM ran in two waves. Tiles of 128 rows take 8 warps: the fp32 accumulator of 128 x 128 would need 128
    registers a thread at 4."""
    block_m = max(16, min(MAX_BLOCK_M, triton.next_power_of_2(num_tokens)))
    return block_m, _NUM_WARPS if block_m <= 64 else 2 * _NUM_WARPS


def _arrivals(device: torch.device) -> torch.Tensor:
    """The split-K arrival counts for launches on the current stream, all zero between launches (each tile's
    last arrival resets its own). Kept per stream: launches on one stream, or replays of graphs captured on one
    capture stream, never overlap, while those of other streams may."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    if key not in _ARRIVALS:
        _ARRIVALS[key] = torch.zeros(_MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _ARRIVALS[key]


_ARRIVALS: dict[tuple[str, int], torch.Tensor] = {}


@functools.cache
def _shared_memory(device: torch.device) -> int:
    """Shared memory a program may take on `device`, less what triton keeps for itself (H200: 227 KiB a block,
    of which 220 fill the pipeline: 4 stages of 64 x 128 and 128 x 128 bf16 tiles with a rank-64 A tile, 256
    KiB, did not compile). Pre-Hopper GPUs have less (A10: 99 KiB), hence read, not assumed."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)) - _SHARED_MEMORY_RESERVED


def _pipeline(x: torch.Tensor, tiles: int, tile_rows: int) -> tuple[int, int]:
    """BLOCK_K and pipeline stages: as deep a pipeline of x, weight and A tiles (`tile_rows` rows in all) as
    shared memory holds for every program resident at once (`_shared_memory`). BLOCK_K 128 where 4 stages of it
    fit, else 64 (or 32) with up to 6: a deeper pipeline of narrower K tiles beats 3 stages of wide ones. Where
    the tiles outnumber the SMs, two share an SM: BLOCK_K 64 then keeps 4 stages (Llama-7B gate/up at 64 rows,
    172 tiles: 54.9 against 60.6 us with BLOCK_K 128 and one program an SM at a time). The 128-row tile (72-96
    rows, one H100, `bench/gemm_lora_rows.py --sweep`): q/k/v 41.8 us at BLOCK_K 64 and 6 stages against 45.9 at
    128 and 3, down 41.7 against 43.1 (bench/RESULTS-gpu.md)."""
    if triton.knobs.runtime.interpret:
        return _BLOCK_K, 1
    budget = _shared_memory(x.device) // triton.cdiv(tiles, kernels_triton._sm_count(x.device))
    row_bytes = tile_rows * x.element_size()
    if 4 * row_bytes * _BLOCK_K <= budget:
        return _BLOCK_K, min(_MAX_STAGES, budget // (row_bytes * _BLOCK_K))
    block_k = next((k for k in (_BLOCK_K // 2, _BLOCK_K // 4) if 3 * row_bytes * k <= budget), _BLOCK_K // 4)
    return block_k, max(2, min(_MAX_STAGES + 1, budget // (row_bytes * block_k)))


def gemm_lora(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    slice_sizes: Sequence[int],
    split_k: int | None = None,
    block_m: int | None = None,
    num_stages: int | None = None,
    num_warps: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """`x @ w.T + bias` plus every row's LoRA delta (module docstring), as a new tensor.

    At most one slot may appear among `token_slots` (besides -1): the caller guarantees it (a tile's rows would
    otherwise all take its largest slot's adapter). `b_stack` is the `[S, N, R]` view of rank-major storage, as
    `kernels_expand.expand` takes it (any other layout: ValueError). Raises ValueError where the shapes do not
    fit (`fits` False: use the separate kernels). `split_k` overrides the splits of K that `tiling` picks,
    `block_m` the row tile that `row_tile` picks, `num_stages` and `block_k` the pipeline depth and K tile
    `_pipeline` picks and `num_warps` the warps (tests, benches: `bench/gemm_lora_rows.py --sweep`).
    """
    num_tokens, k_dim = x.shape
    n_dim = w.shape[0]
    sizes = list(slice_sizes)
    r_slice, block_n, split = checked_layout(x, w, a_stack, b_stack, sizes, split_k)
    out = torch.empty(num_tokens, n_dim, dtype=x.dtype, device=x.device)
    starts = slice_starts(sizes)
    if block_m is None:
        block_m, warps = row_tile(num_tokens)
    elif block_m not in (16, 32, 64, 128):
        raise ValueError(f"block_m {block_m}: 16, 32, 64 or 128")
    else:
        warps = row_tile(block_m)[1]
    interpret = bool(triton.knobs.runtime.interpret)
    block_r = max(RANK_BLOCK.value, triton.next_power_of_2(r_slice))
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(n_dim, block_n), split)
    if grid[0] * grid[1] > _MAX_SPLIT_TILES:
        grid, split = (grid[0], grid[1], 1), 1
    if block_k not in (None, 32, 64, 128):
        raise ValueError(f"block_k {block_k}: 32, 64 or 128")
    chosen_k, stages = _pipeline(x, grid[0] * grid[1] * split, block_m + block_n + block_r)
    block_k, stages = block_k or chosen_k, num_stages or stages
    k_split = triton.cdiv(triton.cdiv(k_dim, split), block_k) * block_k
    partials = arrivals = out
    if split > 1:
        partials = torch.empty(grid[0] * grid[1] * split * block_m * block_n, dtype=torch.float32, device=x.device)
        arrivals = _arrivals(x.device)
    pdl = kernels_triton.pdl_default(x.device)
    _gemm_lora_kernel[grid](
        x,
        w,
        bias if bias is not None else w,
        out,
        token_slots,
        a_stack,
        b_stack,
        ranks,
        scalings,
        partials,
        arrivals,
        num_tokens,
        *starts[:3],
        x.stride(0),
        w.stride(0),
        out.stride(0),
        a_stack.stride(0),
        a_stack.stride(1),
        b_stack.stride(0),
        b_stack.stride(2),
        K=k_dim,
        R=r_slice,
        BLOCK_R=block_r,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        K_SPLIT=k_split,
        EVEN_K=k_split * split == k_dim,
        EVEN_M=num_tokens % block_m == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=interpret,
        GDC=pdl,
        num_warps=num_warps or warps,
        num_stages=stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
