"""A decode step whose LoRA shrinks are folded into the norm and SiLU kernels (`LoRAStacks.fold_shrinks`) against
the same step with separate shrinks, interpreted on the CPU (tests/gpu/test_shrink_fused_gpu.py runs it compiled).

The interpreted case runs in a child pytest with TRITON_INTERPRET=1 (`test_triton_interpreted`).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.support.lora_fold import decode_logits
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
        torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
