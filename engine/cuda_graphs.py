"""CUDA graphs of the decode step: one capture per (batch bucket, KV-length bucket, with or without LoRA).

A decode step of a small model is bound by kernel launches, not by the GPU: eager mode spends more host
time launching each layer's ~20 kernels than the GPU spends running them. Each step shape is captured once
at start-up and replayed. Shapes are made static by padding:

- the batch up to its bucket: padding rows write their keys and values at position 0 of the KV cache's
  scratch row and use no adapter;
- the keys read per sequence up to a KV-length bucket, masked past each sequence's own position.

Inputs live in preallocated device buffers; the LoRA plan (tokens grouped by slot, `SegmentPlan`) is sized
for the bucket and refilled before every replay, so one graph serves any mix of adapters. A graph with LoRA
applies every projection; per-projection ranks make the kernels skip what a slot's adapter lacks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache
from engine.lora import LoRABatch, LoRAStacks
from engine.model import DecoderModel, DecodeView

log = logging.getLogger("engine.graphs")

_SMALLEST_KV_BUCKET = 256


@dataclass(frozen=True, slots=True, order=True)
class GraphKey:
    batch: int
    kv_len: int
    lora: bool


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including `max_batch` (vLLM's spacing)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


def kv_len_buckets(max_len: int) -> list[int]:
    """Powers of two from 256 below `max_len`, then `max_len`: a step reads at most 2x the keys it needs."""
    sizes, size = [], _SMALLEST_KV_BUCKET
    while size < max_len:
        sizes.append(size)
        size *= 2
    return [*sizes, max_len]


def bucket_for(buckets: list[int], need: int) -> int | None:
    """The smallest bucket holding `need`, or None when none does."""
    return next((b for b in buckets if b >= need), None)


class DecodeGraphs:
    """Captured decode steps over one model, KV cache and LoRA stacks (CUDA only)."""

    def __init__(self, model: DecoderModel, kv: KVCache, stacks: LoRAStacks, max_batch: int) -> None:
        from engine.kernels_triton import plan_segments

        self.model, self.kv, self.stacks = model, kv, stacks
        self.device = kv.k[0].device
        self.batches = batch_buckets(max_batch)
        self.kv_lens = kv_len_buckets(kv.max_len)
        top = self.batches[-1]
        # Rows: input id, position, KV slot; one upload per step fills all three.
        self._inputs = torch.zeros(3, top, dtype=torch.long, device=self.device)
        self._token_slots = torch.full((top,), -1, dtype=torch.int32, device=self.device)
        self._plans = {b: plan_segments([-1] * b, self.device, block_m=1, num_chunks=b) for b in self.batches}
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._logits: dict[GraphKey, torch.Tensor] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.replays = 0

    @property
    def keys(self) -> list[GraphKey]:
        return [GraphKey(b, n, lora) for b in self.batches for n in self.kv_lens for lora in (False, True)]

    def capture_all(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse the shared memory pool."""
        self._reset_inputs(self.batches[-1])
        start = time.perf_counter()
        for key in sorted(self.keys, reverse=True):
            self._capture(key)
        log.info("captured %d decode graphs in %.1f s", len(self._graphs), time.perf_counter() - start)

    def _reset_inputs(self, rows: int) -> None:
        self._inputs[:, :rows] = 0
        self._inputs[2, :rows] = self.kv.scratch_slot
        self._token_slots[:rows] = -1

    def _forward(self, key: GraphKey) -> torch.Tensor:
        b = key.batch
        view = DecodeView.of_buffers(self._inputs[2, :b], self._inputs[1, :b], key.kv_len)
        lora = LoRABatch.static(self.stacks, self._token_slots[:b], self._plans[b]) if key.lora else None
        return self.model.decode(self._inputs[0, :b], view, self.kv, lora)

    def _capture(self, key: GraphKey) -> None:
        # Warm up on a side stream first (triton compiles, cuBLAS picks kernels), as capture requires.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(key)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._logits[key] = self._forward(key)
        self._graphs[key] = graph

    def run(
        self, input_ids: list[int], positions: list[int], kv_slots: list[int], token_slots: list[int]
    ) -> torch.Tensor | None:
        """Logits [len(input_ids), vocab] of one decode step, or None when no captured bucket fits it."""
        n = len(input_ids)
        batch = bucket_for(self.batches, n)
        kv_len = bucket_for(self.kv_lens, max(positions) + 1)
        if batch is None or kv_len is None:
            return None
        used = sorted({s for s in token_slots if s >= 0})
        key = GraphKey(batch, kv_len, bool(used))
        pad = batch - n
        host = torch.tensor(
            [input_ids + [0] * pad, positions + [0] * pad, kv_slots + [self.kv.scratch_slot] * pad], dtype=torch.long
        )
        self._inputs[:, :batch].copy_(host, non_blocking=True)
        if key.lora:
            from engine.kernels_triton import plan_segments

            padded = token_slots + [-1] * pad
            self._plans[batch].copy_(plan_segments(padded, self.device, block_m=1, num_chunks=batch))
            self._token_slots[:batch].copy_(torch.tensor(padded, dtype=torch.int32), non_blocking=True)
            self.stacks.wait_ready(used)
        self._graphs[key].replay()
        self.replays += 1
        return self._logits[key][:n]
