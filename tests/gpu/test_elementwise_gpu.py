"""The compiled fused elementwise kernels on a CUDA GPU against torch, at Llama-7B and SmolLM2 sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import kernels_elementwise

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("size", [576, 4096])
def test_add_rms_norm(size: int) -> None:
    x, delta = (torch.randn(64, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    weight = torch.rand(size, device="cuda", dtype=torch.bfloat16) + 0.5
    total, out = kernels_elementwise.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    assert rel_err(out, F.rms_norm((x + delta).float(), (size,), weight.float(), 1e-5)) < 1e-2


@pytest.mark.parametrize("inter", [1536, 11008])
def test_silu_and_mul(inter: int) -> None:
    gate_up = torch.randn(64, 2 * inter, device="cuda", dtype=torch.bfloat16) * 3
    want = F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
    assert rel_err(kernels_elementwise.silu_and_mul(gate_up), want) < 1e-2
