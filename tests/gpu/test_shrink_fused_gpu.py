"""The compiled folded-shrink kernels (`engine.kernels_shrink_fused`) on a CUDA GPU against their torch
references, at Llama-7B and SmolLM2 sizes, decode batch 64 over a mix of adapters and ranks."""

from __future__ import annotations

import pytest
import torch

from engine import kernels_shrink_fused as ksf
from tests.support.lora_fold import (
    FOLDED,
    GEMM,
    GEMM_FEW,
    GEMM_FOLDED,
    ONE_ADAPTER,
    SEPARATE,
    TOKEN_SLOTS,
    decode_logits,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# 64 rows: base rows, then slots of ranks 16, 8, 64 and 0 (a rank-64 stack), interleaved.
RANKS = [16, 8, 64, 0]
SLOTS = [-1 if t % 5 == 0 else t % 4 for t in range(64)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def inputs(slices: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    keep = torch.arange(64, device="cuda")[None, :] < torch.tensor(RANKS, device="cuda")[:, None]
    a = torch.randn(len(RANKS), slices, 64, k, device="cuda") / k**0.5 * keep[:, None, :, None]
    ranks = torch.tensor(RANKS, dtype=torch.int32, device="cuda")
    slots = torch.tensor(SLOTS, dtype=torch.int32, device="cuda")
    return a.to(torch.bfloat16).flatten(1, 2).contiguous(), ranks, slots, torch.zeros(64, slices * 64, device="cuda")


@pytest.mark.parametrize(("size", "slices"), [(576, 3), (4096, 3), (4096, 2)])
def test_add_rms_norm_shrink(size: int, slices: int) -> None:
    x, delta = (torch.randn(64, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    weight = torch.rand(size, device="cuda", dtype=torch.bfloat16) + 0.5
    a, ranks, slots, h = inputs(slices, size)
    total, out = ksf.add_rms_norm_shrink(x, delta, weight, 1e-5, a, ranks, slots, h, num_slices=slices)
    want_h = torch.zeros_like(h)
    want_total, want_out = ksf.reference_add_rms_norm_shrink(
        x, delta, weight, 1e-5, a, ranks, slots, want_h, num_slices=slices
    )
    assert torch.equal(total, want_total)
    assert rel_err(out, want_out) < 1e-2
    assert rel_err(h, want_h) < 1e-2


@pytest.mark.parametrize("inter", [1536, 11008])
def test_silu_and_mul_shrink(inter: int) -> None:
    gate_up = torch.randn(64, 2 * inter, device="cuda", dtype=torch.bfloat16) * 3
    a, ranks, slots, h = inputs(1, inter)
    out = ksf.silu_and_mul_shrink(gate_up, a, ranks, slots, h)
    want_h = torch.zeros_like(h)
    want_out = ksf.reference_silu_and_mul_shrink(gate_up, a, ranks, slots, want_h)
    assert rel_err(out, want_out) < 1e-2
    assert rel_err(h, want_h) < 1e-2


def test_folded_decode_step_matches_separate_shrinks() -> None:
    """The model's decode step (fp32) with folded shrinks against the separate triton shrinks."""
    logits = decode_logits(torch.device("cuda"))
    torch.testing.assert_close(logits[FOLDED], logits[SEPARATE], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("token_slots", [TOKEN_SLOTS, ONE_ADAPTER], ids=["adapter-mix", "one-adapter"])
def test_lora_gemm_decode_step_matches_separate_kernels(token_slots: list[int]) -> None:
    """The model's decode step (fp32) with the LoRA inside the GEMMs, folded shrinks or not, against the base
    GEMMs followed by the separate triton kernels; a mix of adapters with the few-adapter GEMM too."""
    variants = (SEPARATE, GEMM, GEMM_FOLDED, GEMM_FEW)
    logits = decode_logits(torch.device("cuda"), token_slots, variants)
    for variant in variants[1:]:
        torch.testing.assert_close(logits[variant], logits[SEPARATE], rtol=1e-4, atol=1e-4)
