"""A decode step whose LoRA shrinks are folded into the norm and SiLU kernels (`LoRAStacks.fold_shrinks`), or whose
projections carry their LoRA inside the GEMM (`LoRAStacks.lora_gemm`), against the same step with separate shrinks
and expands, interpreted on the CPU (tests/gpu/test_shrink_fused_gpu.py runs it compiled).

The interpreted case runs in a child pytest with TRITON_INTERPRET=1 (`test_triton_interpreted`).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.support.lora_fold import FOLDED, GEMM, GEMM_FEW, GEMM_FOLDED, ONE_ADAPTER, SEPARATE, decode_logits
from tests.unit.engine.interpreted import INTERPRETED, run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="parent process only; needs triton")
def test_triton_interpreted() -> None:
    run_interpreted(f"{__file__}::TestInterpreted")


@pytest.mark.skipif(not INTERPRETED, reason="runs inside test_triton_interpreted's child process")
class TestInterpreted:
    def test_folded_shrinks_give_the_separate_shrinks_logits(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from engine import kernels_shrink_fused

        folds: list[str] = []
        for name in ("add_rms_norm_shrink", "silu_and_mul_shrink"):
            kernel = getattr(kernels_shrink_fused, name)
            monkeypatch.setattr(
                kernels_shrink_fused, name, lambda *a, _k=kernel, _n=name, **kw: folds.append(_n) or _k(*a, **kw)
            )
        logits = decode_logits(torch.device("cpu"))
        # Two norms and one SiLU per layer, each folded once.
        assert sorted(folds) == ["add_rms_norm_shrink"] * 4 + ["silu_and_mul_shrink"] * 2
        torch.testing.assert_close(logits[FOLDED], logits[SEPARATE], rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("token_slots", [None, ONE_ADAPTER], ids=["adapter-mix", "one-adapter"])
    def test_lora_inside_the_gemm_gives_the_separate_kernels_logits(
        self, monkeypatch: pytest.MonkeyPatch, token_slots: list[int] | None
    ) -> None:
        from engine import kernels_gemm_lora, kernels_gemm_lora_few

        modes: list[str] = []
        single, few = kernels_gemm_lora.gemm_lora, kernels_gemm_lora_few.gemm_lora_few
        monkeypatch.setattr(kernels_gemm_lora, "gemm_lora", lambda *a, **kw: modes.append("single") or single(*a, **kw))
        monkeypatch.setattr(
            kernels_gemm_lora_few, "gemm_lora_few", lambda *a, **kw: modes.append("few") or few(*a, **kw)
        )
        variants = (SEPARATE, GEMM, GEMM_FOLDED, GEMM_FEW)
        slots = {} if token_slots is None else {"token_slots": token_slots}
        logits = decode_logits(torch.device("cpu"), variants=variants, **slots)
        # One adapter: 4 projections a layer, 2 layers, 3 variants with the GEMM, each computing h itself (with
        # folding on too: a one-adapter step folds no shrink). A mix of 3 adapters takes the few-adapter GEMM
        # where that mode is on, else the separate kernels.
        assert modes == (["few"] * 8 if token_slots is None else ["single"] * 24)
        for variant in variants[1:]:
            torch.testing.assert_close(logits[variant], logits[SEPARATE], rtol=1e-5, atol=1e-5)
