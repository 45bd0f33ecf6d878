"""The per-step LoRA plan: tokens grouped by adapter slot and cut into chunks, built on the host once per step
and read by every triton kernel of the step (`engine.kernels_shrink`, `engine.kernels_expand`). A plan holds a
fixed number of chunk rows, so a CUDA graph captured with one replays any batch whose plan fits, after
`SegmentPlan.copy_`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.uploads import upload


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """Tokens grouped by slot and cut into chunks of <= `block_m` tokens; shared by every layer of a step.

    Chunk c covers `token_order[chunks[c, 1] : chunks[c, 1] + chunks[c, 2]]`, all using slot
    `chunks[c, 0]`; `chunks[c, 3]` is its first token (`token_order[chunks[c, 1]]`, so a one-token chunk
    needs no second lookup). The first `num_real[0]` chunks are real; padding rows are all zero. The plan
    holds `num_chunks` rows whatever the batch, so a CUDA graph captured with it replays any batch whose
    plan fits, after `copy_`.
    """

    token_order: torch.Tensor  # int32 [T]
    chunks: torch.Tensor  # int32 [num_chunks, 4]: slot, start in token_order, length, first token
    num_real: torch.Tensor  # int32 [1]
    block_m: int
    num_tokens: int
    num_chunks: int

    def copy_(self, other: SegmentPlan) -> None:
        """Overwrite this plan's buffers in place (for graph replay); shapes and block_m must match."""
        mine = (self.block_m, self.num_tokens, self.num_chunks)
        if (other.block_m, other.num_tokens, other.num_chunks) != mine:
            raise ValueError("plans differ in block_m, num_tokens or num_chunks")
        self.token_order.copy_(other.token_order, non_blocking=True)
        self.chunks.copy_(other.chunks, non_blocking=True)
        self.num_real.copy_(other.num_real, non_blocking=True)


def chunk_capacity(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Most chunks any batch of `num_tokens` over `num_slots` slots can need (size a graph's plan by it)."""
    if block_m == 1:
        return num_tokens
    return min(num_tokens, num_slots) + -(-num_tokens // block_m)


def default_block_m(num_tokens: int) -> int:
    """Tokens per chunk: 1 (per-token matrix-vector products) for decode-sized batches, 64 for prefill.

    Chunks of 16 (the smallest tensor-core tile) also serve decode; bench/engine_gpu.py times both."""
    return 1 if num_tokens <= 256 else 64


def plan_segments(
    token_slots: Sequence[int] | torch.Tensor,
    device: torch.device | str,
    *,
    block_m: int | None = None,
    num_chunks: int | None = None,
) -> SegmentPlan:
    """Group tokens by slot on the host (the scheduler already holds the slots there) and upload the plan.

    `num_chunks` sizes the plan for a graph (see `chunk_capacity`); by default it is as large as needed.
    """
    slots = token_slots.tolist() if isinstance(token_slots, torch.Tensor) else list(token_slots)
    block_m = default_block_m(len(slots)) if block_m is None else block_m
    groups: dict[int, list[int]] = {}
    for t, s in enumerate(slots):
        if s >= 0:
            groups.setdefault(int(s), []).append(t)
    order: list[int] = []
    chunks: list[tuple[int, int, int, int]] = []
    for s, tokens in groups.items():
        for begin in range(0, len(tokens), block_m):
            piece = tokens[begin : begin + block_m]
            chunks.append((s, len(order), len(piece), piece[0]))
            order.extend(piece)
    real = len(chunks)
    total = max(real, 1) if num_chunks is None else num_chunks
    if real > total:
        raise ValueError(f"batch needs {real} chunks, plan holds {total}")
    order.extend([0] * (len(slots) - len(order)))  # -1 tokens: never referenced by a chunk
    chunks.extend([(0, 0, 0, 0)] * (total - real))

    return SegmentPlan(
        token_order=upload(order, torch.int32, device),
        chunks=upload(chunks, torch.int32, device),
        num_real=upload([real], torch.int32, device),
        block_m=block_m,
        num_tokens=len(slots),
        num_chunks=total,
    )
