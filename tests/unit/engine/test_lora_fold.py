"""A decode step whose LoRA shrinks are folded into the norm and SiLU kernels (`LoRAStacks.fold_shrinks`) against
the same step with separate shrinks, interpreted on the CPU (the GPU engine tests cover it compiled).

The interpreted case runs in a child pytest with TRITON_INTERPRET=1 (`test_triton_interpreted`).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.kv_cache import KVCache
from engine.lora import LoRABatch, LoRAStacks
from engine.lora_plan import plan_segments
from engine.model import DecodeView
from tests.support.decode_step import random_model
from tests.unit.engine.interpreted import INTERPRETED, run_interpreted
from tests.unit.engine.test_lora import random_adapter
from tests.unit.engine.tiny import TINY

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Base rows, adapters of ranks 2, 8 and 4; the rank-4 one has no down projection and the rank-2 one touches
# neither gate/up nor down, so some rows skip a folded shrink.
TOKEN_SLOTS = [-1, 0, 1, 3, 1, 0, -1]


def fused_stacks(fold: bool) -> LoRAStacks:
    stacks = LoRAStacks(TINY, 4, 8, torch.float32, torch.device("cpu"), fused=True, fold_shrinks=fold)
    stacks.set_lora(0, random_adapter(2, 2.0, ("q_proj", "v_proj", "o_proj"), seed=1))
    stacks.set_lora(1, random_adapter(8, 0.5, ("q_proj", "k_proj", "gate_proj", "down_proj"), seed=2))
    stacks.set_lora(3, random_adapter(4, 1.0, ("v_proj", "up_proj"), seed=3))
    return stacks


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
        gen = torch.Generator().manual_seed(5)
        model = random_model(TINY, gen).eval()
        rows, max_len = len(TOKEN_SLOTS), 32
        ids = torch.randint(0, TINY.vocab_size, (rows,), generator=gen)
        kv_slots = torch.arange(rows)
        positions = torch.randint(0, max_len, (rows,), generator=gen)
        past = [
            torch.randn(KVCache(TINY, rows, max_len, torch.float32, torch.device("cpu")).k[0].shape) for _ in range(2)
        ]
        logits = {}
        for fold in (False, True):
            kv = KVCache(TINY, rows, max_len, torch.float32, torch.device("cpu"))
            for layer in range(TINY.num_layers):
                kv.k[layer].copy_(past[layer])
                kv.v[layer].copy_(past[layer].flip(-1))
            slots = torch.tensor(TOKEN_SLOTS, dtype=torch.int32)
            batch = LoRABatch.static(fused_stacks(fold), slots, plan_segments(TOKEN_SLOTS, "cpu", block_m=1))
            view = DecodeView.of_buffers(kv_slots, positions, max_len)
            logits[fold] = model.decode(ids, view, kv, batch)
        # Two norms and one SiLU per layer, each folded once.
        assert sorted(folds) == ["add_rms_norm_shrink"] * 4 + ["silu_and_mul_shrink"] * 2
        torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
