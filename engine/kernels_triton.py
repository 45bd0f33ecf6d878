"""The machinery shared by the segmented multi-LoRA kernels (`engine.kernels_shrink`, `engine.kernels_expand`,
and `engine.kernels_fused`): their launch shapes, the device facts and latency options they launch with, and
the triton helpers that find a program's work.

Tokens are grouped by slot and cut into chunks of at most `block_m` tokens (`SegmentPlan`); a chunk's
programs read its adapter's weights once for all its tokens. Chunks of 16 or 64 (prefill, or one adapter
over a batch) run tensor-core tiles; chunks of 1 (decode's default: the per-token gather) run plain
matrix-vector bodies, so a batch of distinct adapters wastes no tile rows. Shrink and expand each take several
projections sharing an input at once ("slices": fused q/k/v, gate/up).

The launch grid is fixed (`programs` programs, so a CUDA graph can replay any batch that fits the plan);
each program reads the number of real chunks and spreads them over the grid itself. A work unit is a
(chunk, slice, rank block of 16) that holds some of the chunk's rank: every program scans the plan's ranks, so
a chunk of rank 64 gets 4 units per slice and one of rank 8 gets 1, whatever the stack's R (`_locate`; plans
of over `_MAX_SCANNED_CHUNKS` chunks give every chunk R/16 and drop the units past its rank). Few units get
many programs each (split over K or N), many units get few each. Padding programs exit early. (Shrink's rank
block is `ShrinkConfig.block_r`, 16 by default.)

A rank block past a slot's rank is never loaded, so a batch of mixed ranks costs its true bytes and its
programs follow its true ranks, not every adapter padded to the stack's R. Tokens with slot -1 are in no
chunk: their h rows stay zero and their y rows untouched. The torch definitions live in `engine.kernels`.

Latency: at decode sizes a program spends most of its time waiting on a chain of dependent loads (chunk
count and the plan's ranks -> chunk row -> first token -> x / weights) and on the previous launch. Two
options cut it, each a keyword of `kernels_shrink.shrink` / `kernels_expand.expand` (and `kernels.lora_apply`),
compared by `bench/engine_gpu.py --pdl-only`:
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
    the programs; the rank loop inside a program still steps by 16). `half_blocks`: in the per-token body
    (chunks of 1, rank-major B), a chunk of rank <= 8 reads tiles of 8 rank rows by twice the columns
    (`kernels_expand._half_block_token`)."""

    block_n: int = 256
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 4
    unit_rows: int = 16
    half_blocks: bool = False


def default_configs(block_m: int) -> tuple[ShrinkConfig, ExpandConfig]:
    """Launch shapes per chunk height, from bench/engine_gpu.py --sweep on an H200 (decode batch 64);
    prefill's keep a 64-row tile's registers under the spill line. Shrink's rank blocks are 16 rows at every
    height (chunks of 16 swept best at 64 when a block could span slices; not re-swept since).

    Per-token expand: 1024 columns are one 16-byte vector of bf16 per thread across 4 warps, so with rank-major
    B the warps lie along N only and each thread sums its own 16 rank rows (at 512, swept with out-major B, two
    warps split the rank rows and each rank block's sum crossed shared memory; offline sm_90 compile: 56
    registers instead of 64-72). Not yet re-swept on a GPU. Chunks of rank <= 8 read tiles of 8 rows by 2048
    columns where a program has several tiles (`half_blocks`: a batch of ranks 8-64 in a rank-64 stack took
    x0.95 the time of 16-row tiles, one H100, bench/RESULTS-gpu.md stop 31)."""
    if block_m == 1:
        expand = ExpandConfig(block_n=1024, programs_per_sm=4, half_blocks=True)
        return ShrinkConfig(block_k=256, block_r=16, programs_per_sm=8), expand
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
