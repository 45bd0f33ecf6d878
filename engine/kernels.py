"""Batched multi-LoRA kernels: shrink (x @ A^T) and expand (y += scale * h @ B^T) per token slot.

Layout shared by every implementation (vLLM's `lora/` contract):
- `a_stack[S, R, K]`: slot s holds adapter A (rank r_s <= R rows; rows >= r_s are zero).
- `b_stack[S, N, R]`: slot s holds adapter B (columns >= r_s are zero).
- `ranks[S]`: rank of each slot (0 for an empty slot).
- `scalings[S]`: alpha / r (or alpha / sqrt(r) for rsLoRA) per slot.
- `token_slots[T]`: slot of each token, -1 = base model only (no LoRA contribution).

Semantics (pseudo-code):

    shrink:  for t in range(T):
                 s = token_slots[t]
                 h[t, :] = 0 if s < 0 else a_stack[s, :ranks[s], :] @ x[t, :]   (zero padded to R)
    expand:  for t in range(T):
                 s = token_slots[t]
                 if s >= 0: y[t, :] += scalings[s] * b_stack[s, :, :ranks[s]] @ h[t, :ranks[s]]

`*_reference` are the plain torch definitions tests compare against; `lora_shrink` / `lora_expand`
pick the fastest implementation for the device (grouped matmuls on CPU).
"""

from __future__ import annotations

import torch


def lora_shrink_reference(
    x: torch.Tensor, a_stack: torch.Tensor, ranks: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """Per-token loop over the pseudo-code above; slow, obviously right."""
    num_tokens, max_rank = x.shape[0], a_stack.shape[1]
    out = torch.zeros(num_tokens, max_rank, dtype=torch.float32, device=x.device)
    for t in range(num_tokens):
        s = int(token_slots[t])
        if s < 0:
            continue
        r = int(ranks[s])
        out[t, :r] = a_stack[s, :r].float() @ x[t].float()
    return out.to(x.dtype)


def lora_expand_reference(
    y: torch.Tensor,
    h: torch.Tensor,
    b_stack: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """Per-token loop over the pseudo-code above; adds into `y` in place."""
    for t in range(y.shape[0]):
        s = int(token_slots[t])
        if s < 0:
            continue
        r = int(ranks[s])
        delta = float(scalings[s]) * (b_stack[s, :, :r].float() @ h[t, :r].float())
        y[t] += delta.to(y.dtype)


def _segments(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, token indices) for every slot >= 0 present in the batch."""
    slots = token_slots.tolist()
    groups: dict[int, list[int]] = {}
    for t, s in enumerate(slots):
        if s >= 0:
            groups.setdefault(s, []).append(t)
    device = token_slots.device
    return [(s, torch.tensor(idx, dtype=torch.long, device=device)) for s, idx in groups.items()]


def lora_apply_grouped(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    token_slots: torch.Tensor,
    segments: list[tuple[int, torch.Tensor]] | None = None,
) -> None:
    """shrink + expand, one pair of matmuls per adapter present, only over that adapter's rank.

    This is the CPU path: with few tokens per adapter, matmuls on the true rank beat any gather.
    `segments` may be precomputed once per step and shared by every projection of every layer.
    """
    for s, idx in segments if segments is not None else _segments(token_slots):
        r = int(ranks[s])
        if r == 0:
            continue
        xs = x.index_select(0, idx)
        delta = (xs @ a_stack[s, :r].t()) @ b_stack[s, :, :r].t()
        y.index_add_(0, idx, delta, alpha=float(scalings[s]))
