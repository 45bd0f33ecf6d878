"""Batched multi-LoRA kernels: shrink (x @ A^T) and expand (y += scale * h @ B^T) per token slot.

Layout shared by every implementation (vLLM's `lora/` contract):
- `a_stack[S, R, K]`: slot s holds adapter A (rank r_s <= R rows; rows >= r_s are zero).
- `b_stack[S, N, R]`: slot s holds adapter B (columns >= r_s are zero). The engine stores it rank-major,
  `[S, R, N]` passed as its transposed view (a rank-r slot's B is r contiguous rows); the triton kernels
  take either that or a contiguous `[S, N, R]` (`kernels_expand.expand`), the torch paths any strides.
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

`*_reference` are the plain torch definitions tests compare against. The front (`lora_shrink`,
`lora_expand`, `lora_apply`) picks the implementation for the device: the triton kernels of
`engine.kernels_shrink` and `engine.kernels_expand` on CUDA, grouped matmuls over each adapter's true rank on the CPU.

Fused projections ("slices"): projections sharing an input (q, k, v; gate, up) may be applied at once with
`a_stack[S, L*R, K]` (their A stacked along the rank axis, slice l in rows [l*R, (l+1)*R)) and
`b_stack[S, N0+...+N(L-1), R]` (their B stacked along the output axis) into the fused output
`y[T, N0+...]`; slice l reads h columns [l*R, (l+1)*R). `slice_sizes` = (N0, ...); L = 1 by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.lora_plan import SegmentPlan, plan_segments


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


def lora_apply_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    token_slots: torch.Tensor,
    slice_sizes: Sequence[int] | None = None,
) -> None:
    """The two references above, slice by slice (see "Fused projections"); adds into `y` in place."""
    r_slice = b_stack.shape[2]
    for sl, (n0, n1) in enumerate(_slice_bounds(b_stack, slice_sizes)):
        a_rows = a_stack[:, sl * r_slice : (sl + 1) * r_slice]
        h = lora_shrink_reference(x, a_rows, ranks, token_slots)
        y_part = y[:, n0:n1].clone()
        lora_expand_reference(y_part, h, b_stack[:, n0:n1], ranks, scalings, token_slots)
        y[:, n0:n1] = y_part


def _slice_bounds(b_stack: torch.Tensor, slice_sizes: Sequence[int] | None) -> list[tuple[int, int]]:
    sizes = list(slice_sizes) if slice_sizes is not None else [b_stack.shape[1]]
    if sum(sizes) != b_stack.shape[1]:
        raise ValueError(f"slice_sizes {sizes} do not add up to b_stack's {b_stack.shape[1]} outputs")
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds


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


def _shrink_grouped(
    x: torch.Tensor, a_stack: torch.Tensor, ranks: torch.Tensor, token_slots: torch.Tensor, num_slices: int
) -> torch.Tensor:
    num_tokens, lr = x.shape[0], a_stack.shape[1]
    r_slice = lr // num_slices
    h = torch.zeros(num_tokens, lr, dtype=x.dtype, device=x.device)
    rank_of = ranks.tolist()
    for s, idx in _segments(token_slots):
        r = int(rank_of[s])
        if r == 0:
            continue
        xs = x.index_select(0, idx)
        for sl in range(num_slices):
            rows = slice(sl * r_slice, sl * r_slice + r)
            h[idx, rows] = xs @ a_stack[s, rows].t()
    return h


def _expand_grouped(
    y: torch.Tensor,
    h: torch.Tensor,
    b_stack: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    token_slots: torch.Tensor,
    slice_sizes: Sequence[int] | None,
) -> None:
    r_slice = b_stack.shape[2]
    rank_of, scale_of = ranks.tolist(), scalings.tolist()
    bounds = _slice_bounds(b_stack, slice_sizes)
    for s, idx in _segments(token_slots):
        r = int(rank_of[s])
        if r == 0:
            continue
        hs = h.index_select(0, idx).to(b_stack.dtype)  # an fp32 h (a folded shrink's) rounds as the kernels do
        for sl, (n0, n1) in enumerate(bounds):
            delta = hs[:, sl * r_slice : sl * r_slice + r] @ b_stack[s, n0:n1, :r].t()
            y[:, n0:n1].index_add_(0, idx, delta.to(y.dtype), alpha=float(scale_of[s]))


def _plan(token_slots: torch.Tensor, device: torch.device, plan: SegmentPlan | None) -> SegmentPlan:
    return plan if plan is not None else plan_segments(token_slots, device)


def lora_shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    ranks: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    num_slices: int = 1,
    plan: SegmentPlan | None = None,
    pdl: bool | None = None,
    short_chain: bool | None = None,
) -> torch.Tensor:
    """h[T, L*R] = A[slot(t)] @ x[t] (zero for slot -1 and past each rank), in x's dtype.

    On CUDA pass `plan` (`lora_plan.plan_segments`, built once per step) to avoid reading
    `token_slots` back to the host. `pdl` / `short_chain`: the kernels' latency options (see
    `engine.kernels_triton`; None = its defaults); the CPU path has no use for them.
    """
    if not x.is_cuda:
        return _shrink_grouped(x, a_stack, ranks, token_slots, num_slices)
    from engine import kernels_shrink

    h = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    plan = _plan(token_slots, x.device, plan)
    kernels_shrink.shrink(x, a_stack, ranks, plan, h, num_slices=num_slices, pdl=pdl, short_chain=short_chain)
    return h.to(x.dtype)


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    b_stack: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    slice_sizes: Sequence[int] | None = None,
    plan: SegmentPlan | None = None,
    pdl: bool | None = None,
    short_chain: bool | None = None,
) -> None:
    """y[t] += scaling * B[slot(t)][:, :rank] @ h[t, :rank] in place, per slice; slot -1 rows untouched.

    `plan`, `pdl` and `short_chain` as in `lora_shrink`.
    """
    if not y.is_cuda:
        _expand_grouped(y, h, b_stack, ranks, scalings, token_slots, slice_sizes)
        return
    from engine import kernels_expand

    plan = _plan(token_slots, y.device, plan)
    kernels_expand.expand(
        y, h, b_stack, ranks, scalings, plan, slice_sizes=slice_sizes, pdl=pdl, short_chain=short_chain
    )


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    slice_sizes: Sequence[int] | None = None,
    plan: SegmentPlan | None = None,
    h: torch.Tensor | None = None,
    fused: bool = False,
    pdl: bool | None = None,
    short_chain: bool | None = None,
) -> None:
    """shrink then expand (y += scaling * B @ (A @ x), per token's slot and per slice), in place.

    On CUDA this runs the separate shrink and expand kernels, h kept fp32 between them; pass `h`
    (fp32 [T, L*R], zeroed) to reuse a workspace. `fused=True` runs `kernels_fused.fused` instead (one
    launch, h recomputed per program and kept in registers): correct, but 1.2-1.4x slower at Llama-7B
    decode shapes on an H200 (bench/RESULTS-gpu.md), hence not the default. `pdl` / `short_chain` pick the
    separate kernels' latency options (`engine.kernels_triton`; None = its defaults).
    """
    bounds = _slice_bounds(b_stack, slice_sizes)
    if not x.is_cuda:
        r_slice = b_stack.shape[2]
        segments = _segments(token_slots)
        for sl, (n0, n1) in enumerate(bounds):
            a_rows = a_stack[:, sl * r_slice : (sl + 1) * r_slice]
            lora_apply_grouped(y[:, n0:n1], x, a_rows, b_stack[:, n0:n1], ranks, scalings, token_slots, segments)
        return
    from engine import kernels_expand, kernels_shrink

    plan = _plan(token_slots, x.device, plan)
    if fused:
        from engine.kernels_fused import fused as fused_apply

        fused_apply(y, x, a_stack, b_stack, ranks, scalings, plan, slice_sizes=slice_sizes)
        return
    if h is None:
        h = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    kernels_shrink.shrink(x, a_stack, ranks, plan, h, num_slices=len(bounds), pdl=pdl, short_chain=short_chain)
    kernels_expand.expand(
        y, h, b_stack, ranks, scalings, plan, slice_sizes=slice_sizes, pdl=pdl, short_chain=short_chain
    )
