"""Fused elementwise kernels (`engine.kernels_elementwise`) against torch, interpreted on the CPU.

The interpreted cases run in a child pytest with TRITON_INTERPRET=1 (`test_triton_interpreted`).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from engine.model import RMSNorm
from tests.unit.engine.interpreted import INTERPRETED, run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_shapes_are_checked_before_launch() -> None:
    from engine.kernels_elementwise import add_rms_norm, silu_and_mul

    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(torch.zeros(3, 8), torch.zeros(3, 8), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm(torch.zeros(8, 3).t(), torch.zeros(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="2I"):
        silu_and_mul(torch.zeros(3, 7))


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="parent process only; needs triton")
def test_triton_interpreted() -> None:
    run_interpreted(f"{__file__}::TestInterpreted")


@pytest.mark.skipif(not INTERPRETED, reason="runs inside test_triton_interpreted's child process")
class TestInterpreted:
    """Sizes that are no power of two (masked tails), rows read through a stride (a slice of a wider tensor)."""

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("size", [48, 576])
    def test_add_rms_norm_matches_torch(self, dtype: torch.dtype, size: int) -> None:
        from engine.kernels_elementwise import add_rms_norm

        gen = torch.Generator().manual_seed(size)
        x = torch.randn(5, size, generator=gen).to(dtype)
        wide = torch.randn(5, size + 16, generator=gen).to(dtype)
        delta = wide[:, 16:]  # row stride size + 16
        norm = RMSNorm(size, 1e-5)
        norm.weight.data = (torch.rand(size, generator=gen) + 0.5).to(dtype)

        total, out = add_rms_norm(x, delta, norm.weight, norm.eps)

        want_total = x + delta
        # Within one unit of the last place: the interpreter narrows to bf16 by truncating where compiled code
        # rounds to nearest (tests/gpu/test_elementwise_gpu.py checks the sum equals torch's there).
        ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-7
        assert torch.allclose(total.float(), want_total.float(), rtol=ulp, atol=0)
        assert rel_err(out, norm(want_total)) < TOLERANCE[dtype]

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("inter", [48, 1536])
    def test_silu_and_mul_matches_torch(self, dtype: torch.dtype, inter: int) -> None:
        from engine.kernels_elementwise import silu_and_mul

        gate_up = torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(dtype) * 3
        want = F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
        assert rel_err(silu_and_mul(gate_up), want) < TOLERANCE[dtype]
