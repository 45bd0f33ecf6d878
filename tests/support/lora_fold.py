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
SEPARATE, FOLDED = (False, False), (True, False)  # variants: (fold_shrinks, lora_gemm)


def _stacks(fold: bool, gemm: bool, device: torch.device) -> LoRAStacks:
    stacks = LoRAStacks(TINY, 4, 8, torch.float32, device, fused=True, fold_shrinks=fold, lora_gemm=gemm)
    stacks.set_lora(0, random_adapter(2, 2.0, ("q_proj", "v_proj", "o_proj"), seed=1))
    stacks.set_lora(1, random_adapter(8, 0.5, ("q_proj", "k_proj", "gate_proj", "down_proj"), seed=2))
    stacks.set_lora(3, random_adapter(4, 1.0, ("v_proj", "up_proj"), seed=3))
    return stacks


@torch.inference_mode()
def decode_logits(
    device: torch.device,
    token_slots: list[int] = TOKEN_SLOTS,
    variants: tuple[tuple[bool, bool], ...] = (SEPARATE, FOLDED),
) -> dict[tuple[bool, bool], torch.Tensor]:
    """The step's fp32 logits per variant (`fold_shrinks`, `lora_gemm`), from the same inputs."""
    gen = torch.Generator().manual_seed(5)
    model = random_model(TINY, gen).to(device).eval()
    rows, max_len = len(token_slots), 32
    ids = torch.randint(0, TINY.vocab_size, (rows,), generator=gen).to(device)
    positions = torch.randint(0, max_len, (rows,), generator=gen).to(device)
    kv_shape = KVCache(TINY, rows, max_len, torch.float32, torch.device("cpu")).k[0].shape
    past = [torch.randn(kv_shape, generator=gen).to(device) for _ in range(TINY.num_layers)]
    logits = {}
    single = len({s for s in token_slots if s >= 0}) == 1
    for fold, gemm in variants:
        kv = KVCache(TINY, rows, max_len, torch.float32, device)
        for layer in range(TINY.num_layers):
            kv.k[layer].copy_(past[layer])
            kv.v[layer].copy_(past[layer].flip(-1))
        slots = torch.tensor(token_slots, dtype=torch.int32, device=device)
        stacks = _stacks(fold, gemm, device)
        stacks.wait_ready(range(stacks.slots))
        batch = LoRABatch.static(stacks, slots, plan_segments(token_slots, device, block_m=1), single=single)
        view = DecodeView.of_buffers(torch.arange(rows, device=device), positions, max_len)
        logits[(fold, gemm)] = model.decode(ids, view, kv, batch).float()
    return logits
