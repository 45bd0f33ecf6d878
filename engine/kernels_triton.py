"""Triton multi-LoRA kernels: segmented shrink and expand over tokens grouped by adapter slot.

Tokens are grouped by slot and cut into chunks of at most `block_m` tokens (`SegmentPlan`); a chunk's
programs read its adapter's weights once for all its tokens. Chunks of 16 or 64 (prefill, or one adapter
over a batch) run tensor-core tiles; chunks of 1 (decode's default: the per-token gather) run plain
matrix-vector bodies, so a batch of distinct adapters wastes no tile rows. Both kernels take several
projections sharing an input at once ("slices": fused q/k/v, gate/up).

The launch grid is fixed (`programs` programs, so a CUDA graph can replay any batch that fits the plan);
each program reads the number of real chunks and spreads them over the grid itself. A work unit is a
(chunk, slice, rank block of 16) that holds some of the chunk's rank: every program scans the plan's ranks, so
a chunk of rank 64 gets 4 units per slice and one of rank 8 gets 1, whatever the stack's R (`_locate`; plans
of over `_MAX_SCANNED_CHUNKS` chunks give every chunk R/16 and drop the units past its rank). Few units get
many programs each (split over K or N), many units get few each. Padding programs exit early. (Shrink's rank
block is `ShrinkConfig.block_r`, 16 by default.)

- shrink reads `a_stack[S, L*R, K]` (the slices' A stacked along the rank axis) and adds into a zeroed
  fp32 `h[T, L*R]` (atomic adds, one per K split):

      for chunk c, slice l, rank block rb < cdiv(ranks[s], 16), K range Kp:    # one program each
          s = chunk_slot[c]; rows = l*R + [rb*16, rb*16 + 16) that are < l*R + ranks[s]
          for t in tokens of c:
              h[t, rows] += a_stack[s, rows, Kp] @ x[t, Kp]

- expand reads `b_stack[S, N0+...+N(L-1), R]` (the slices' B stacked along the output axis) and adds into
  the fused output `y[T, N0+...]` in place; slice l uses columns [l*R, l*R + ranks[s]) of h. The programs
  of a (chunk, slice)'s units split its columns, each looping over the rank in blocks of 16. With bt the
  rank-major view of B (`bt[s, r, n] = b_stack[s, n, r]`):

      for chunk c, slice l, column range Np:          # a rank-64 chunk: 4x the programs of a rank-16 one
          s = chunk_slot[c]
          for t in tokens of c:
              y[t, Np] += scalings[s] * h[t, l*R : l*R + ranks[s]] @ bt[s, :ranks[s], Np]

A rank block past a slot's rank is never loaded, so a batch of mixed ranks costs its true bytes and its
programs follow its true ranks, not every adapter padded to the stack's R. Shrink masks A's rows at the rank.
B should be stored rank-major (storage `[S, R, N]`, passed as `store.transpose(-1, -2)`: N contiguous), as
the engine's stacks are: a rank-r slot's B is then r contiguous rows, expand reads only the rows below the
rank, 16 bytes wide along N, and a rank-8 adapter in a rank-64 stack moves only its own bytes. Out-major B
(R contiguous) is accepted too; there the last rank block is read up to its end (zero by the layout
contract, and met by h masked to zero) to keep its loads 16 bytes wide along R, and a low rank wastes most of
every 32-byte sector. Tokens with slot -1 are in no chunk: their h rows stay zero and their y rows untouched.
The torch definitions live in `engine.kernels`.

Latency: at decode sizes a program spends most of its time waiting on a chain of dependent loads (chunk
count and the plan's ranks -> chunk row -> first token -> x / weights) and on the previous launch. Two
options cut it, each a keyword of `shrink` / `expand` (and `kernels.lora_apply`), compared by
`bench/engine_gpu.py --pdl-only`:
- `pdl` (programmatic dependent launch, Hopper and later): the kernel is launched while the previous one in
  the stream finishes, and reads everything no kernel of the step writes (plan, ranks, scalings, the first
  weight tile) before `gdc_wait`, the activations (x; h and y) only after it. Sound because plan, ranks,
  scalings and the stacks are written by host copies or adapter loads, never by the kernel just before.
  The interpreter runs the same load order without the wait (it has no griddepcontrol); pre-Hopper GPUs
  ignore the option.
- `short_chain`: the chunk row carries its first token, so per-token programs need no `token_order` load,
  and token and activation loads are issued as soon as the chunk row arrives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from engine.lora_plan import SegmentPlan

MAX_SLICES = 4

# Defaults of the latency options (module docstring) where a caller passes None. On an H200
# (bench/engine_gpu.py --pdl-only, bench/RESULTS-gpu.md) PDL cut LoRA time per Llama-7B layer by 8-25%;
# the short chain alone was neutral (x0.98-1.00) and costs nothing with it.
PDL_BY_DEFAULT = True
SHORT_CHAIN_BY_DEFAULT = True


@dataclass(frozen=True, slots=True)
class ShrinkConfig:
    """Launch shape of the shrink kernel: `programs_per_sm` x SMs programs share out the chunks. A work unit
    covers `block_r` rank rows of one slice (16: programs follow each chunk's true rank in steps of 16)."""

    block_k: int = 128
    block_r: int = 16
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 4


@dataclass(frozen=True, slots=True)
class ExpandConfig:
    """Launch shape of the expand kernel: `programs_per_sm` x SMs programs share out the chunks, one work unit
    per `unit_rows` rank rows of a chunk (8: a rank-8 adapter, whose rows cost half a rank-16 one's, gets half
    the programs; the rank loop inside a program still steps by 16)."""

    block_n: int = 256
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 4
    unit_rows: int = 16


def default_configs(block_m: int) -> tuple[ShrinkConfig, ExpandConfig]:
    """Launch shapes per chunk height, from bench/engine_gpu.py --sweep on an H200 (decode batch 64);
    prefill's keep a 64-row tile's registers under the spill line. Shrink's rank blocks are 16 rows at every
    height (chunks of 16 swept best at 64 when a block could span slices; not re-swept since).

    Per-token expand: 1024 columns are one 16-byte vector of bf16 per thread across 4 warps, so with rank-major
    B the warps lie along N only and each thread sums its own 16 rank rows (at 512, swept with out-major B, two
    warps split the rank rows and each rank block's sum crossed shared memory; offline sm_90 compile: 56
    registers instead of 64-72). Not yet re-swept on a GPU."""
    if block_m == 1:
        return ShrinkConfig(block_k=256, block_r=16, programs_per_sm=8), ExpandConfig(block_n=1024, programs_per_sm=4)
    if block_m <= 16:
        return ShrinkConfig(block_k=128, block_r=16, programs_per_sm=8), ExpandConfig(block_n=512, programs_per_sm=8)
    return ShrinkConfig(block_k=64, block_r=16), ExpandConfig(block_n=64)


@cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs still exercise the sharing out
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


@cache
def _compute_capability(device: torch.device) -> int:
    major, _ = torch.cuda.get_device_capability(device)
    return major


def pdl_supported(device: torch.device | str) -> bool:
    """Programmatic dependent launch needs a compiled (not interpreted) kernel on a Hopper or later GPU."""
    device = torch.device(device)
    return device.type == "cuda" and not triton.knobs.runtime.interpret and _compute_capability(device) >= 9


def pdl_default(device: torch.device | str) -> bool:
    """Whether kernels launch with PDL when the caller passes `pdl=None`."""
    return PDL_BY_DEFAULT and pdl_supported(device)


@dataclass(frozen=True, slots=True)
class _Latency:
    """Resolved latency options of one launch: the kernels' constexprs and triton's launch keywords."""

    pdl_order: bool  # weights before the wait (USE_PDL); the interpreter runs this order without the wait
    gdc: bool  # emit griddepcontrol and launch with PDL (GDC)
    short_chain: bool  # SHORT_CHAIN

    def launch(self) -> dict[str, bool]:
        # Only passed when set: the interpreter drops unknown launch keywords anyway.
        return {"launch_pdl": True} if self.gdc else {}


def _latency(device: torch.device, pdl: bool | None, short_chain: bool | None) -> _Latency:
    # PDL asked for where it cannot run is dropped (pre-Hopper GPUs): same results, no overlap. The interpreter
    # keeps its load order, so CPU tests cover that code, but has no griddepcontrol to emit.
    interpret = bool(triton.knobs.runtime.interpret)
    asked = pdl_default(device) if pdl is None else pdl
    order = asked and (interpret or pdl_supported(device))
    short = SHORT_CHAIN_BY_DEFAULT if short_chain is None else short_chain
    return _Latency(pdl_order=order, gdc=order and not interpret, short_chain=short)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 callers expect fp32 results; tf32 would cost them ~3 decimal digits.
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast_dots() -> bool:
    # Triton 3.6's interpreter multiplies bf16 tiles as raw integers; exact upcasts keep it right.
    return bool(triton.knobs.runtime.interpret)


def _static_loops() -> bool:
    # Triton's interpreter cannot loop to a run-time bound under numpy >= 2.4 (see _shrink_kernel).
    return bool(triton.knobs.runtime.interpret)


@triton.jit
def _share(pid: tl.tensor, num_programs: tl.tensor, units: tl.tensor, parts: tl.tensor) -> tuple:
    """Programs per work unit (<= parts), the unit of `pid` and its part; spare programs get unit >= units."""
    per_unit = tl.minimum(tl.maximum(num_programs // tl.maximum(units, 1), 1), parts)
    return per_unit, pid // per_unit, pid % per_unit


@triton.jit
def _chunk_row(chunks_ptr: tl.tensor, chunk: tl.tensor) -> tuple:
    """Slot, start in token_order, length and first token of a chunk (`SegmentPlan.chunks`): 4 loads at once."""
    row = chunks_ptr + chunk * 4
    return tl.load(row).to(tl.int64), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3).to(tl.int64)


@triton.jit
def _await_previous(GDC: tl.constexpr) -> None:
    """With PDL: wait until the previous kernel in the stream has finished and its writes are visible, then
    let the next one start its prologue (it waits likewise before reading what this one writes)."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _exit_in_order(GDC: tl.constexpr) -> None:
    """Before a program returns early: with PDL, program 0 waits for the previous kernel all the same. A kernel
    none of whose programs waited could finish before its predecessor, and whatever follows it in the stream
    (waiting for it alone) could then read that predecessor's output too early."""
    if GDC:
        if tl.program_id(0) == 0:
            tl.extra.cuda.gdc_wait()


@triton.jit
def _row_dots(at: tl.tensor, xt: tl.tensor) -> tl.tensor:
    """at[r, :] . xt in fp32, per row r."""
    return tl.sum(at.to(tl.float32) * xt.to(tl.float32)[None, :], axis=1)


# Rank rows (shrink) or columns (expand) per rank block: the smallest tensor-core K and a 32-byte sector of
# bf16, so a block of a 16-aligned stack is read with 16-byte vector loads.
RANK_BLOCK = tl.constexpr(16)

# Plans of up to this many chunks share programs out by true rank (`_locate`); every program scans the plan's
# slot column once, so larger plans (long prefills in small chunks) fall back to a static share-out.
_MAX_SCANNED_CHUNKS = 1024


@triton.jit
def _locate(
    chunks_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    num_real: tl.tensor,
    n_chunks: tl.tensor,
    SLICES: tl.constexpr,
    R_BLOCKS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MAX_PER: tl.constexpr,
    CHUNKS: tl.constexpr,
) -> tuple:
    """This program's work unit: its chunk, the chunk's rank, its (slice, rank block) `j` of the chunk's
    SLICES * nb, and its place `sub` among the `per` (<= MAX_PER) programs of each unit; `past` when it has none.

    A chunk has nb = cdiv(rank, BLOCK_R) live rank blocks per slice: with CHUNKS (a power of two >= the plan's
    chunks) every program scans the real chunks' ranks and units exist only for live blocks, so programs go to
    chunks in proportion to their true rank, not the stack's. CHUNKS == 0: every chunk gets R_BLOCKS blocks
    per slice whatever its rank (the caller drops blocks past it) and `rank` is left to the caller (-1)."""
    pid = tl.program_id(0)
    if CHUNKS > 0:
        offs_c = tl.arange(0, CHUNKS)
        in_plan = offs_c < n_chunks
        slots_c = tl.load(chunks_ptr + offs_c * 4, mask=in_plan, other=0)
        ranks_c = tl.load(ranks_ptr + slots_c, mask=in_plan, other=0)
        units_c = tl.where(offs_c < num_real, (ranks_c + BLOCK_R - 1) // BLOCK_R, 0) * SLICES
        ends = tl.cumsum(units_c, axis=0)
        total = tl.sum(units_c, axis=0)
        per = tl.minimum(tl.maximum(tl.num_programs(0) // tl.maximum(total, 1), 1), MAX_PER)
        v = pid // per
        done = ends <= v
        chunk = tl.sum(done.to(tl.int32), axis=0)
        begin = tl.max(tl.where(done, ends, 0), axis=0)
        rank = tl.sum(tl.where(offs_c == chunk, ranks_c, 0), axis=0)
        nb = tl.maximum((rank + BLOCK_R - 1) // BLOCK_R, 1)
        past = v >= total
        j = v - begin
    else:
        units = SLICES * R_BLOCKS
        per = tl.minimum(tl.maximum(tl.num_programs(0) // tl.maximum(num_real * units, 1), 1), MAX_PER)
        v = pid // per
        chunk = v // units
        rank = chunk * 0 - 1
        nb = chunk * 0 + R_BLOCKS
        past = chunk >= num_real
        j = v % units
    return past, chunk, rank, j, nb, per, pid % per


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
    if BLOCK_M == 1:
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


# Elements of a weight tile per thread in the per-token bodies (x2 for expand, whose tile is read once)
# above which ptxas spilled on sm_90 (triton 3.6, offline compile: A 64x128 / 4 warps fits, B 1024x64 spills).
_TILE_PER_THREAD = 64


def _programs(device: torch.device, per_sm: int, at_least: int) -> int:
    # Every work unit of a full plan needs a program of its own, or some would never run.
    return max(per_sm * _sm_count(device), at_least)


def b_rank_major(b_stack: torch.Tensor) -> bool:
    """Whether `b_stack[S, N, R]` is stored rank-major (N contiguous, a transposed `[S, R, N]` store: a rank-r
    slot's B is r contiguous rows) rather than out-major (R contiguous)."""
    if b_stack.stride(1) == 1:
        return True
    if b_stack.stride(2) == 1:
        return False
    raise ValueError(f"b_stack [S, N, R] needs a contiguous N or R axis (strides {tuple(b_stack.stride())})")


def _scanned_chunks(plan: SegmentPlan) -> int:
    """`_locate`'s CHUNKS: the plan's chunks rounded up to a power of two, 0 past the scan limit."""
    return triton.next_power_of_2(plan.num_chunks) if plan.num_chunks <= _MAX_SCANNED_CHUNKS else 0


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
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **latency.launch(),
    )
