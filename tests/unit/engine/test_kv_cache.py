"""kv_slots: how many KV slots the cache takes on a GPU, from its free memory (mocked here: no GPU on this
machine), less what is reserved for later buffers."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCache, kv_slots
from tests.unit.engine.tiny import TINY

CUDA = torch.device("cuda")


def test_bytes_reserved_for_the_adapter_loader_are_left_free(monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig(max_num_seqs=1000, gpu_memory_utilization=1.0, max_num_batched_tokens=16)
    per_slot = KVCache.bytes_per_token(TINY, torch.bfloat16) * 64
    activations = config.max_num_batched_tokens * TINY.vocab_size * 4 * 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (activations + 51 * per_slot, 1 << 40))
    assert kv_slots(config, TINY, 64, torch.bfloat16, CUDA) == 50  # (one row is the scratch row)
    assert kv_slots(config, TINY, 64, torch.bfloat16, CUDA, reserved=10 * per_slot) == 40
    assert kv_slots(config, TINY, 64, torch.bfloat16, CUDA, reserved=10 * per_slot + 1) == 39


def test_no_room_for_one_slot_beside_the_reserve_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig(gpu_memory_utilization=1.0, max_num_batched_tokens=16)
    per_slot = KVCache.bytes_per_token(TINY, torch.bfloat16) * 64
    activations = config.max_num_batched_tokens * TINY.vocab_size * 4 * 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (activations + 3 * per_slot, 1 << 40))
    with pytest.raises(
        ValueError, match=r"one KV slot .* beside \d+ MiB for the adapter loader.*--adapter-loader process"
    ):
        kv_slots(config, TINY, 64, torch.bfloat16, CUDA, reserved=2 * per_slot)
