"""Shrinks fused into the norm and SiLU kernels (`engine.kernels_shrink_fused`) against their torch references,
interpreted on the CPU.

The interpreted cases run in a child pytest with TRITON_INTERPRET=1 (`test_triton_interpreted`).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.unit.engine.interpreted import INTERPRETED, run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]
# Rows on no adapter (-1), on a full-rank and a rank-8 slot, and on a slot whose rank is 0.
SLOTS = [1, -1, 0, 2, 1, 0]


def slot_ranks(r_stack: int) -> list[int]:
    return [r_stack, 8, 0]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def stack(slices: int, r_stack: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A stack of 3 slots x `slices` slices of rank `r_stack` whose rows past each slot's rank are garbage: the
    kernels must not read them (the engine's stacks hold zeros there; garbage makes a stray read show)."""
    return (torch.randn(3, slices * r_stack, k, generator=gen) / k**0.5).to(dtype)


def workspace(rows: int, width: int) -> torch.Tensor:
    """The group's columns of a wider, zeroed step workspace, as the engine passes them (a row stride that is
    not the width); the columns around them hold a marker the kernels must leave alone."""
    wide = torch.full((rows, width + 24), 7.0)
    wide[:, 8 : 8 + width] = 0
    return wide[:, 8 : 8 + width]


def untouched(h: torch.Tensor) -> bool:
    base = h.as_strided((h.shape[0], h.stride(0)), (h.stride(0), 1), h.storage_offset() - 8)
    return bool((base[:, :8] == 7).all() and (base[:, 8 + h.shape[1] :] == 7).all())


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_shapes_are_checked_before_launch() -> None:
    from engine.kernels_shrink_fused import add_rms_norm_shrink, silu_and_mul_shrink

    x, a, ranks, slots = torch.zeros(2, 64), torch.zeros(3, 32, 64), torch.tensor([16, 8, 0]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="h must be fp32"):
        add_rms_norm_shrink(x, None, torch.ones(64), 1e-5, a, ranks, slots, torch.zeros(2, 16), num_slices=1)
    with pytest.raises(ValueError, match="2 slices of equal size"):
        add_rms_norm_shrink(x, None, torch.ones(64), 1e-5, a[:, :25], ranks, slots, torch.zeros(2, 25), num_slices=2)
    with pytest.raises(ValueError, match="one slot per row"):
        add_rms_norm_shrink(x, None, torch.ones(64), 1e-5, a, ranks, slots[:1], torch.zeros(2, 32), num_slices=1)
    with pytest.raises(ValueError, match=r"\[S, L\*R, 32\]"):
        silu_and_mul_shrink(x, a, ranks, slots, torch.zeros(2, 32))


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="parent process only; needs triton")
def test_triton_interpreted() -> None:
    run_interpreted(f"{__file__}::TestInterpreted")


@pytest.mark.skipif(not INTERPRETED, reason="runs inside test_triton_interpreted's child process")
class TestInterpreted:
    """Hidden sizes under one block and over two (a masked tail), three slices (q/k/v) and one, stacks of two
    rank blocks and of one and a half."""

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize(
        ("size", "slices", "r_stack", "with_delta"), [(48, 3, 32, True), (1100, 2, 24, True), (576, 1, 32, False)]
    )
    def test_add_rms_norm_shrink_matches_torch(
        self, dtype: torch.dtype, size: int, slices: int, r_stack: int, with_delta: bool
    ) -> None:
        from engine.kernels_shrink_fused import add_rms_norm_shrink, reference_add_rms_norm_shrink

        gen = torch.Generator().manual_seed(size)
        x = torch.randn(len(SLOTS), size, generator=gen).to(dtype)
        delta = torch.randn(len(SLOTS), size + 16, generator=gen).to(dtype)[:, 16:] if with_delta else None
        weight = (torch.rand(size, generator=gen) + 0.5).to(dtype)
        a = stack(slices, r_stack, size, dtype, gen)
        ranks, slots = torch.tensor(slot_ranks(r_stack), dtype=torch.int32), torch.tensor(SLOTS, dtype=torch.int32)
        h = workspace(len(SLOTS), slices * r_stack)

        total, out = add_rms_norm_shrink(x, delta, weight, 1e-5, a, ranks, slots, h, num_slices=slices)

        want_h = torch.zeros(len(SLOTS), slices * r_stack)
        want_total, want_out = reference_add_rms_norm_shrink(
            x, delta, weight, 1e-5, a, ranks, slots, want_h, num_slices=slices
        )
        assert (total is x) == (delta is None)
        # The sum within one unit of the last place (the interpreter narrows by truncating), the norm within
        # the dtype's tolerance; h exactly as A times the kernel's own rounded rows, in fp32.
        ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-7
        assert torch.allclose(total.float(), want_total.float(), rtol=ulp, atol=0)
        assert rel_err(out, want_out) < TOLERANCE[dtype]
        exact_h = torch.zeros_like(want_h)
        for t, s in enumerate(SLOTS):
            if s >= 0:
                for begin in range(0, slices * r_stack, r_stack):
                    rows = slice(begin, begin + int(ranks[s]))
                    exact_h[t, rows] = a[s, rows].float() @ out[t].float()
        assert torch.allclose(h, exact_h, rtol=1e-4, atol=1e-5)
        assert rel_err(h, want_h) < TOLERANCE[dtype]
        assert (h[[1, 3]] == 0).all()  # no adapter, rank 0
        assert untouched(h)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("inter", [48, 1536])
    def test_silu_and_mul_shrink_matches_torch(self, dtype: torch.dtype, inter: int) -> None:
        from engine.kernels_shrink_fused import reference_silu_and_mul_shrink, silu_and_mul_shrink

        gen = torch.Generator().manual_seed(inter)
        gate_up = (torch.randn(len(SLOTS), 2 * inter, generator=gen) * 3).to(dtype)
        a = stack(1, 32, inter, dtype, gen)
        ranks, slots = torch.tensor(slot_ranks(32), dtype=torch.int32), torch.tensor(SLOTS, dtype=torch.int32)
        h = workspace(len(SLOTS), 32)

        out = silu_and_mul_shrink(gate_up, a, ranks, slots, h)

        want_h = torch.zeros(len(SLOTS), 32)
        want_out = reference_silu_and_mul_shrink(gate_up, a, ranks, slots, want_h)
        assert rel_err(out, want_out) < TOLERANCE[dtype]
        assert rel_err(h, want_h) < TOLERANCE[dtype]
        assert (h[[1, 3]] == 0).all()  # no adapter, rank 0
        assert (h[[0, 4], 8:] == 0).all()  # past the rank-8 slot's rank
        assert untouched(h)
