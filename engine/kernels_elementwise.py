"""Fused elementwise steps of a decoder layer in triton: a residual add with the RMS norm after it, and the MLP's
SiLU gate times its up projection.

Why: a decode step of a small model is bound by kernel launches (bench/RESULTS-gpu.md): torch runs the add and
the norm as two kernels, SiLU and the product as two more. Here each pair is one.

Semantics (pseudo-code), rows t, hidden size N, intermediate size I, fp32 inside:

    add_rms_norm(x, delta, weight, eps) -> (s, y):
        s[t] = round(x[t] + delta[t])                       (to x's dtype, as torch's add would)
        y[t] = round(s[t] / sqrt(mean(s[t] ** 2) + eps) * weight)

    silu_and_mul(gate_up) -> out:                           (gate_up [T, 2I]: the gate, then the up projection)
        out[t, j] = round(silu(gate_up[t, j]) * gate_up[t, I + j])
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SILU_BLOCK = 1024  # intermediate columns per program


@triton.jit
def _add_rms_norm_kernel(
    x_ptr: tl.tensor,
    delta_ptr: tl.tensor,
    weight_ptr: tl.tensor,
    sum_ptr: tl.tensor,
    out_ptr: tl.tensor,
    stride_x: tl.tensor,
    stride_delta: tl.tensor,
    eps: tl.tensor,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    # One program per row: the whole row is one block (hidden sizes up to a few thousand).
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + t * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    delta = tl.load(delta_ptr + t * stride_delta + offs, mask=ok, other=0.0).to(tl.float32)
    s = (x + delta).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + t * N + offs, s, mask=ok)
    s32 = s.to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(s32 * s32, axis=0) / N + eps)
    weight = tl.load(weight_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * N + offs, (s32 * scale * weight).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x + delta, rms_norm(x + delta) * weight)` for `[T, N]` rows with a contiguous last axis."""
    tokens, size = x.shape
    if delta.shape != x.shape or weight.shape != (size,) or x.stride(1) != 1 or delta.stride(1) != 1:
        raise ValueError("x and delta must be [T, N] with a contiguous last axis, weight [N]")
    total, out = torch.empty_like(x), torch.empty_like(x)
    if tokens:
        block = triton.next_power_of_2(size)
        _add_rms_norm_kernel[(tokens,)](
            x,
            delta,
            weight,
            total,
            out,
            x.stride(0),
            delta.stride(0),
            eps,
            N=size,
            BLOCK=block,
            num_warps=max(1, min(16, block // 512)),
        )
    return total, out


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr: tl.tensor,
    out_ptr: tl.tensor,
    stride_in: tl.tensor,
    I: tl.constexpr,  # noqa: E741 (the intermediate size, as in the module docstring)
    BLOCK: tl.constexpr,
) -> None:
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    gate = tl.load(gate_up_ptr + t * stride_in + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride_in + I + offs, mask=ok, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * I + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate_up[:, :I]) * gate_up[:, I:]` for `[T, 2I]` rows with a contiguous last axis."""
    tokens, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError("gate_up must be [T, 2I] with a contiguous last axis")
    inter = width // 2
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        _silu_and_mul_kernel[(tokens, triton.cdiv(inter, _SILU_BLOCK))](
            gate_up, out, gate_up.stride(0), I=inter, BLOCK=_SILU_BLOCK, num_warps=4
        )
    return out
