"""Slot-based KV cache: one fixed row of `max_model_len` positions per running request.

Memory is bounded up front (`max_num_seqs` x `max_model_len` tokens); a request is admitted only when a
slot is free, which is the engine's KV admission limit. Tensors are allocated zero-filled, so on the CPU
pages are only touched as they are written.
"""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig, ModelArch

log = logging.getLogger("engine")


class KVCache:
    """k[layer] / v[layer]: [slots + 1, kv_heads, max_len, head_dim].

    Row `scratch_slot` (the last) is never handed out: padding rows of a CUDA-graph batch write there.
    """

    def __init__(self, arch: ModelArch, slots: int, max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (slots + 1, arch.num_kv_heads, max_len, arch.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
        self.max_len = max_len
        self._free = list(range(slots - 1, -1, -1))
        self._free_set = set(self._free)
        self.total = slots
        self.scratch_slot = slots

    @staticmethod
    def bytes_per_token(arch: ModelArch, dtype: torch.dtype) -> int:
        return 2 * arch.num_layers * arch.kv_size * torch.tensor([], dtype=dtype).element_size()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.total - len(self._free)

    def allocate(self) -> int | None:
        """A free slot, or None when every slot holds a running request."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._free_set.discard(slot)
        return slot

    def take(self, slot: int) -> None:
        """Hand out this free slot (prefix caching picks which)."""
        self._free.remove(slot)
        self._free_set.discard(slot)

    def release(self, slot: int) -> None:
        self._free.append(slot)
        self._free_set.add(slot)

    def free_set(self) -> set[int]:
        """The free slots (do not modify)."""
        return self._free_set

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Copy the keys and values of positions [0, length) of slot `source` into slot `target`, on the current
        stream (after the steps that wrote them, before the step that reads them)."""
        for cache in (self.k, self.v):
            for layer in cache:
                layer[target, :, :length].copy_(layer[source, :, :length])


def kv_slots(
    config: EngineConfig, arch: ModelArch, max_len: int, dtype: torch.dtype, device: torch.device, reserved: int = 0
) -> int:
    """KV slots of `max_len` positions: `config.max_num_seqs`, fewer on a GPU whose free memory cannot hold them
    with `reserved` bytes left for buffers taken later (the adapter loader's: `adapter_loader.loader_gpu_bytes`)."""
    wanted = config.max_num_seqs
    if device.type != "cuda":
        return wanted
    free, _ = torch.cuda.mem_get_info(device)
    per_slot = KVCache.bytes_per_token(arch, dtype) * max_len
    # Leave room for activations of a full prefill step (logits over the vocabulary dominate).
    reserve = config.max_num_batched_tokens * arch.vocab_size * 4 * 2 + reserved
    fit = int((free * config.gpu_memory_utilization - reserve) // per_slot) - 1  # - the scratch row
    if fit < 1:
        beside = f" beside {reserved / 2**20:.0f} MiB for the adapter loader" if reserved else ""
        also = " (or --max-lora-rank, or --adapter-loader process)" if reserved else ""
        raise ValueError(
            f"not enough GPU memory for one KV slot of {max_len} tokens ({per_slot / 2**20:.0f} MiB){beside}; "
            f"lower max_model_len{also}"
        )
    if fit < wanted:
        log.warning("GPU memory holds %d KV slots of %d tokens, not %d", fit, max_len, wanted)
    return min(wanted, fit)
