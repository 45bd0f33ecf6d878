"""LoRA shrinks fused into the elementwise kernels that write their inputs: the RMS norm before q/k/v and
gate/up (with the residual add before it), and SiLU-times-up before down.

Why: at decode sizes each LoRA launch costs about as much as its work (bench/RESULTS-gpu.md: 8 launches a layer,
0.9-2.3 us a graph node before any work), and three of a layer's four shrinks read exactly the rows a kernel
just wrote. Here those shrinks cost no launch of their own. For decode-sized steps only (one token per work
unit, as `lora_plan.default_block_m` plans them): each row's programs read its adapter's A themselves.

Measured on an H200 (bench/engine_layer_gpu.py, bench/engine_gpu_e2e.py): in CUDA graphs 0.99-1.00x the
separate shrinks (the folded work lengthens the norm by what the launches saved), eager steps 1.02-1.12x.
Hence opt-in (`EngineConfig.fold_lora_shrinks`).

Semantics (pseudo-code), rows t, hidden size N, intermediate size I, rank blocks of 16, fp32 inside;
`s = token_slots[t]`, `r = ranks[s]`, A stacked as the shrink kernel takes it (`a_stack[S, L*R, K]`, the
slices' A along the rank axis, `engine.kernels_shrink`), h fp32 and zeroed by the caller:

    add_rms_norm_shrink(x, delta, weight, eps, a_stack, ranks, token_slots, h) -> (total, out):
        total[t] = round(x[t] + delta[t])                   (delta None: total is x itself)
        out[t] = round(total[t] / sqrt(mean(total[t] ** 2) + eps) * weight)
        if s >= 0: for slice l: h[t, l*R : l*R + r] += a_stack[s, l*R : l*R + r] @ out[t]

    silu_and_mul_shrink(gate_up, a_stack, ranks, token_slots, h) -> out:
        out[t, j] = round(silu(gate_up[t, j]) * gate_up[t, I + j])
        if s >= 0: h[t, :r] += a_stack[s, :r] @ out[t]

`out` is the rounded output, as a separate shrink would read it. The torch definitions: `reference_*` below.
Layout: one program per (row, unit). The norm's unit 0 writes the row; each of its other units computes the row's
norm scale itself and adds one (slice, rank block, block of 512 columns) share of h, so no program waits on
another. The SiLU kernel's programs each
own a block of columns and add their block's share of h (atomics).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels import lora_shrink_reference
from engine.kernels_triton import RANK_BLOCK

_RANK_ROWS: int = RANK_BLOCK.value  # the same on the host
_NORM_BLOCK = 512  # hidden columns per loop step: an A tile of 16 x 512 stays in registers
_SILU_BLOCK = 1024  # intermediate columns per program


def reference_add_rms_norm_shrink(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    a_stack: torch.Tensor,
    ranks: torch.Tensor,
    token_slots: torch.Tensor,
    h: torch.Tensor,
    *,
    num_slices: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_shrink` in torch."""
    total = x if delta is None else x + delta
    out = F.rms_norm(total.float(), (x.shape[1],), weight.float(), eps).to(x.dtype)
    _reference_shrink(out, a_stack, ranks, token_slots, h, num_slices)
    return total, out


def reference_silu_and_mul_shrink(
    gate_up: torch.Tensor, a_stack: torch.Tensor, ranks: torch.Tensor, token_slots: torch.Tensor, h: torch.Tensor
) -> torch.Tensor:
    """`silu_and_mul_shrink` in torch."""
    inter = gate_up.shape[1] // 2
    out = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(gate_up.dtype)
    _reference_shrink(out, a_stack, ranks, token_slots, h, 1)
    return out


def _reference_shrink(
    out: torch.Tensor,
    a_stack: torch.Tensor,
    ranks: torch.Tensor,
    token_slots: torch.Tensor,
    h: torch.Tensor,
    num_slices: int,
) -> None:
    # `kernels.lora_shrink_reference` per slice, on fp32 inputs so that h stays unrounded as the kernels keep it.
    r_slice = a_stack.shape[1] // num_slices
    for begin in range(0, a_stack.shape[1], r_slice):
        rows = slice(begin, begin + r_slice)
        h[:, rows] += lora_shrink_reference(out.float(), a_stack[:, rows].float(), ranks, token_slots)


@triton.jit
def _row_sum(
    x_ptr: tl.tensor, offs: tl.tensor, ok: tl.tensor, delta_ptr: tl.tensor, HAS_DELTA: tl.constexpr
) -> tl.tensor:
    """x (+ delta) at `offs` of a row, rounded to x's dtype as torch's add would, in fp32."""
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _add_rms_norm_shrink_kernel(
    x_ptr: tl.tensor,
    delta_ptr: tl.tensor,
    weight_ptr: tl.tensor,
    sum_ptr: tl.tensor,
    out_ptr: tl.tensor,
    a_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    h_ptr: tl.tensor,
    stride_x: tl.tensor,
    stride_delta: tl.tensor,
    stride_as: tl.tensor,
    stride_ar: tl.tensor,
    stride_ht: tl.tensor,
    r_slice: tl.tensor,
    eps: tl.tensor,
    N: tl.constexpr,
    R_BLOCKS: tl.constexpr,
    K_SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DELTA: tl.constexpr,
) -> None:
    t = tl.program_id(0).to(tl.int64)
    # Program 0 of a row writes it; the others each take one (slice, rank block, block of K) of its shrink.
    unit = tl.program_id(1) - 1
    k_block = unit % K_SPLITS
    rank_unit = unit // K_SPLITS
    x_row, delta_row = x_ptr + t * stride_x, delta_ptr + t * stride_delta
    slot = tl.load(slots_ptr + t).to(tl.int64)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    if (unit >= 0) & ((slot < 0) | ((rank_unit % R_BLOCKS) * RANK_BLOCK >= rank)):
        return  # a row on no adapter, or a rank block wholly past the slot's rank
    # Every program sums the squares in the same blocks, so all see the same scale and the same rounded row.
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(K_SPLITS):
        offs = i * BLOCK + tl.arange(0, BLOCK)
        s = _row_sum(x_row, offs, offs < N, delta_row, HAS_DELTA)
        squares += s * s
    scale = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / N + eps)
    if unit < 0:
        for i in range(K_SPLITS):
            offs = i * BLOCK + tl.arange(0, BLOCK)
            ok = offs < N
            s = _row_sum(x_row, offs, ok, delta_row, HAS_DELTA)
            weight = tl.load(weight_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            if HAS_DELTA:
                tl.store(sum_ptr + t * N + offs, s.to(sum_ptr.dtype.element_ty), mask=ok)
            tl.store(out_ptr + t * N + offs, (s * scale * weight).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        local = (rank_unit % R_BLOCKS) * RANK_BLOCK + tl.arange(0, RANK_BLOCK)
        rows = (rank_unit // R_BLOCKS) * r_slice + local
        offs = k_block * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        s = _row_sum(x_row, offs, ok, delta_row, HAS_DELTA)
        weight = tl.load(weight_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        y = (s * scale * weight).to(out_ptr.dtype.element_ty).to(tl.float32)
        a_rows = a_ptr + slot * stride_as + rows[:, None].to(tl.int64) * stride_ar
        at = tl.load(a_rows + offs[None, :], mask=(local < rank)[:, None] & ok[None, :], other=0.0)
        acc = tl.sum(at.to(tl.float32) * y[None, :], axis=1)
        tl.atomic_add(h_ptr + t * stride_ht + rows, acc, mask=local < rank, sem="relaxed")


def _check_shrink(
    a_stack: torch.Tensor, ranks: torch.Tensor, token_slots: torch.Tensor, h: torch.Tensor, rows: int, k: int
) -> None:
    if a_stack.dim() != 3 or a_stack.shape[2] != k or a_stack.stride(2) != 1:
        raise ValueError(f"a_stack must be [S, L*R, {k}] with a contiguous last axis")
    if ranks.shape != (a_stack.shape[0],) or token_slots.shape != (rows,):
        raise ValueError("ranks must hold one rank per slot and token_slots one slot per row")
    if h.dtype != torch.float32 or h.shape != (rows, a_stack.shape[1]) or h.stride(1) != 1:
        raise ValueError("h must be fp32 [T, L*R] with a contiguous last axis")


def add_rms_norm_shrink(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    a_stack: torch.Tensor,
    ranks: torch.Tensor,
    token_slots: torch.Tensor,
    h: torch.Tensor,
    *,
    num_slices: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x + delta, rms_norm(x + delta) * weight)` for `[T, N]` rows, and each row's shrink added into `h`
    (module docstring); `delta` None norms `x` itself and returns it as the sum."""
    tokens, size = x.shape
    if (
        x.stride(1) != 1
        or weight.shape != (size,)
        or (delta is not None and (delta.shape != x.shape or delta.stride(1) != 1))
    ):
        raise ValueError("x and delta must be [T, N] with a contiguous last axis, weight [N]")
    _check_shrink(a_stack, ranks, token_slots, h, tokens, size)
    r_slice = a_stack.shape[1] // num_slices
    if r_slice * num_slices != a_stack.shape[1]:
        raise ValueError(f"the stack's rank axis must hold {num_slices} slices of equal size")
    total = x if delta is None else torch.empty_like(x)
    out = torch.empty_like(x)
    if tokens:
        r_blocks = triton.cdiv(r_slice, _RANK_ROWS)
        block = min(_NORM_BLOCK, triton.next_power_of_2(size))
        k_splits = triton.cdiv(size, block)
        _add_rms_norm_shrink_kernel[(tokens, 1 + num_slices * r_blocks * k_splits)](
            x,
            x if delta is None else delta,
            weight,
            total,
            out,
            a_stack,
            ranks,
            token_slots,
            h,
            x.stride(0),
            x.stride(0) if delta is None else delta.stride(0),
            a_stack.stride(0),
            a_stack.stride(1),
            h.stride(0),
            r_slice,
            eps,
            N=size,
            R_BLOCKS=r_blocks,
            K_SPLITS=k_splits,
            BLOCK=block,
            HAS_DELTA=delta is not None,
            num_warps=4,
        )
    return total, out


@triton.jit
def _silu_and_mul_shrink_kernel(
    gate_up_ptr: tl.tensor,
    out_ptr: tl.tensor,
    a_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    h_ptr: tl.tensor,
    stride_in: tl.tensor,
    stride_as: tl.tensor,
    stride_ar: tl.tensor,
    stride_ht: tl.tensor,
    I: tl.constexpr,  # noqa: E741 (the intermediate size, as in the module docstring)
    R_BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    slot = tl.load(slots_ptr + t).to(tl.int64)  # in flight beside the row's loads
    gate = tl.load(gate_up_ptr + t * stride_in + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride_in + I + offs, mask=ok, other=0.0).to(tl.float32)
    out = (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * I + offs, out, mask=ok)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot)
        for rb in range(R_BLOCKS):  # a constant trip count (the interpreter needs one); blocks past the rank skip
            if rb * RANK_BLOCK < rank:
                local = rb * RANK_BLOCK + tl.arange(0, RANK_BLOCK)
                a_rows = a_ptr + slot * stride_as + local[:, None].to(tl.int64) * stride_ar
                at = tl.load(a_rows + offs[None, :], mask=(local < rank)[:, None] & ok[None, :], other=0.0)
                part = tl.sum(at.to(tl.float32) * out.to(tl.float32)[None, :], axis=1)
                tl.atomic_add(h_ptr + t * stride_ht + local, part, mask=local < rank, sem="relaxed")


def silu_and_mul_shrink(
    gate_up: torch.Tensor, a_stack: torch.Tensor, ranks: torch.Tensor, token_slots: torch.Tensor, h: torch.Tensor
) -> torch.Tensor:
    """`silu(gate_up[:, :I]) * gate_up[:, I:]` for `[T, 2I]` rows, and each row's shrink (one slice) added into
    `h` (module docstring)."""
    tokens, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError("gate_up must be [T, 2I] with a contiguous last axis")
    inter = width // 2
    _check_shrink(a_stack, ranks, token_slots, h, tokens, inter)
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        _silu_and_mul_shrink_kernel[(tokens, triton.cdiv(inter, _SILU_BLOCK))](
            gate_up,
            out,
            a_stack,
            ranks,
            token_slots,
            h,
            gate_up.stride(0),
            a_stack.stride(0),
            a_stack.stride(1),
            h.stride(0),
            I=inter,
            R_BLOCKS=triton.cdiv(a_stack.shape[1], _RANK_ROWS),
            BLOCK=_SILU_BLOCK,
            num_warps=8,
        )
    return out
