"""The compiled triton LoRA kernels on a CUDA GPU against the torch references (skipped without CUDA)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from engine import kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# bf16 operands: errors between 1e-3 and 1e-2 relative; fp32 runs the dots in ieee mode.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def stacks(
    slot_ranks: Sequence[int],
    max_rank: int,
    k_dim: int,
    slice_sizes: Sequence[int],
    dtype: torch.dtype,
    rank_major: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """a_stack, b_stack, ranks, scalings on the GPU; A's rows past each slot's rank are zero.

    `rank_major` (the engine's layout): b_stack is the transposed view of a `[S, R, N]` store whose rows past
    each slot's rank hold NaN, which the kernels must never read. Else a contiguous `[S, N, R]`, zero there."""
    num_slices = len(slice_sizes)
    a = torch.randn(len(slot_ranks), num_slices * max_rank, k_dim) / k_dim**0.5
    store = torch.randn(len(slot_ranks), max_rank, sum(slice_sizes)) / max_rank**0.5
    for s, r in enumerate(slot_ranks):
        for sl in range(num_slices):
            a[s, sl * max_rank + r : (sl + 1) * max_rank] = 0
        store[s, r:] = math.nan if rank_major else 0
    ranks = torch.tensor(slot_ranks, dtype=torch.int32)
    scalings = torch.rand(len(slot_ranks)) + 0.5
    store = store.to("cuda", dtype)
    b = store.transpose(1, 2) if rank_major else store.transpose(1, 2).contiguous()
    return a.to("cuda", dtype), b, ranks.cuda(), scalings.cuda()


def reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    slots: torch.Tensor,
    slice_sizes: Sequence[int],
) -> torch.Tensor:
    """The per-token reference, run on CPU copies (a GPU loop would synchronise once per token)."""
    out = y.cpu()
    kernels.lora_apply_reference(out, x.cpu(), a.cpu(), b.cpu(), ranks.cpu(), scalings.cpu(), slots.cpu(), slice_sizes)
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.double().cpu() - want.double().cpu()).norm()
    return float(diff / want.double().cpu().norm().clamp_min(1e-30))


SCENARIOS = {
    # name: (slot of each token, slot ranks, max rank, K, slice sizes)
    "decode-64-distinct": (list(range(64)), [16] * 64, 16, 4096, [4096]),
    "decode-qkv-gqa-mixed": (
        [(t * 7) % 12 if t % 5 else -1 for t in range(37)],
        [0, 4, 8, 16, 16, 8, 4, 16, 16, 8, 0, 16],
        16,
        1024,
        [1024, 256, 256],
    ),
    "decode-mixed-ranks-64": ([t % 20 for t in range(64)], [8, 16, 32, 64] * 5, 64, 2048, [2752, 2752]),
    # bench/engine_gpu.py (c) at Llama-7B q/k/v: 64 distinct adapters, 40 of rank 8, 12 of 16, 8 of 32, 4 of 64.
    "decode-llama-qkv-mixed-64": (
        list(range(63, -1, -1)),
        [([8] * 40 + [16] * 12 + [32] * 8 + [64] * 4)[(s * 37) % 64] for s in range(64)],  # shuffled
        64,
        4096,
        [4096, 4096, 4096],
    ),
    # Ranks that follow no power of two in a rank-64 stack (programs go to chunks by their true rank, expand
    # loops over rank blocks of 16 up to each rank), in a stack of R = 24 (its last block masked at the
    # stack's edge), and prefill tiles of 64 tokens over ranks 8 / 64 / 24.
    "decode-odd-ranks-64": (
        [t % 12 if t % 7 else -1 for t in range(48)],
        [24, 8, 40, 0, 64, 17, 16, 32, 48, 1, 56, 33],
        64,
        1536,
        [1536, 512, 512],
    ),
    "decode-rank-24-stack": ([t % 6 for t in range(40)], [24, 8, 17, 0, 16, 24], 24, 1000, [700, 300]),
    "prefill-mixed-ranks-64": ([0] * 100 + [1] * 70 + [-1] * 10 + [2] * 90, [8, 64, 24], 64, 1024, [1024, 256, 256]),
    "prefill-3-adapters": (
        [0] * 300 + [-1] * 50 + [2] * 333 + [1] * 17 + [0] * 100,
        [32, 8, 32],
        32,
        1000,
        [600],
    ),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "shrink-expand"])
@pytest.mark.parametrize("block_m", [None, 16], ids=["default-chunks", "chunks-of-16"])
@pytest.mark.parametrize(
    ("dtype", "rank_major"),
    [(torch.bfloat16, True), (torch.float32, True), (torch.bfloat16, False)],
    ids=["bf16", "fp32", "bf16-out-major-b"],
)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_lora_apply_matches_reference(
    name: str, dtype: torch.dtype, rank_major: bool, block_m: int | None, fused: bool
) -> None:
    """B rank-major (the engine's layout, rows past each rank NaN: never read) and, still accepted, out-major."""
    from engine import lora_plan

    token_slots, slot_ranks, max_rank, k_dim, slice_sizes = SCENARIOS[name]
    a, b, ranks, scalings = stacks(slot_ranks, max_rank, k_dim, slice_sizes, dtype, rank_major)
    slots = torch.tensor(token_slots, dtype=torch.int32, device="cuda")
    x = torch.randn(len(token_slots), k_dim, device="cuda").to(dtype)
    y0 = torch.randn(len(token_slots), sum(slice_sizes), device="cuda").to(dtype)
    want = reference(y0, x, a, b, ranks, scalings, slots, slice_sizes)

    y = y0.clone()
    plan = lora_plan.plan_segments(token_slots, "cuda", block_m=block_m)
    kernels.lora_apply(y, x, a, b, ranks, scalings, slots, slice_sizes=slice_sizes, plan=plan, fused=fused)
    torch.cuda.synchronize()
    assert rel_err(y, want) < TOLERANCE[dtype]
    base_only = (slots < 0) | (ranks[slots.clamp_min(0)] == 0)
    assert torch.equal(y[base_only], y0[base_only])


# The separate kernels' latency options (engine.kernels_triton): PDL launches (Hopper and later; elsewhere
# ignored), the short metadata chain, both.
LATENCY_OPTIONS = {
    "pdl": {"pdl": True, "short_chain": False},
    "short": {"pdl": False, "short_chain": True},
    "both": {"pdl": True, "short_chain": True},
}


@pytest.mark.parametrize("options", sorted(LATENCY_OPTIONS))
@pytest.mark.parametrize("block_m", [None, 16], ids=["default-chunks", "chunks-of-16"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_latency_options_match_reference(name: str, block_m: int | None, options: str) -> None:
    """Eager launches, each right behind the memset of h (shrink) or the shrink (expand) it depends on."""
    from engine import lora_plan

    token_slots, slot_ranks, max_rank, k_dim, slice_sizes = SCENARIOS[name]
    a, b, ranks, scalings = stacks(slot_ranks, max_rank, k_dim, slice_sizes, torch.bfloat16)
    slots = torch.tensor(token_slots, dtype=torch.int32, device="cuda")
    x = torch.randn(len(token_slots), k_dim, device="cuda").to(torch.bfloat16)
    y0 = torch.randn(len(token_slots), sum(slice_sizes), device="cuda").to(torch.bfloat16)
    want = reference(y0, x, a, b, ranks, scalings, slots, slice_sizes)

    y = y0.clone()
    plan = lora_plan.plan_segments(token_slots, "cuda", block_m=block_m)
    pdl, short = LATENCY_OPTIONS[options]["pdl"], LATENCY_OPTIONS[options]["short_chain"]
    kernels.lora_apply(
        y, x, a, b, ranks, scalings, slots, slice_sizes=slice_sizes, plan=plan, pdl=pdl, short_chain=short
    )
    torch.cuda.synchronize()
    assert rel_err(y, want) < TOLERANCE[torch.bfloat16]
    base_only = (slots < 0) | (ranks[slots.clamp_min(0)] == 0)
    assert torch.equal(y[base_only], y0[base_only])


def test_pdl_is_supported_from_hopper_on() -> None:
    from engine import kernels_triton as kt

    assert kt.pdl_supported("cuda") == (torch.cuda.get_device_capability()[0] >= 9)
    assert kt._latency(torch.device("cuda"), True, None).gdc == kt.pdl_supported("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_front_shrink_then_expand(dtype: torch.dtype) -> None:
    token_slots, slot_ranks, max_rank, k_dim, slice_sizes = SCENARIOS["decode-qkv-gqa-mixed"]
    a, b, ranks, scalings = stacks(slot_ranks, max_rank, k_dim, slice_sizes, dtype)
    slots = torch.tensor(token_slots, dtype=torch.int32, device="cuda")
    x = torch.randn(len(token_slots), k_dim, device="cuda").to(dtype)
    y0 = torch.randn(len(token_slots), sum(slice_sizes), device="cuda").to(dtype)

    h = kernels.lora_shrink(x, a, ranks, slots, num_slices=len(slice_sizes))
    want_h = kernels.lora_shrink(x.cpu(), a.cpu(), ranks.cpu(), slots.cpu(), num_slices=len(slice_sizes))
    assert h.dtype == dtype and rel_err(h, want_h) < TOLERANCE[dtype]
    assert torch.all(h[slots < 0] == 0)

    y = y0.clone()
    kernels.lora_expand(y, h, b, ranks, scalings, slots, slice_sizes=slice_sizes)
    assert rel_err(y, reference(y0, x, a, b, ranks, scalings, slots, slice_sizes)) < TOLERANCE[dtype]


def test_shrink_of_a_few_chunks_in_a_large_plan() -> None:
    """One adapter in a plan sized for 64: its chunks get many programs each (split K) and must add up."""
    from engine import kernels_shrink, lora_plan

    _, slot_ranks, max_rank, k_dim, slice_sizes = SCENARIOS["decode-mixed-ranks-64"]
    a, _, ranks, _ = stacks(slot_ranks, max_rank, k_dim, slice_sizes, torch.bfloat16)
    token_slots = [4] * 40 + [-1] * 24  # slot 4: rank 8 in a rank-64 stack
    slots = torch.tensor(token_slots, dtype=torch.int32, device="cuda")
    x = torch.randn(len(token_slots), k_dim, device="cuda").to(torch.bfloat16)
    plan = lora_plan.plan_segments(
        token_slots, "cuda", block_m=16, num_chunks=lora_plan.chunk_capacity(64, len(slot_ranks), 16)
    )
    h = torch.zeros(len(token_slots), a.shape[1], device="cuda")
    kernels_shrink.shrink(x, a, ranks, plan, h, num_slices=len(slice_sizes))
    want = kernels.lora_shrink(x.cpu(), a.cpu(), ranks.cpu(), slots.cpu(), num_slices=len(slice_sizes))
    assert rel_err(h, want) < TOLERANCE[torch.bfloat16]
    assert torch.all(h[slots < 0] == 0)
    used = h[slots >= 0].view(40, 2, max_rank)
    assert torch.all(used[:, :, 8:] == 0) and torch.all(used[:, :, :8] != 0)


@pytest.mark.parametrize("max_rank", [16, 64], ids=["uniform-16", "mixed-in-64"])
@pytest.mark.parametrize("path", ["fused", "shrink-expand", *sorted(LATENCY_OPTIONS)])
@pytest.mark.parametrize("block_m", [1, 16])
def test_cuda_graph_replays_a_new_plan(block_m: int, path: str, max_rank: int) -> None:
    """Also PDL under stream capture: the launches become programmatic edges of the graph. The mixed stack
    holds ranks 8..64: each replayed plan shares the grid out by other ranks."""
    from engine import kernels_expand, kernels_fused, kernels_shrink, lora_plan

    fused = path == "fused"
    options = LATENCY_OPTIONS.get(path, {"pdl": False, "short_chain": False})

    num_tokens, num_slots, k_dim, slice_sizes = 64, 64, 4096, [4096, 1024, 1024]
    slot_ranks = [16] * num_slots if max_rank == 16 else [8, 16, 32, 64, 24, 8, 8, 8] * (num_slots // 8)
    a, b, ranks, scalings = stacks(slot_ranks, max_rank, k_dim, slice_sizes, torch.bfloat16)
    x = torch.randn(num_tokens, k_dim, device="cuda").to(torch.bfloat16)
    y0 = torch.randn(num_tokens, sum(slice_sizes), device="cuda").to(torch.bfloat16)
    y = y0.clone()
    capacity = lora_plan.chunk_capacity(num_tokens, num_slots, block_m)
    static = lora_plan.plan_segments(list(range(num_tokens)), "cuda", block_m=block_m, num_chunks=capacity)

    def step() -> None:
        if fused:
            kernels_fused.fused(y, x, a, b, ranks, scalings, static, slice_sizes=slice_sizes)
            return
        h = torch.zeros(num_tokens, a.shape[1], device="cuda")
        pdl, short = options["pdl"], options["short_chain"]
        kernels_shrink.shrink(x, a, ranks, static, h, num_slices=len(slice_sizes), pdl=pdl, short_chain=short)
        kernels_expand.expand(y, h, b, ranks, scalings, static, slice_sizes=slice_sizes, pdl=pdl, short_chain=short)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    # One adapter, 8 adapters with -1 holes, 64 distinct: few units with many programs each, then many units.
    for token_slots in ([5] * 64, [t % 8 if t % 3 else -1 for t in range(64)], list(range(63, -1, -1))):
        slots = torch.tensor(token_slots, dtype=torch.int32, device="cuda")
        static.copy_(lora_plan.plan_segments(token_slots, "cuda", block_m=block_m, num_chunks=capacity))
        y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        want = reference(y0, x, a, b, ranks, scalings, slots, slice_sizes)
        assert rel_err(y, want) < TOLERANCE[torch.bfloat16], token_slots


@pytest.mark.parametrize("options", sorted(LATENCY_OPTIONS))
@pytest.mark.parametrize("block_m", [1, 16])
def test_static_share_out_of_large_plans(monkeypatch: pytest.MonkeyPatch, block_m: int, options: str) -> None:
    """Plans past `_MAX_SCANNED_CHUNKS` give every chunk the stack's rank blocks and drop those past its rank."""
    from engine import kernels_triton as kt
    from engine import lora_plan

    monkeypatch.setattr(kt, "_MAX_SCANNED_CHUNKS", 2)
    token_slots, slot_ranks, max_rank, k_dim, slice_sizes = SCENARIOS["decode-odd-ranks-64"]
    a, b, ranks, scalings = stacks(slot_ranks, max_rank, k_dim, slice_sizes, torch.bfloat16)
    slots = torch.tensor(token_slots, dtype=torch.int32, device="cuda")
    x = torch.randn(len(token_slots), k_dim, device="cuda").to(torch.bfloat16)
    y0 = torch.randn(len(token_slots), sum(slice_sizes), device="cuda").to(torch.bfloat16)
    y = y0.clone()
    plan = lora_plan.plan_segments(token_slots, "cuda", block_m=block_m)
    kernels.lora_apply(
        y, x, a, b, ranks, scalings, slots, slice_sizes=slice_sizes, plan=plan, **LATENCY_OPTIONS[options]
    )
    torch.cuda.synchronize()
    assert rel_err(y, reference(y0, x, a, b, ranks, scalings, slots, slice_sizes)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("options", sorted(LATENCY_OPTIONS))
@pytest.mark.parametrize(
    "name", ["decode-qkv-gqa-mixed", "decode-mixed-ranks-64", "decode-llama-qkv-mixed-64", "decode-odd-ranks-64"]
)
def test_half_block_expand_is_the_full_block_expand_bit_for_bit(name: str, options: str) -> None:
    """`ExpandConfig.half_blocks` (chunks of rank <= 8 read in tiles of 8 rows by twice the columns, where a
    program has several tiles) writes the bits the 16-row tiles write, eagerly and replayed in a CUDA graph with
    new plans (one adapter: few chunks with many programs each, one tile or less a program; holes; the
    scenario's own)."""
    from dataclasses import replace

    from engine import kernels_expand, lora_plan
    from engine import kernels_triton as kt

    token_slots, slot_ranks, max_rank, _, slice_sizes = SCENARIOS[name]
    num_tokens = len(token_slots)
    _, b, ranks, scalings = stacks(slot_ranks, max_rank, 16, slice_sizes, torch.bfloat16)
    h = torch.randn(num_tokens, len(slice_sizes) * max_rank, device="cuda")
    y0 = torch.randn(num_tokens, sum(slice_sizes), device="cuda").to(torch.bfloat16)
    full_cfg = replace(kt.default_configs(1)[1], half_blocks=False)
    half_cfg = replace(full_cfg, half_blocks=True)
    capacity = lora_plan.chunk_capacity(num_tokens, len(slot_ranks), 1)

    def expanded(plan: lora_plan.SegmentPlan, config: kt.ExpandConfig, y: torch.Tensor | None = None) -> torch.Tensor:
        y = y0.clone() if y is None else y
        options_ = LATENCY_OPTIONS[options]
        kernels_expand.expand(y, h, b, ranks, scalings, plan, slice_sizes=slice_sizes, config=config, **options_)
        return y

    plan = lora_plan.plan_segments(token_slots, "cuda", block_m=1, num_chunks=capacity)
    assert torch.equal(expanded(plan, half_cfg), expanded(plan, full_cfg))

    y = y0.clone()
    static = lora_plan.plan_segments(token_slots, "cuda", block_m=1, num_chunks=capacity)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        expanded(static, half_cfg, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expanded(static, half_cfg, y)
    low = [s for s in sorted({s for s in token_slots if s >= 0}) if 0 < slot_ranks[s] <= 8]
    live = sorted({s for s in token_slots if s >= 0})
    for slots in (
        [low[0]] * num_tokens,
        [live[t % len(live)] if t % 3 else -1 for t in range(num_tokens)],
        token_slots,
    ):
        fresh = lora_plan.plan_segments(slots, "cuda", block_m=1, num_chunks=capacity)
        static.copy_(fresh)
        y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, expanded(fresh, full_cfg)), slots
