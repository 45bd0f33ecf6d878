"""Decode projections with the LoRA of a few adapters (2 to `capacity`) inside the base GEMM, in one launch.

Why: `kernels_gemm_lora` puts one adapter's LoRA inside the GEMM, h computed beside each weight tile. With
several adapters that costs every program the A rows of all of them (2.8x the separate kernels at 8 adapters,
bench/RESULTS-gpu.md), and the separate shrink and expand kernels cost a launch pair per projection group
(about 43 us a Llama-7B layer at 8 adapters x 8 rows, their latency rather than their bytes). Here the shrink
runs once, in programs of the same launch on the SMs the GEMM leaves idle (96 of 132 at q/k/v), while the
GEMM programs stream their weight; each GEMM program then adds h @ B for its columns as one more K tile.

Semantics (pseudo-code). Rows t, columns n of the fused output (the slices' columns side by side), fp32
inside; `listed[j]` the step's adapters' slots (-1: none), `s = token_slots[t]`, slice l the one holding n,
A stacked as the shrink kernel takes it (`a_stack[S, L*R, K]`), `bt[s, i, n]` the rank-major B:

    hx[t, l, j, i] = (s == listed[j] >= 0) * scalings[s] * a_stack[s, l*R + i] @ x[t]     for i < ranks[s]
    y[t, n] = round(x[t] @ w[n] + bias[n] + sum_{j, i < ranks[listed[j]]} hx[t, l, j, i] * bt[listed[j], i, n])

Every row's adapter must be listed (the caller's guarantee); a row of an unlisted slot gets no delta.

Programs take their role from a ticket drawn when they start (the first `NUM_H` tickets shrink, the rest are
GEMM tiles), so the shrink programs are always among those already running: a GEMM program that waits for
them never waits on a program that has no SM.
- A shrink program covers one row tile and slice over one part of K (`shrink_splits`), every listed adapter at
  once: their A rows side by side make one 128-column tile, as wide as a weight tile. Each row keeps its own
  adapter's columns. The last of a (row tile, slice)'s parts to arrive sums the parts in order and counts
  the tile done.
- A GEMM program streams x @ W^T, loads the listed adapters' B for its columns, waits until every h tile is
  done, and adds hx @ B (`split` 0 only, where K is split: `kernels_gemm_lora` sums the splits).
- The last GEMM program resets the launch's counters for the next launch.

Measured on one H100 (bench/RESULTS-gpu.md, stop 30; 4 Llama-7B layers, batch 64, rank 16): 8 adapters x 8 rows
add 23.5 us a layer against 45.8 with the separate kernels, 4 x 16 20.3 against 39.7. The torch definition:
`reference_gemm_lora_few`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from engine import kernels_triton
from engine.kernels_gemm_lora import (
    _MAX_SPLIT_TILES,
    _arrivals,
    _pipeline,
    _store_tile,
    block_n_for,
    checked_layout,
    reference_gemm_lora,
    row_tile,
    slice_starts,
)
from engine.kernels_triton import RANK_BLOCK

# h @ B's K tile: every listed adapter's rank block side by side. 128 columns keep the extra tile the size of
# one main-loop K tile (8 adapters at rank 16, 2 at rank 64).
EXTRA_COLUMNS = 128
MAX_SHRINK_SPLITS = 8
# Per call site: tickets, h tiles summed, GEMM programs done, unused, then the arrivals of each (row tile, slice)'s
# parts of K.
SYNC_HEAD = 4
SYNC_WORDS = 32


def capacity(max_rank: int) -> int:
    """How many adapters one launch lists for stacks of `max_rank` (0: none; the mode is off for such stacks)."""
    block_r = max(RANK_BLOCK.value, triton.next_power_of_2(max_rank))
    return EXTRA_COLUMNS // block_r


def reference_gemm_lora_few(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    token_slots: torch.Tensor,
    listed: torch.Tensor,
    *,
    slice_sizes: Sequence[int],
) -> torch.Tensor:
    """`gemm_lora_few` in torch (fp32 inside, the output rounded once): `reference_gemm_lora` with the rows of
    unlisted slots as base rows."""
    listed_slots = listed[listed >= 0].to(token_slots.device)
    rows_listed = torch.isin(token_slots, listed_slots)
    slots = torch.where(rows_listed, token_slots, torch.full_like(token_slots, -1))
    return reference_gemm_lora(x, w, bias, a_stack, b_stack, ranks, scalings, slots, slice_sizes=slice_sizes)


@triton.jit
def _gemm_lora_few_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    y_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    listed_ptr: tl.tensor,
    a_ptr: tl.tensor,
    b_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    scalings_ptr: tl.tensor,
    hx_ptr: tl.tensor,
    sync_ptr: tl.tensor,
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
    stride_hm: int,
    stride_hp: int,
    K: tl.constexpr,
    K_H: tl.constexpr,
    H_SPLIT: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    LIST: tl.constexpr,
    SLICES: tl.constexpr,
    GRID_N: tl.constexpr,
    NUM_H: tl.constexpr,
    NUM_SUMS: tl.constexpr,
    SYNC_HEAD: tl.constexpr,
    NUM_GEMM: tl.constexpr,
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
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    cq = tl.arange(0, LIST * BLOCK_R)  # the extra K tile: a rank block per listed adapter
    listed = tl.load(listed_ptr + cq // BLOCK_R)
    safe_listed = tl.maximum(listed, 0)
    listed_rank = tl.where(listed >= 0, tl.load(ranks_ptr + safe_listed), 0)
    in_rank = ((cq % BLOCK_R) < listed_rank) & ((cq % BLOCK_R) < R)
    if ticket < NUM_H:
        # A shrink program: hx of one row tile and slice, every listed adapter at once (their A rows side by side
        # as one tile of 128 columns), over one part of K.
        sl = ticket % SLICES
        part = (ticket // SLICES) % H_SPLIT
        rows = (ticket // (SLICES * H_SPLIT)) * BLOCK_M + tl.arange(0, BLOCK_M)
        in_rows = rows < num_tokens
        slots = tl.load(slots_ptr + rows, mask=in_rows, other=-1)
        scales = tl.load(scalings_ptr + safe_listed)
        a_cols = a_ptr + safe_listed.to(tl.int64) * stride_as + (sl * R + cq % BLOCK_R).to(tl.int64) * stride_ar
        if GDC:
            tl.extra.cuda.gdc_wait()
        h = tl.zeros((BLOCK_M, LIST * BLOCK_R), dtype=tl.float32)
        kk = part * K_H + tl.arange(0, BLOCK_K)
        x_tile = x_ptr + rows[:, None] * stride_xm + kk[None, :]
        a_tile = a_cols[None, :] + kk[:, None]
        for k0 in range(0, K_H, BLOCK_K):
            in_k = k0 + kk < K
            xt = tl.load(x_tile + k0, mask=in_rows[:, None] & in_k[None, :], other=0.0)
            at = tl.load(a_tile + k0, mask=in_rank[None, :] & in_k[:, None], other=0.0)
            if UPCAST:
                h = tl.dot(xt.to(tl.float32), at.to(tl.float32), h, input_precision=PRECISION)
            else:
                h = tl.dot(xt, at, h, input_precision=PRECISION)
        # Each row keeps its own adapter's columns only.
        own = (slots[:, None] == listed[None, :]) & (listed >= 0)[None, :]
        hs = tl.where(own, h * scales[None, :], 0.0)
        hx_tile = hx_ptr + rows[:, None] * stride_hm + (sl * LIST * BLOCK_R + cq)[None, :]
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
        if H_SPLIT == 1:
            tl.store(hx_tile, hs)
            tl.debug_barrier()  # every thread's share of hx stored before the count releases it
            tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
        else:
            # Each part stores its partial h; the last of a (row tile, slice)'s parts to arrive sums them in part
            # order (the same bits whichever arrives last) into part 0's place, resets the arrival count and
            # releases the sum: the GEMM programs read one tile, however many parts.
            tl.store(hx_tile + part * stride_hp, hs)
            tl.debug_barrier()
            arrivals = sync_ptr + SYNC_HEAD + ticket // (SLICES * H_SPLIT) * SLICES + sl
            arrived = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu")
            if arrived == H_SPLIT - 1:
                total = tl.load(hx_tile, cache_modifier=".cg")
                for other in tl.static_range(1, H_SPLIT):
                    total += tl.load(hx_tile + other * stride_hp, cache_modifier=".cg")
                tl.store(hx_tile, total)
                tl.atomic_xchg(arrivals, 0, sem="relaxed", scope="gpu")
                tl.debug_barrier()
                tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
    else:
        tile = ticket - NUM_H
        pid_k = tile % SPLIT_K
        pid_n = (tile // SPLIT_K) % GRID_N
        pid_m = tile // (SPLIT_K * GRID_N)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # BLOCK_N divides N (`tiling`): no column masks
        in_rows = rows < num_tokens
        n0 = pid_n * BLOCK_N
        sl = (n0 >= start1).to(tl.int32) + (n0 >= start2).to(tl.int32) + (n0 >= start3).to(tl.int32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols).to(tl.float32)
        else:
            bias = tl.zeros((BLOCK_N,), dtype=tl.float32)  # unused
        if GDC:
            tl.extra.cuda.gdc_wait()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        kk = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
        x_tile = x_ptr + rows[:, None] * stride_xm + kk[None, :]
        w_tile = w_ptr + cols[None, :] * stride_wn + kk[:, None]
        for k0 in range(0, K_SPLIT, BLOCK_K):
            if EVEN_K:  # every K tile whole (the launch checks): no K mask in the main loop
                if EVEN_M:
                    xt = tl.load(x_tile + k0)
                else:
                    xt = tl.load(x_tile + k0, mask=in_rows[:, None], other=0.0)
                wt = tl.load(w_tile + k0)
            else:
                in_k = k0 + kk < K
                xt = tl.load(x_tile + k0, mask=in_rows[:, None] & in_k[None, :], other=0.0)
                wt = tl.load(w_tile + k0, mask=in_k[:, None], other=0.0)
            if UPCAST:
                acc = tl.dot(xt.to(tl.float32), wt.to(tl.float32), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        if GDC:  # the next kernel's programs may take this SM's room from here on, not while the weight streams
            tl.extra.cuda.gdc_launch_dependents()
        if pid_k == 0:
            # B of every listed adapter for these columns, one rank block each, read while the shrinks finish.
            # Loaded as [adapter, rank row, column], each adapter's slot one offset for its block: as one 2-D gather
            # (an offset per row) triton could not see the columns contiguous and loaded B 2 bytes at a time.
            jj = tl.arange(0, LIST)
            rb = tl.arange(0, BLOCK_R)
            slot_j = tl.load(listed_ptr + jj)
            rank_j = tl.where(slot_j >= 0, tl.load(ranks_ptr + tl.maximum(slot_j, 0)), 0)
            b_base = b_ptr + tl.maximum(slot_j, 0).to(tl.int64) * stride_bs
            bt3 = tl.load(
                b_base[:, None, None] + rb[None, :, None] * stride_br + cols[None, None, :],
                mask=((rb[None, :] < rank_j[:, None]) & (rb[None, :] < R))[:, :, None],
                other=0.0,
            )
            bt = tl.reshape(bt3, (LIST * BLOCK_R, BLOCK_N))
            done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
            while done < NUM_SUMS:
                done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
            hx = tl.load(hx_ptr + rows[:, None] * stride_hm + (sl * LIST * BLOCK_R + cq)[None, :], cache_modifier=".cg")
            if UPCAST:
                acc = tl.dot(hx.to(tl.float32), bt.to(tl.float32), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(hx.to(bt.dtype), bt, acc, input_precision=PRECISION)
        out_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        out_tile = pid_m * GRID_N + pid_n
        _store_tile(
            acc, bias, out_ptrs, in_rows[:, None], partial_ptr, arrivals_ptr, out_tile, pid_k, SPLIT_K, HAS_BIAS
        )
        # The last GEMM program resets the launch's counters: by then every program has drawn its ticket (the
        # GEMM programs all have, and they waited for every shrink program).
        finished = tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel", scope="gpu")
        if finished == NUM_GEMM - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 2, 0, sem="relaxed", scope="gpu")


def fits(slice_sizes: Sequence[int], max_rank: int) -> bool:
    """Whether `gemm_lora_few` takes a group of these slices from stacks of `max_rank`: a common column tile of
    16 or more, and room for two adapters or more in the extra K tile (`capacity`)."""
    return capacity(max_rank) >= 2 and block_n_for(slice_sizes, sum(slice_sizes)) is not None


def workspace_columns(slices: int) -> int:
    """Columns of `hx` one call site of `slices` slices needs: the extra K tile per slice."""
    return slices * EXTRA_COLUMNS


def workspace_rows(num_tokens: int, splits: int = MAX_SHRINK_SPLITS) -> int:
    """Rows of `hx` for `num_tokens` rows and K in `splits` parts: whole row tiles (`row_tile`), which the shrink
    programs store, per part."""
    block_m = row_tile(num_tokens)[0]
    return splits * triton.cdiv(num_tokens, block_m) * block_m


def shrink_splits(k_dim: int, gemm_programs: int, sm_count: int) -> int:
    """Parts of K the shrink programs split, for an input width of `k_dim` and `gemm_programs` GEMM programs on
    `sm_count` SMs: 4 (parts of 1024 or more) where the GEMM leaves SMs free, else 1. One program streaming all of
    x and A cannot keep up with the GEMM's many (down: 71.2 us with one part, 39.2 with 4, 44.4 with 8, where
    the last arrival sums more parts); where the GEMM's programs fill the GPU (gate/up, two an SM) more shrink
    programs only crowd them (74.4 us with one part, 76.3 with 4). Measured at Llama-7B shapes, 8 adapters, one
    H100 (bench/RESULTS-gpu.md, stop 30)."""
    if gemm_programs >= sm_count:
        return 1
    return max(1, min(4, k_dim // 1024))


def sync_words(device: torch.device, site: int) -> torch.Tensor:
    """The counters of call site `site` (e.g. a layer's projection group) for launches on the current stream,
    zero between launches. One set per site: with PDL, a launch's programs draw their tickets while the launch
    before it still runs. Per stream as `kernels_gemm_lora._arrivals`: launches on one stream, or replays of
    graphs captured on one stream, never overlap."""
    if not 0 <= site < _MAX_SITES:
        raise ValueError(f"call site {site}: 0 to {_MAX_SITES - 1}")
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    if key not in _SYNC:
        _SYNC[key] = torch.zeros(_MAX_SITES, SYNC_WORDS, dtype=torch.int32, device=device)
    return _SYNC[key][site]


_MAX_SITES = 1024  # 256 layers of 4 projection groups
_SYNC: dict[tuple[str, int], torch.Tensor] = {}


def gemm_lora_few(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    token_slots: torch.Tensor,
    listed: torch.Tensor,
    sync: torch.Tensor,
    hx: torch.Tensor | None = None,
    *,
    slice_sizes: Sequence[int],
    split_k: int | None = None,
    h_splits: int | None = None,
) -> torch.Tensor:
    """`x @ w.T + bias` plus each row's LoRA delta from its listed adapter (module docstring), as a new tensor.

    `listed`: int32 [capacity(R)], the slots of the rows' adapters, -1 for unused entries. `sync`: int32
    [SYNC_WORDS], zero before the first launch and left zero by each; one per call site whose launches may
    overlap (with PDL, a launch and the next). `hx`: the shrink's fp32 workspace, `workspace_rows` by
    `workspace_columns` (allocated here when None). Raises ValueError where the shapes do not fit (`fits` False:
    use the separate kernels). `split_k` overrides the splits of K `tiling` picks, `h_splits` the parts of K
    `shrink_splits` gives the shrink programs (tests, benches).
    """
    num_tokens, k_dim = x.shape
    n_dim = w.shape[0]
    sizes = list(slice_sizes)
    r_slice, block_n, split = checked_layout(x, w, a_stack, b_stack, sizes, split_k)
    if listed.shape != (capacity(r_slice),) or listed.dtype != torch.int32:
        raise ValueError(f"listed must be int32 [{capacity(r_slice)}] for stacks of rank {r_slice}")
    if sync.numel() < SYNC_WORDS or sync.dtype != torch.int32:
        raise ValueError(f"sync must be int32 with {SYNC_WORDS} words")
    block_m, warps = row_tile(num_tokens)
    block_r = max(RANK_BLOCK.value, triton.next_power_of_2(r_slice))
    grid_m, grid_n = triton.cdiv(num_tokens, block_m), n_dim // block_n
    if grid_m * grid_n > _MAX_SPLIT_TILES:
        split = 1  # more output tiles than split-K arrival counts (`kernels_gemm_lora._arrivals`)
    num_gemm = grid_m * grid_n * split
    sums = grid_m * len(sizes)
    h_split = h_splits or shrink_splits(k_dim, num_gemm, kernels_triton._sm_count(x.device))
    if not 1 <= h_split <= MAX_SHRINK_SPLITS:
        raise ValueError(f"h_splits {h_split}: 1 to {MAX_SHRINK_SPLITS}")
    if sums > SYNC_WORDS - SYNC_HEAD:
        h_split = 1  # no room for the parts' arrival counts (over 28 row tiles and slices): one part each
    rows_padded, columns = workspace_rows(num_tokens, 1), workspace_columns(len(sizes))
    if hx is None:
        hx = torch.empty(h_split * rows_padded, columns, dtype=torch.float32, device=x.device)
    elif (
        hx.shape[0] < h_split * rows_padded or hx.shape[1] < columns or hx.stride(-1) != 1 or hx.dtype != torch.float32
    ):
        raise ValueError(f"hx must hold {h_split * rows_padded} x {columns} of fp32, contiguous along its rows")
    num_h = sums * h_split
    # The shrink programs' pipeline holds A tiles of 128 columns where the GEMM's holds weight tiles.
    block_k, stages = _pipeline(x, num_gemm, block_m + max(block_n, EXTRA_COLUMNS))
    k_split = triton.cdiv(triton.cdiv(k_dim, split), block_k) * block_k
    k_h = triton.cdiv(triton.cdiv(k_dim, h_split), block_k) * block_k
    out = torch.empty(num_tokens, n_dim, dtype=x.dtype, device=x.device)
    partials = arrivals = out
    if split > 1:
        partials = torch.empty(grid_m * grid_n * split * block_m * block_n, dtype=torch.float32, device=x.device)
        arrivals = _arrivals(x.device)
    starts = slice_starts(sizes)
    pdl = kernels_triton.pdl_default(x.device)
    _gemm_lora_few_kernel[(num_h + num_gemm,)](
        x,
        w,
        bias if bias is not None else w,
        out,
        token_slots,
        listed,
        a_stack,
        b_stack,
        ranks,
        scalings,
        hx,
        sync,
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
        hx.stride(0),
        rows_padded * hx.stride(0),
        K=k_dim,
        K_H=k_h,
        H_SPLIT=h_split,
        R=r_slice,
        BLOCK_R=block_r,
        LIST=capacity(r_slice),
        SLICES=len(sizes),
        GRID_N=grid_n,
        NUM_H=num_h,
        NUM_SUMS=sums,
        SYNC_HEAD=SYNC_HEAD,
        NUM_GEMM=num_gemm,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        K_SPLIT=k_split,
        EVEN_K=k_split * split == k_dim,
        EVEN_M=num_tokens % block_m == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=bool(triton.knobs.runtime.interpret),
        GDC=pdl,
        num_warps=warps,
        num_stages=stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
