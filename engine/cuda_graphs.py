"""CUDA graphs of the engine's steps, captured once at start-up and replayed.

A step of a small model is bound by kernel launches, not by the GPU: eager mode spends more host time
launching each layer's ~20 kernels than the GPU spends running them. Shapes are made static by padding.

Decode (`DecodeGraphs`), one capture per (batch bucket, KV-length bucket, with or without LoRA):
- the batch is padded up to its bucket: padding rows write their keys and values at position 0 of the KV
  cache's scratch row and use no adapter;
- the keys read per sequence are padded up to a KV-length bucket, masked past each sequence's position.

Prefill (`PrefillGraphs`), one capture per (prompt-length bucket, with or without LoRA): one prompt,
padded at its end (`model.PrefillView`); a step with several new prompts replays once per prompt.

Inputs live in preallocated device buffers; the LoRA plan (tokens grouped by slot, `SegmentPlan`) is sized
for the bucket and refilled before every replay, so one graph serves any mix of adapters. A graph with LoRA
applies every projection; per-projection ranks make the kernels skip what a slot's adapter lacks.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.lora import LoRAStacks
from engine.lora_batch import LoRABatch
from engine.lora_plan import SegmentPlan, chunk_capacity, plan_segments
from engine.model import DecoderModel, DecodeView, PrefillView

log = logging.getLogger("engine.graphs")

GraphPool = Any  # torch.cuda.graph_pool_handle()'s opaque handle

_SMALLEST_KV_BUCKET = 256
_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)  # longer prompts run eagerly: their GPU time dominates


@dataclass(frozen=True, slots=True, order=True)
class GraphKey:
    batch: int
    kv_len: int
    lora: bool
    single: bool = False  # one adapter for every LoRA row (stacks with `lora_gemm` capture these apart)
    few: bool = False  # 2 to `LoRAStacks.few_capacity` adapters (stacks with `lora_gemm_few` capture these apart)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including `max_batch` (vLLM's spacing)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


def decode_graph_rows(kv_rows: int, config: EngineConfig) -> int:
    """The rows of the largest decode graph: one per KV row (every request decoding), plus the prompt tokens
    that may run beside them (`EngineConfig.graph_prompt_rows`, `fold_prompt_tokens`)."""
    return kv_rows + max(config.graph_prompt_rows, config.fold_prompt_tokens)


def kv_len_buckets(max_len: int) -> list[int]:
    """Powers of two from 256 below `max_len`, then `max_len`: a step reads at most 2x the keys it needs."""
    sizes, size = [], _SMALLEST_KV_BUCKET
    while size < max_len:
        sizes.append(size)
        size *= 2
    return [*sizes, max_len]


def prefill_buckets(max_len: int) -> list[int]:
    """Prompt-length buckets: 16 to 512 tokens, up to the context length (a padded prompt's rows write keys
    and values at positions below its bucket, all inside the cache)."""
    return [b for b in _PREFILL_BUCKETS if b <= max_len]


def bucket_for(buckets: list[int], need: int) -> int | None:
    """The smallest bucket holding `need`, or None when none does."""
    return next((b for b in buckets if b >= need), None)


def capture(
    forward: Callable[[], torch.Tensor], pool: GraphPool, stream: torch.cuda.Stream
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of `forward`, captured on `stream`, and its output tensor (rewritten by every replay).

    Graphs that may replay at the same time (decode and prefill) must be captured on different streams:
    cuBLAS keeps one workspace per stream, and a graph bakes in the workspace address of the stream it was
    captured on. Two graphs from one capture stream, replayed concurrently on two streams, share that
    workspace and corrupt each other's GEMMs (seen as wrong tokens in rows that decode while prompts join).
    """
    # Warm up first (triton compiles, cuBLAS picks kernels and takes the stream's workspace), as capture
    # requires.
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream(stream.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = forward()
    return graph, out


class DecodeGraphs:
    """Captured decode steps over one model, KV cache and LoRA stacks (CUDA only)."""

    def __init__(self, model: DecoderModel, kv: KVCache, stacks: LoRAStacks, max_batch: int, pool: GraphPool) -> None:
        self.model, self.kv, self.stacks = model, kv, stacks
        self.device = kv.k[0].device
        self.batches = batch_buckets(max_batch)
        self.kv_lens = kv_len_buckets(kv.max_len)
        top = self.batches[-1]
        # Rows: input id, position, KV slot; one upload per step fills all three.
        self._inputs = torch.zeros(3, top, dtype=torch.long, device=self.device)
        self._token_slots = torch.full((top,), -1, dtype=torch.int32, device=self.device)
        self._listed = torch.full((max(stacks.few_capacity, 1),), -1, dtype=torch.int32, device=self.device)
        self._plans = {b: plan_segments([-1] * b, self.device, block_m=1, num_chunks=b) for b in self.batches}
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._logits: dict[GraphKey, torch.Tensor] = {}
        # Every graph writes its logits here: a graph's own output would stay allocated beside every other's
        # (rows x vocabulary x 4 bytes each, hundreds of MiB over all the buckets). A step reads its logits
        # before the next step's replay on the same stream, as it did with a graph's own output.
        self._out = torch.empty(top, model.arch.vocab_size, dtype=torch.float32, device=self.device)
        self._pool = pool
        self.capture_stream = torch.cuda.Stream(self.device)  # this family's own: see `capture`
        self.replays = 0

    @property
    def keys(self) -> list[GraphKey]:
        kinds = [(False, False, False), (True, False, False)]
        kinds += [(True, True, False)] if self.stacks.lora_gemm else []
        kinds += [(True, False, True)] if self.stacks.few_capacity >= 2 else []
        keys = [GraphKey(b, n, *kind) for b in self.batches for n in self.kv_lens for kind in kinds]
        return [key for key in keys if key.batch > 1 or not key.few]  # one row has one adapter at most

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
        lora = None
        if key.lora:
            listed = self._listed if key.few else None
            lora = LoRABatch.static(self.stacks, self._token_slots[:b], self._plans[b], key.single, listed)
        return self.model.decode(self._inputs[0, :b], view, self.kv, lora, self._out[:b])

    def _capture(self, key: GraphKey) -> None:
        self._graphs[key], self._logits[key] = capture(lambda: self._forward(key), self._pool, self.capture_stream)

    def run(
        self,
        input_ids: list[int] | torch.Tensor,
        positions: list[int],
        kv_slots: list[int],
        token_slots: list[int],
    ) -> torch.Tensor | None:
        """Logits [len(input_ids), vocab] of one decode step, or None when no captured bucket fits it.
        `input_ids` may be a device tensor (the tokens of a step still in flight)."""
        n = len(input_ids)
        batch = bucket_for(self.batches, n)
        kv_len = bucket_for(self.kv_lens, max(positions) + 1)
        if batch is None or kv_len is None:
            return None
        used = sorted({s for s in token_slots if s >= 0})
        listed = self.stacks.few_list(used)
        key = GraphKey(batch, kv_len, bool(used), self.stacks.lora_gemm and len(used) == 1, listed is not None)
        pad = batch - n
        ids = [0] * n if isinstance(input_ids, torch.Tensor) else list(input_ids)
        host = torch.tensor(
            [ids + [0] * pad, positions + [0] * pad, kv_slots + [self.kv.scratch_slot] * pad], dtype=torch.long
        )
        self._inputs[:, :batch].copy_(host, non_blocking=True)
        if isinstance(input_ids, torch.Tensor):  # a step's tokens still on the device
            self._inputs[0, :n].copy_(input_ids)
        if key.lora:
            padded = token_slots + [-1] * pad
            self._plans[batch].copy_(plan_segments(padded, self.device, block_m=1, num_chunks=batch))
            self._token_slots[:batch].copy_(torch.tensor(padded, dtype=torch.int32), non_blocking=True)
            if listed is not None:
                self._listed.copy_(torch.tensor(listed, dtype=torch.int32), non_blocking=True)
            self.stacks.wait_ready(used)
        self._graphs[key].replay()
        self.replays += 1
        return self._logits[key][:n]


class PrefillGraphs:
    """Captured single-prompt prefills over one model, KV cache and LoRA stacks (CUDA only)."""

    def __init__(self, model: DecoderModel, kv: KVCache, stacks: LoRAStacks, pool: GraphPool) -> None:
        self.model, self.kv, self.stacks = model, kv, stacks
        self.device = kv.k[0].device
        self.lengths = prefill_buckets(kv.max_len)
        top = self.lengths[-1] if self.lengths else 0
        self._ids = torch.zeros(top, dtype=torch.long, device=self.device)
        self._positions = torch.arange(top, device=self.device)
        self._slot_last = torch.zeros(2, dtype=torch.long, device=self.device)  # KV slot, last real row
        self._token_slots = torch.full((top,), -1, dtype=torch.int32, device=self.device)
        # One adapter per prompt: tensor-core chunks of 16 tokens (or 64 past 256 tokens).
        self._block_m = {n: 16 if n <= 256 else 64 for n in self.lengths}
        self._chunks = {n: chunk_capacity(n, 1, self._block_m[n]) for n in self.lengths}
        self._plans = {n: self._plan([-1] * n) for n in self.lengths}
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._logits: dict[tuple[int, bool], torch.Tensor] = {}
        self._pool = pool
        self.capture_stream = torch.cuda.Stream(self.device)  # this family's own: see `capture`
        self.replays = 0

    def _plan(self, token_slots: list[int]) -> SegmentPlan:
        n = len(token_slots)
        return plan_segments(token_slots, self.device, block_m=self._block_m[n], num_chunks=self._chunks[n])

    def capture_all(self) -> None:
        self._slot_last[0] = self.kv.scratch_slot
        start = time.perf_counter()
        for n in reversed(self.lengths):
            for lora in (True, False):
                key = (n, lora)
                forward = functools.partial(self._forward, (n, lora))
                self._graphs[key], self._logits[key] = capture(forward, self._pool, self.capture_stream)
        log.info("captured %d prefill graphs in %.1f s", len(self._graphs), time.perf_counter() - start)

    def _forward(self, key: tuple[int, bool]) -> torch.Tensor:
        n, lora = key
        view = PrefillView(slot=self._slot_last[:1], last=self._slot_last[1:])
        batch = LoRABatch.static(self.stacks, self._token_slots[:n], self._plans[n]) if lora else None
        return self.model.prefill(self._ids[:n], self._positions[:n], view, self.kv, batch)

    def run(self, prompt_ids: list[int], kv_slot: int, lora_slot: int) -> torch.Tensor | None:
        """Logits [1, vocab] after prefilling `prompt_ids`, or None when the prompt fits no bucket."""
        n = len(prompt_ids)
        length = bucket_for(self.lengths, n)
        if length is None:
            return None
        key = (length, lora_slot >= 0)
        pad = length - n
        self._ids[:length].copy_(torch.tensor(prompt_ids + [0] * pad, dtype=torch.long), non_blocking=True)
        self._slot_last.copy_(torch.tensor([kv_slot, n - 1], dtype=torch.long), non_blocking=True)
        if key[1]:
            padded = [lora_slot] * n + [-1] * pad
            self._plans[length].copy_(self._plan(padded))
            self._token_slots[:length].copy_(torch.tensor(padded, dtype=torch.int32), non_blocking=True)
            self.stacks.wait_ready([lora_slot])
        self._graphs[key].replay()
        self.replays += 1
        return self._logits[key].clone()  # the next prompt of this step may replay the same graph
