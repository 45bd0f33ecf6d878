"""LoRA kernels against the per-token torch references: the CPU path here, the triton kernels interpreted.

Triton reads TRITON_INTERPRET when its kernels are defined, so the interpreted cases run in a child pytest
with the variable set (`test_triton_interpreted`), and are skipped in the parent process.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from engine import kernels
from tests.unit.engine.interpreted import INTERPRETED, run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None

# Relative error bounds: fp32 differs from the reference by summation order only; bf16 by roundings
# of h and y in different places (the kernels keep h in fp32).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclass(frozen=True, slots=True)
class Case:
    x: torch.Tensor
    y: torch.Tensor
    a_stack: torch.Tensor
    b_stack: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    token_slots: torch.Tensor
    slice_sizes: tuple[int, ...]


def make_case(
    dtype: torch.dtype,
    slot_ranks: Sequence[int],
    max_rank: int,
    k_dim: int,
    slice_sizes: Sequence[int],
    token_slots: Sequence[int],
    seed: int,
    rank_major: bool = True,
) -> Case:
    """Random stacks honouring the layout contract: rows/columns past each slot's rank are zero.

    `rank_major` (the engine's layout): b_stack is the transposed view of a `[S, R, N]` store, whose rows past
    each slot's rank hold NaN instead: the kernels must not read them (that is the bandwidth they save), and
    the references never do. Else b_stack is a contiguous `[S, N, R]`, zero past each rank."""
    gen = torch.Generator().manual_seed(seed)
    num_slots, num_slices = len(slot_ranks), len(slice_sizes)
    a = torch.randn(num_slots, num_slices * max_rank, k_dim, generator=gen) / k_dim**0.5
    b = torch.randn(num_slots, sum(slice_sizes), max_rank, generator=gen) / max_rank**0.5
    for s, r in enumerate(slot_ranks):
        for sl in range(num_slices):
            a[s, sl * max_rank + r : (sl + 1) * max_rank] = 0
        b[s, :, r:] = math.nan if rank_major else 0
    b_stack = b.transpose(1, 2).contiguous().to(dtype).transpose(1, 2) if rank_major else b.to(dtype)
    return Case(
        x=torch.randn(len(token_slots), k_dim, generator=gen).to(dtype),
        y=torch.randn(len(token_slots), sum(slice_sizes), generator=gen).to(dtype),
        a_stack=a.to(dtype),
        b_stack=b_stack,
        ranks=torch.tensor(slot_ranks, dtype=torch.int32),
        scalings=torch.rand(num_slots, generator=gen) + 0.5,
        token_slots=torch.tensor(token_slots, dtype=torch.int32),
        slice_sizes=tuple(slice_sizes),
    )


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.double() - want.double()).norm()
    return float(diff / want.double().norm().clamp_min(1e-30))


def expected_h(case: Case) -> torch.Tensor:
    r = case.b_stack.shape[2]
    return torch.cat(
        [
            kernels.lora_shrink_reference(case.x, case.a_stack[:, sl * r : (sl + 1) * r], case.ranks, case.token_slots)
            for sl in range(len(case.slice_sizes))
        ],
        dim=1,
    )


def expected_y(case: Case) -> torch.Tensor:
    y = case.y.clone()
    kernels.lora_apply_reference(
        y, case.x, case.a_stack, case.b_stack, case.ranks, case.scalings, case.token_slots, case.slice_sizes
    )
    return y


# Slots: 0 rank 8, 1 rank 16, 2 empty, 3 rank 4, 4 rank 16 (unused). Slot 1 has 18 tokens so that it
# spans two chunks of 16; -1 tokens are interleaved; slot 2 (rank 0) must leave its tokens untouched.
MIXED_SLOTS = [1, -1, 0, 1, 3, 1, 2, 1, -1, 1, 1, 0, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 2, -1]
FEW_CHUNK_SLOTS = [1] * 20 + [-1] * 3 + [3, 2, 3]  # chunks: slot 1 x2, slot 3, slot 2 (rank 0)
SHORT_SLOTS = [1, -1, 0, 3, 1, 2, 1]  # few one-token chunks in a large plan: each gets several programs
CASES = {
    "mixed-ranks": dict(slot_ranks=[8, 16, 0, 4, 16], max_rank=16, k_dim=48, slice_sizes=[40]),
    "qkv-slices": dict(slot_ranks=[8, 16, 0, 4, 16], max_rank=16, k_dim=40, slice_sizes=[24, 8, 8]),
    "rank-32-two-slices": dict(slot_ranks=[32, 16, 0, 8, 24], max_rank=32, k_dim=33, slice_sizes=[20, 36]),
    # Ranks 8..64 in a rank-64 stack: programs go to chunks by their true rank (4 rank blocks for slot 1, 2 for
    # slot 0's 24, not a multiple of 16), expand loops over rank blocks up to each rank.
    "rank-64-mixed": dict(slot_ranks=[24, 64, 0, 8, 32], max_rank=64, k_dim=40, slice_sizes=[24, 16]),
    # A stack whose R is no multiple of 16: its last rank block is masked at the stack's edge.
    "rank-24-stack": dict(slot_ranks=[17, 24, 0, 8, 16], max_rank=24, k_dim=33, slice_sizes=[20, 12, 8]),
}
DTYPES = [torch.float32, torch.bfloat16]


def case_for(name: str, dtype: torch.dtype, token_slots: Sequence[int] = MIXED_SLOTS, rank_major: bool = True) -> Case:
    seed = sorted(CASES).index(name)
    return make_case(dtype, token_slots=token_slots, seed=seed, rank_major=rank_major, **CASES[name])  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_front_matches_reference(name: str, dtype: torch.dtype) -> None:
    case = case_for(name, dtype)
    tol = TOLERANCE[dtype]
    num_slices = len(case.slice_sizes)

    h = kernels.lora_shrink(case.x, case.a_stack, case.ranks, case.token_slots, num_slices=num_slices)
    assert h.dtype == dtype
    assert rel_err(h, expected_h(case)) < tol
    assert torch.all(h[case.token_slots < 0] == 0)

    y = case.y.clone()
    kernels.lora_expand(y, h, case.b_stack, case.ranks, case.scalings, case.token_slots, slice_sizes=case.slice_sizes)
    assert rel_err(y, expected_y(case)) < tol

    y = case.y.clone()
    kernels.lora_apply(
        y,
        case.x,
        case.a_stack,
        case.b_stack,
        case.ranks,
        case.scalings,
        case.token_slots,
        slice_sizes=case.slice_sizes,
    )
    assert rel_err(y, expected_y(case)) < tol
    untouched = (case.token_slots < 0) | (case.token_slots == 2)
    assert torch.equal(y[untouched], case.y[untouched])
    assert not torch.equal(y[~untouched], case.y[~untouched])


def test_grouped_path_with_shared_segments() -> None:
    case = case_for("mixed-ranks", torch.float32)
    segments = kernels._segments(case.token_slots)
    y = case.y.clone()
    kernels.lora_apply_grouped(
        y, case.x, case.a_stack, case.b_stack, case.ranks, case.scalings, case.token_slots, segments
    )
    assert rel_err(y, expected_y(case)) < TOLERANCE[torch.float32]


def test_no_lora_tokens_leave_y_alone() -> None:
    case = case_for("qkv-slices", torch.float32, token_slots=[-1] * 5)
    y = case.y.clone()
    kernels.lora_apply(
        y,
        case.x,
        case.a_stack,
        case.b_stack,
        case.ranks,
        case.scalings,
        case.token_slots,
        slice_sizes=case.slice_sizes,
    )
    assert torch.equal(y, case.y)


def test_slice_sizes_must_cover_b() -> None:
    case = case_for("qkv-slices", torch.float32)
    with pytest.raises(ValueError, match="slice_sizes"):
        kernels.lora_apply(
            case.y.clone(),
            case.x,
            case.a_stack,
            case.b_stack,
            case.ranks,
            case.scalings,
            case.token_slots,
            slice_sizes=[24, 8],
        )


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_plan_groups_tokens_into_chunks() -> None:
    from engine.lora_plan import chunk_capacity, plan_segments

    slots = [3, -1, 3, 0, 3, 3, 0]
    plan = plan_segments(slots, "cpu", block_m=2, num_chunks=chunk_capacity(len(slots), 4, 2))
    assert plan.num_chunks == 8 and int(plan.num_real) == 3
    assert plan.chunks.shape == (8, 4) and plan.chunks.dtype == torch.int32
    order = plan.token_order.tolist()
    chunks = {(s, tuple(order[start : start + n]), first) for s, start, n, first in plan.chunks.tolist()[:3]}
    assert chunks == {(3, (0, 2), 0), (3, (4, 5), 4), (0, (3, 6), 3)}
    assert all(row == [0, 0, 0, 0] for row in plan.chunks.tolist()[3:])

    plan.copy_(plan_segments([0] * 7, "cpu", block_m=2, num_chunks=plan.num_chunks))
    assert int(plan.num_real) == 4
    assert [n for _, _, n, _ in plan.chunks.tolist()] == [2, 2, 2, 1, 0, 0, 0, 0]
    assert [first for _, _, _, first in plan.chunks.tolist()[:4]] == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="chunks"):
        plan_segments(list(range(7)), "cpu", block_m=2, num_chunks=3)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_one_token_chunks_carry_their_token() -> None:
    """Chunks of 1 (decode): the short chain reads a chunk's token from its row, not from token_order."""
    from engine.lora_plan import plan_segments

    plan = plan_segments(SHORT_SLOTS, "cpu", block_m=1, num_chunks=len(SHORT_SLOTS) + 3)
    order = plan.token_order.tolist()
    real = plan.chunks.tolist()[: int(plan.num_real)]
    assert all(n == 1 and first == order[start] and SHORT_SLOTS[first] == s for s, start, n, first in real)
    assert sorted(first for *_, first in real) == [t for t, s in enumerate(SHORT_SLOTS) if s >= 0]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_pdl_needs_a_hopper_gpu() -> None:
    from engine import kernels_triton as kt

    assert not kt.pdl_supported("cpu") and not kt.pdl_default("cpu")
    options = kt._latency(torch.device("cpu"), True, True)
    assert not options.gdc and options.launch() == {} and options.short_chain
    assert kt._latency(torch.device("cpu"), None, None).short_chain is kt.SHORT_CHAIN_BY_DEFAULT


def test_cpu_front_takes_the_latency_options() -> None:
    """The CPU path has no launches to overlap: `pdl` and `short_chain` are accepted and change nothing."""
    case = case_for("qkv-slices", torch.float32)
    y = case.y.clone()
    kernels.lora_apply(
        y,
        case.x,
        case.a_stack,
        case.b_stack,
        case.ranks,
        case.scalings,
        case.token_slots,
        slice_sizes=case.slice_sizes,
        pdl=True,
        short_chain=True,
    )
    assert rel_err(y, expected_y(case)) < TOLERANCE[torch.float32]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_b_stack_needs_a_contiguous_n_or_r_axis() -> None:
    """Rank-major B (a transposed [S, R, N] store) and out-major B are taken; B with neither axis contiguous is
    refused before any launch."""
    from engine import kernels_expand, kernels_fused, lora_plan
    from engine import kernels_triton as kt

    case = case_for("qkv-slices", torch.float32)
    assert case.b_stack.stride(1) == 1 and kt.b_rank_major(case.b_stack)
    assert not kt.b_rank_major(case_for("qkv-slices", torch.float32, rank_major=False).b_stack)
    strided = torch.zeros(case.b_stack.shape[0], case.b_stack.shape[1], 2 * case.b_stack.shape[2])[:, :, ::2]
    plan = lora_plan.plan_segments(case.token_slots, "cpu", block_m=16)
    h = torch.zeros(case.x.shape[0], case.a_stack.shape[1])
    sizes = case.slice_sizes
    with pytest.raises(ValueError, match="contiguous N or R"):
        kernels_expand.expand(case.y.clone(), h, strided, case.ranks, case.scalings, plan, slice_sizes=sizes)
    with pytest.raises(ValueError, match="contiguous N or R"):
        kernels_fused.fused(
            case.y.clone(), case.x, case.a_stack, strided, case.ranks, case.scalings, plan, slice_sizes=sizes
        )


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="parent process only; needs triton")
def test_triton_interpreted() -> None:
    run_interpreted(f"{__file__}::TestInterpreted")


# split: many programs; rank blocks past a slot's rank exit, units split over K and N tiles.
# loop: fewest programs; one per unit loops over every K block and N tile, a rank block spans slices.
# adapt: 3 real chunks in a plan sized for 9, so each unit gets more programs than the static loop
# bounds assume, and every program must stop at its own share of K and N.
# token-*: block_m 1 runs the per-token (matrix-vector) bodies, the others the tensor-core tiles.
KERNEL_SHAPES = pytest.mark.parametrize(
    ("block_m", "block_r", "per_sm", "token_slots"),
    [
        (16, 16, 16, MIXED_SLOTS),
        (16, 64, 1, MIXED_SLOTS),
        (16, 64, 4, FEW_CHUNK_SLOTS),
        (1, 64, 4, SHORT_SLOTS),
        (1, 64, 1, MIXED_SLOTS),
    ],
    ids=["split", "loop", "adapt", "token-adapt", "token-loop"],
)


@pytest.mark.skipif(not INTERPRETED, reason="runs inside test_triton_interpreted's child process")
class TestInterpreted:
    """The triton kernels, interpreted on the CPU, on shapes that hit every mask and early exit."""

    @KERNEL_SHAPES
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("name", sorted(CASES))
    def test_shrink_and_expand(
        self, name: str, dtype: torch.dtype, block_m: int, block_r: int, per_sm: int, token_slots: list[int]
    ) -> None:
        self.check_shrink_and_expand(name, dtype, block_m, block_r, per_sm, token_slots, {})

    # Latency options, on the same shapes: "short" reads tokens from the chunk rows and loads them before the
    # rank; "pdl" runs PDL's load order (weights first, the first block peeled off the loop) without the
    # griddepcontrol the interpreter lacks; "both" combines them.
    @KERNEL_SHAPES
    @pytest.mark.parametrize(
        "options",
        [{"short_chain": True}, {"pdl": True}, {"pdl": True, "short_chain": True}],
        ids=["short", "pdl", "both"],
    )
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_latency_options(
        self,
        dtype: torch.dtype,
        options: dict[str, bool],
        block_m: int,
        block_r: int,
        per_sm: int,
        token_slots: list[int],
    ) -> None:
        self.check_shrink_and_expand("qkv-slices", dtype, block_m, block_r, per_sm, token_slots, options)

    # Ranks 8..64 in a rank-64 stack under every latency option (PDL peels the first tile's first rank block);
    # the shapes of KERNEL_SHAPES that the interpreter runs fastest.
    @pytest.mark.parametrize(
        ("block_m", "block_r", "per_sm", "token_slots"),
        [(16, 64, 1, MIXED_SLOTS), (16, 64, 4, FEW_CHUNK_SLOTS), (1, 64, 4, SHORT_SLOTS)],
        ids=["loop", "adapt", "token-adapt"],
    )
    @pytest.mark.parametrize(
        "options",
        [{"short_chain": True}, {"pdl": True}, {"pdl": True, "short_chain": True}],
        ids=["short", "pdl", "both"],
    )
    def test_latency_options_mixed_ranks(
        self, options: dict[str, bool], block_m: int, block_r: int, per_sm: int, token_slots: list[int]
    ) -> None:
        self.check_shrink_and_expand("rank-64-mixed", torch.bfloat16, block_m, block_r, per_sm, token_slots, options)

    # Plans past the scan limit share programs out statically: every chunk gets the stack's rank blocks.
    @pytest.mark.parametrize(("block_m", "token_slots"), [(16, MIXED_SLOTS), (1, SHORT_SLOTS)], ids=["tile", "token"])
    @pytest.mark.parametrize("options", [{}, {"pdl": True, "short_chain": True}], ids=["current", "both"])
    @pytest.mark.parametrize("name", ["rank-64-mixed", "rank-24-stack"])
    def test_static_share_out(
        self,
        monkeypatch: pytest.MonkeyPatch,
        name: str,
        options: dict[str, bool],
        block_m: int,
        token_slots: list[int],
    ) -> None:
        from engine import kernels_triton as kt

        monkeypatch.setattr(kt, "_MAX_SCANNED_CHUNKS", 2)
        self.check_shrink_and_expand(name, torch.float32, block_m, 16, 4, token_slots, options)

    def check_shrink_and_expand(
        self,
        name: str,
        dtype: torch.dtype,
        block_m: int,
        block_r: int,
        per_sm: int,
        token_slots: list[int],
        options: dict[str, bool],
        rank_major: bool = True,
        unit_rows: int = 16,
        half_blocks: bool = False,
    ) -> torch.Tensor:
        from engine import kernels_expand, kernels_shrink, lora_plan
        from engine import kernels_triton as kt

        case = case_for(name, dtype, token_slots, rank_major)
        tol = TOLERANCE[dtype]
        # Padding chunks must be no-ops; block_k 16 leaves a ragged K tail.
        num_chunks = 9 if block_m == 16 else len(token_slots) + 6
        plan = lora_plan.plan_segments(case.token_slots, "cpu", block_m=block_m, num_chunks=num_chunks)
        lr = case.a_stack.shape[1]
        h = torch.zeros(case.x.shape[0], lr)
        shrink_cfg = kt.ShrinkConfig(block_k=16, block_r=block_r, programs_per_sm=per_sm)
        num_slices = len(case.slice_sizes)
        kernels_shrink.shrink(
            case.x, case.a_stack, case.ranks, plan, h, num_slices=num_slices, config=shrink_cfg, **options
        )
        assert rel_err(h, expected_h(case)) < tol

        y = case.y.clone()
        expand_cfg = kt.ExpandConfig(block_n=16, programs_per_sm=per_sm, unit_rows=unit_rows, half_blocks=half_blocks)
        sizes = case.slice_sizes
        kernels_expand.expand(
            y, h, case.b_stack, case.ranks, case.scalings, plan, slice_sizes=sizes, config=expand_cfg, **options
        )
        assert rel_err(y, expected_y(case)) < tol
        untouched = (case.token_slots < 0) | (case.token_slots == 2)
        assert torch.equal(y[untouched], case.y[untouched])
        return y

    # Per-token expand with chunks of rank <= 8 read in tiles of 8 rank rows by twice the columns
    # (`ExpandConfig.half_blocks`): the same bits as the 16-row body, whose other 8 rows add zeros, under every
    # latency option; ranks 4 and 8 beside 16..64 in stacks of R = 16, 24 and 64, few chunks with many programs
    # each (adapt: a program's columns end inside a wide tile) and one program per unit (loop).
    @pytest.mark.parametrize(("per_sm", "token_slots"), [(4, SHORT_SLOTS), (1, MIXED_SLOTS)], ids=["adapt", "loop"])
    @pytest.mark.parametrize("options", [{}, {"pdl": True, "short_chain": True}], ids=["current", "both"])
    @pytest.mark.parametrize(
        ("name", "dtype"),
        [
            ("rank-64-mixed", torch.float32),
            ("rank-64-mixed", torch.bfloat16),
            ("rank-24-stack", torch.bfloat16),
            ("qkv-slices", torch.bfloat16),
        ],
    )
    def test_expand_half_blocks(
        self, name: str, dtype: torch.dtype, options: dict[str, bool], per_sm: int, token_slots: list[int]
    ) -> None:
        full = self.check_shrink_and_expand(name, dtype, 1, 16, per_sm, token_slots, options)
        half = self.check_shrink_and_expand(name, dtype, 1, 16, per_sm, token_slots, options, half_blocks=True)
        assert torch.equal(half, full)

    # Expand's programs shared out per 8 rank rows (a rank-8 chunk gets half a rank-16 one's): the chunks'
    # columns are then split in more parts than a rank block loop would; also past the scan limit.
    @pytest.mark.parametrize(
        ("name", "scan", "block_m", "per_sm", "token_slots"),
        [
            ("rank-64-mixed", True, 16, 4, FEW_CHUNK_SLOTS),
            ("rank-64-mixed", True, 1, 4, SHORT_SLOTS),
            ("rank-64-mixed", False, 1, 4, SHORT_SLOTS),
            ("rank-24-stack", True, 1, 1, MIXED_SLOTS),
        ],
        ids=["adapt", "token-adapt", "token-static", "r24-token-loop"],
    )
    def test_expand_units_of_8_rank_rows(
        self, monkeypatch: pytest.MonkeyPatch, name: str, scan: bool, block_m: int, per_sm: int, token_slots: list[int]
    ) -> None:
        from engine import kernels_triton as kt

        if not scan:
            monkeypatch.setattr(kt, "_MAX_SCANNED_CHUNKS", 2)
        self.check_shrink_and_expand(name, torch.bfloat16, block_m, 16, per_sm, token_slots, {}, unit_rows=8)

    # Out-major B (contiguous [S, N, R], R contiguous), still accepted: the last rank block is read to its end
    # (zero by the layout) to keep loads wide along R; ranks 8..64 in R = 64 and 17 / 24 in R = 24.
    @KERNEL_SHAPES
    @pytest.mark.parametrize("options", [{}, {"pdl": True, "short_chain": True}], ids=["current", "both"])
    @pytest.mark.parametrize("name", ["rank-64-mixed", "rank-24-stack"])
    def test_out_major_b(
        self, name: str, options: dict[str, bool], block_m: int, block_r: int, per_sm: int, token_slots: list[int]
    ) -> None:
        self.check_shrink_and_expand(name, torch.bfloat16, block_m, block_r, per_sm, token_slots, options, False)

    # fused (shrink + expand in one launch): loop = one program per (chunk, slice) over every K block and
    # column tile; adapt = few chunks in a large plan, so each unit's programs recompute h and split its tiles.
    @pytest.mark.parametrize(
        ("block_m", "per_sm", "token_slots"),
        [(16, 1, MIXED_SLOTS), (16, 4, FEW_CHUNK_SLOTS), (1, 4, SHORT_SLOTS)],
        ids=["loop", "adapt", "token-adapt"],
    )
    @pytest.mark.parametrize(("dtype", "rank_major"), [*((d, True) for d in DTYPES), (torch.bfloat16, False)])
    @pytest.mark.parametrize("name", sorted(CASES))
    def test_fused(
        self, name: str, dtype: torch.dtype, rank_major: bool, block_m: int, per_sm: int, token_slots: list[int]
    ) -> None:
        from engine import kernels_fused, lora_plan

        case = case_for(name, dtype, token_slots, rank_major)
        num_chunks = 9 if block_m == 16 else len(token_slots) + 20
        plan = lora_plan.plan_segments(case.token_slots, "cpu", block_m=block_m, num_chunks=num_chunks)
        y = case.y.clone()
        cfg = kernels_fused.FusedConfig(block_k=16, block_n=16, programs_per_sm=per_sm)
        kernels_fused.fused(
            y,
            case.x,
            case.a_stack,
            case.b_stack,
            case.ranks,
            case.scalings,
            plan,
            slice_sizes=case.slice_sizes,
            config=cfg,
        )
        assert rel_err(y, expected_y(case)) < TOLERANCE[dtype]
        untouched = (case.token_slots < 0) | (case.token_slots == 2)
        assert torch.equal(y[untouched], case.y[untouched])

    def test_front_runs_fused(self) -> None:
        from engine import kernels_fused, lora_plan

        case = case_for("qkv-slices", torch.float32)
        plan = lora_plan.plan_segments(case.token_slots, "cpu", block_m=16)
        y = case.y.clone()
        kernels_fused.fused(
            y, case.x, case.a_stack, case.b_stack, case.ranks, case.scalings, plan, slice_sizes=case.slice_sizes
        )
        assert rel_err(y, expected_y(case)) < TOLERANCE[torch.float32]

    def test_one_adapter_prefill_chunks(self) -> None:
        from engine import kernels_expand, kernels_shrink, lora_plan
        from engine import kernels_triton as kt

        slots = [0] * 40 + [-1] * 3
        case = make_case(torch.float32, [16], 16, 32, [32], slots, seed=7)
        plan = lora_plan.plan_segments(case.token_slots, "cpu", block_m=16)
        assert plan.num_chunks == 3
        y = case.y.clone()
        h = torch.zeros(len(slots), 16)
        kernels_shrink.shrink(case.x, case.a_stack, case.ranks, plan, h)
        kernels_expand.expand(y, h, case.b_stack, case.ranks, case.scalings, plan, config=kt.ExpandConfig(block_n=16))
        assert rel_err(y, expected_y(case)) < TOLERANCE[torch.float32]
