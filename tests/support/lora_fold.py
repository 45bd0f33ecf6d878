"""One decode step of a tiny model on a mix of adapters, its LoRA shrinks folded into the norm and SiLU kernels
(`LoRAStacks.fold_shrinks`) or separate, its projections one GEMM with the LoRA inside (`LoRAStacks.lora_gemm`)
or the base GEMM then the LoRA kernels: shared by the interpreted CPU tests and the GPU tests."""

from __future__ import annotations

import torch

from engine.kv_cache import KVCache
from engine.lora import LoRAStacks
from engine.lora_batch import LoRABatch
from engine.lora_plan import plan_segments
from engine.model import DecodeView
from tests.support.decode_step import random_model
from tests.unit.engine.test_lora import random_adapter
from tests.unit.engine.tiny import TINY

# Base rows, adapters of ranks 2, 8 and 4; the rank-4 one has no down projection and the rank-2 one touches
# neither gate/up nor down, so some rows skip a folded shrink.
TOKEN_SLOTS = [-1, 0, 1, 3, 1, 0, -1]
# One adapter (rank 8, no o/v/up projections) beside base rows: the GEMM computes its h itself.
ONE_ADAPTER = [1, -1, 1, 1, -1]
# Variants: (fold_shrinks, lora_gemm, lora_gemm_few).
Variant = tuple[bool, bool, bool]
SEPARATE, FOLDED = (False, False, False), (True, False, False)
GEMM, GEMM_FOLDED, GEMM_FEW = (False, True, False), (True, True, False), (False, True, True)


def _stacks(variant: Variant, device: torch.device) -> LoRAStacks:
    fold, gemm, few = variant
    stacks = LoRAStacks(
        TINY, 4, 8, torch.float32, device, fused=True, fold_shrinks=fold, lora_gemm=gemm, lora_gemm_few=few
    )
    stacks.set_lora(0, random_adapter(2, 2.0, ("q_proj", "v_proj", "o_proj"), seed=1))
    stacks.set_lora(1, random_adapter(8, 0.5, ("q_proj", "k_proj", "gate_proj", "down_proj"), seed=2))
    stacks.set_lora(3, random_adapter(4, 1.0, ("v_proj", "up_proj"), seed=3))
    return stacks


@torch.inference_mode()
def decode_logits(
    device: torch.device,
    token_slots: list[int] = TOKEN_SLOTS,
    variants: tuple[Variant, ...] = (SEPARATE, FOLDED),
) -> dict[Variant, torch.Tensor]:
    """The step's fp32 logits per variant (`fold_shrinks`, `lora_gemm`, `lora_gemm_few`), from the same inputs."""
    gen = torch.Generator().manual_seed(5)
    model = random_model(TINY, gen).to(device).eval()
    rows, max_len = len(token_slots), 32
    ids = torch.randint(0, TINY.vocab_size, (rows,), generator=gen).to(device)
    positions = torch.randint(0, max_len, (rows,), generator=gen).to(device)
    kv_shape = KVCache(TINY, rows, max_len, torch.float32, torch.device("cpu")).k[0].shape
    past = [torch.randn(kv_shape, generator=gen).to(device) for _ in range(TINY.num_layers)]
    logits = {}
    used = sorted({s for s in token_slots if s >= 0})
    single = len(used) == 1
    for variant in variants:
        kv = KVCache(TINY, rows, max_len, torch.float32, device)
        for layer in range(TINY.num_layers):
            kv.k[layer].copy_(past[layer])
            kv.v[layer].copy_(past[layer].flip(-1))
        slots = torch.tensor(token_slots, dtype=torch.int32, device=device)
        stacks = _stacks(variant, device)
        stacks.wait_ready(range(stacks.slots))
        listed = None
        if 2 <= len(used) <= stacks.few_capacity:
            listed = torch.tensor(used + [-1] * (stacks.few_capacity - len(used)), dtype=torch.int32, device=device)
        plan = plan_segments(token_slots, device, block_m=1)
        batch = LoRABatch.static(stacks, slots, plan, single, listed)
        view = DecodeView.of_buffers(torch.arange(rows, device=device), positions, max_len)
        logits[variant] = model.decode(ids, view, kv, batch).float()
    return logits
