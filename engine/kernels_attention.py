"""Decode-step attention in triton: rotary embedding fused with the KV-cache write, and attention that reads
every sequence's keys in place in the slot cache, split over key blocks ("flash decoding").

Why: a decode step of a small model is bound by kernel launches, not bytes. The torch path spends per layer
eight elementwise kernels on rotary, two index writes into the cache, two gathers that copy every sequence's
keys and values up to the step's KV-length bucket, and SDPA behind a mask: on an H200, SmolLM2 with 16 rows
ran 26 kernels a layer, a third of them these (bench/RESULTS-gpu.md). Here they are three kernels, two when
one split covers the keys, and no copy of the cache grows with the context.

Semantics (pseudo-code); rows t of the step, query heads h < H, KV heads j < KVH, G = H / KVH query heads
per KV head (grouped-query attention: head h reads KV head h // G), head size D:

    rope(x, c, s) = x * c + cat(-x[D/2:], x[:D/2]) * s                    (fp32 inside, the rotate-half form)

    rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, positions) -> q [T, H, D]:
        qkv[t] holds H query heads, then KVH key heads, then KVH value heads, each D wide
        (a prompt's rows share one slot: slots[t] = slots[0])
        q[t, h]                                  = rope(qkv[t, query head h], cos[t], sin[t])
        k_cache[slots[t], j, positions[t], :]    = rope(qkv[t, key head j], cos[t], sin[t])
        v_cache[slots[t], j, positions[t], :]    = qkv[t, value head j]

    decode_attention(q, k_cache, v_cache, slots, positions, max_len) -> out [T, H, D]:
        n = positions[t] + 1                     (keys 0..positions[t]; needs positions[t] < max_len)
        K = k_cache[slots[t], h // G, :n]; V = v_cache[slots[t], h // G, :n]
        out[t, h] = softmax(q[t, h] @ K^T / sqrt(D)) @ V

The key positions [0, max_len) are cut into `splits` ranges; one program per (row, KV head, range) keeps a
running max and sum (online softmax) over its blocks of keys for the G query heads at once, and a second
kernel merges the ranges by their log-sum-exp. A program stops at its row's own length, so a short
sequence in a long bucket reads only its own keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels_triton import _dot_precision, _sm_count, _static_loops, _upcast_dots

BLOCK_L = 64  # key positions per block: a [D, 64] tile of keys per dot
MAX_SPLITS = 32  # key ranges per (row, KV head); their partial results cost 4 * (D + 1) bytes each
_PROGRAMS_PER_SM = 2  # splits are added until (row, KV head, split) programs fill the GPU this many times


@triton.jit
def _rope_cache_kernel(
    qkv_ptr: tl.tensor,
    cos_ptr: tl.tensor,
    sin_ptr: tl.tensor,
    q_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    positions_ptr: tl.tensor,
    kv_out_ptr: tl.tensor,
    stride_qkv: tl.tensor,
    stride_cos: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_cs: tl.tensor,
    stride_ch: tl.tensor,
    stride_cl: tl.tensor,
    stride_slot: tl.tensor,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    KV_OUT: tl.constexpr,
) -> None:
    # One program per (row, head of qkv): query heads are rotated into q, key heads rotated into the cache,
    # value heads copied into it (and both into kv_out [T, 2 KVH, D] with KV_OUT).
    t = tl.program_id(0)
    head = tl.program_id(1)
    half = tl.arange(0, BLOCK_HALF)
    ok = half < D // 2
    src = qkv_ptr + t * stride_qkv + head * D
    x1 = tl.load(src + half, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + D // 2 + half, mask=ok, other=0.0).to(tl.float32)
    if head < H + KVH:
        c1 = tl.load(cos_ptr + t * stride_cos + half, mask=ok, other=0.0)
        c2 = tl.load(cos_ptr + t * stride_cos + D // 2 + half, mask=ok, other=0.0)
        s1 = tl.load(sin_ptr + t * stride_cos + half, mask=ok, other=0.0)
        s2 = tl.load(sin_ptr + t * stride_cos + D // 2 + half, mask=ok, other=0.0)
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    else:
        o1 = x1
        o2 = x2
    if head < H:
        dst = q_ptr + t * stride_qt + head * stride_qh
    else:
        if KV_OUT:
            rows = kv_out_ptr + (t * 2 * KVH + head - H) * D
            tl.store(rows + half, o1.to(rows.dtype.element_ty), mask=ok)
            tl.store(rows + D // 2 + half, o2.to(rows.dtype.element_ty), mask=ok)
        slot = tl.load(slots_ptr + t * stride_slot).to(tl.int64)
        position = tl.load(positions_ptr + t).to(tl.int64)
        at = slot * stride_cs + position * stride_cl
        if head < H + KVH:
            dst = k_cache_ptr + at + (head - H) * stride_ch
        else:
            dst = v_cache_ptr + at + (head - H - KVH) * stride_ch
    tl.store(dst + half, o1.to(dst.dtype.element_ty), mask=ok)
    tl.store(dst + D // 2 + half, o2.to(dst.dtype.element_ty), mask=ok)


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("the key and value caches need one layout with a contiguous last axis")


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the step's queries and keys, write keys and values into the cache; returns q `[T, H, D]`.

    `qkv` `[T, (H + 2 KVH) D]` (last axis contiguous), `cos`/`sin` `[T, D]` (the rotate-half tables at each
    row's position), caches `[slots, KVH, max_len, D]` with a contiguous last axis, `slots` `[T]` or `[1]`
    (one sequence's rows: a prompt), `positions` `[T]`. With `kv_out` (contiguous `[T, 2 KVH, D]`) the rotated
    keys and the values are written there too, for attention over the rows themselves (a prefill).
    """
    tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError("qkv must be [T, (H + 2 KVH) * D] with a contiguous last axis")
    _check_caches(k_cache, v_cache)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError("cos and sin need one layout with a contiguous last axis")
    if slots.shape[0] not in (1, tokens) or positions.shape[0] != tokens:
        raise ValueError("slots must be [T] or [1] and positions [T]")
    if kv_out is not None and (kv_out.shape != (tokens, 2 * num_kv_heads, head_dim) or not kv_out.is_contiguous()):
        raise ValueError("kv_out must be a contiguous [T, 2 KVH, D]")
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    _rope_cache_kernel[(tokens, num_heads + 2 * num_kv_heads)](
        qkv,
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        slots,
        positions,
        q if kv_out is None else kv_out,
        qkv.stride(0),
        cos.stride(0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        slots.stride(0) if slots.shape[0] == tokens else 0,
        H=num_heads,
        KVH=num_kv_heads,
        D=head_dim,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        KV_OUT=kv_out is not None,
    )
    return q


@triton.jit
def _decode_attention_kernel(
    q_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    positions_ptr: tl.tensor,
    out_ptr: tl.tensor,
    parts_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    scale_log2: tl.tensor,
    split_len: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_cs: tl.tensor,
    stride_ch: tl.tensor,
    stride_cl: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    G: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    STATIC_LOOPS: tl.constexpr,
) -> None:
    # One program per (row, KV head, key range): its G query heads at once, rows of a [BLOCK_G, D] tile.
    t = tl.program_id(0)
    j = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    n_keys = tl.load(positions_ptr + t) + 1
    start = split * split_len
    stop = tl.minimum(start + split_len, n_keys)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < G
    d_ok = offs_d < D
    heads = j * G + offs_g
    q = tl.load(
        q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    row = slot * stride_cs + j * stride_ch
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    # Triton's interpreter cannot loop to a run-time bound under numpy >= 2.4: it runs the split's whole
    # block count, and blocks past the row's keys are masked off.
    for i in range(0, SPLIT_BLOCKS if STATIC_LOOPS else tl.cdiv(stop - start, BLOCK_L)):
        offs_l = start + i * BLOCK_L + tl.arange(0, BLOCK_L)
        l_ok = offs_l < stop
        keys = tl.load(
            k_cache_ptr + row + offs_l[None, :].to(tl.int64) * stride_cl + offs_d[:, None],
            mask=d_ok[:, None] & l_ok[None, :],
            other=0.0,
        )
        values = tl.load(
            v_cache_ptr + row + offs_l[:, None].to(tl.int64) * stride_cl + offs_d[None, :],
            mask=l_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            keys, values = keys.to(tl.float32), values.to(tl.float32)
        scores = tl.dot(q, keys, input_precision=PRECISION) * scale_log2
        scores = tl.where(l_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        # A block with no key left (only under STATIC_LOOPS) keeps m at -inf: shift by 0 there, not by -inf.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - shift[:, None])
        alpha = tl.exp2(m - shift)
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
        m = m_new
    has_keys = total > 0
    out = acc / tl.where(has_keys, total, 1.0)[:, None]
    tile_ok = g_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        dst = out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=tile_ok)
    else:
        # Partial results [T, H, SPLITS, D] and their log2-sum-exp [T, H, SPLITS], contiguous.
        at = (t * G * tl.num_programs(1) + heads) * SPLITS + split
        tl.store(parts_ptr + at[:, None] * D + offs_d[None, :], out, mask=tile_ok)
        lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, total, 1.0)), float("-inf"))
        tl.store(lse_ptr + at, lse, mask=g_ok)


@triton.jit
def _merge_splits_kernel(
    parts_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    out_ptr: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    H: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    # One program per (row, query head): the key ranges' results weighted by their share of the softmax sum.
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < SPLITS
    d_ok = offs_d < D
    at = (t * H + h) * SPLITS + offs_s
    lse = tl.load(lse_ptr + at, mask=s_ok, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 always holds key 0: the max is finite
    parts = tl.load(parts_ptr + at[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(weights[:, None] * parts, axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def split_count(rows: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Key ranges per (row, KV head): enough programs to fill the GPU `_PROGRAMS_PER_SM` times, at most one
    range per block of keys and `MAX_SPLITS`."""
    sms = _sm_count(device) if device.type == "cuda" else 132
    wanted = triton.cdiv(_PROGRAMS_PER_SM * sms, max(rows * kv_heads, 1))
    return max(1, min(wanted, triton.cdiv(max_len, BLOCK_L), MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    max_len: int,
    splits: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per row over its slot's keys 0..positions[t]; returns `[T, H, D]`.

    `q` `[T, H, D]` (as `rope_and_cache` returns it), caches `[slots, KVH, L, D]` with a contiguous last
    axis, `slots`/`positions` `[T]` on the device. Every position must be below `max_len` (a host-side bound,
    e.g. the step's KV-length bucket, fixed under CUDA-graph capture): ranges cover [0, max_len) only.
    `splits` overrides `split_count`.
    """
    tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if num_heads % kv_heads or k_cache.shape[-1] != head_dim or q.stride(-1) != 1:
        raise ValueError("q must be [T, H, D] with H a multiple of the caches' KV heads and D their head size")
    _check_caches(k_cache, v_cache)
    if not 0 < max_len <= k_cache.shape[2]:
        raise ValueError(f"max_len must be within 1..{k_cache.shape[2]}, got {max_len}")
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    group = num_heads // kv_heads
    blocks = triton.cdiv(max_len, BLOCK_L)
    wanted = splits if splits is not None else split_count(tokens, kv_heads, max_len, q.device)
    split_blocks = triton.cdiv(blocks, max(1, min(wanted, blocks)))
    num_splits = triton.cdiv(blocks, split_blocks)
    parts = lse = out  # unused by a single range
    if num_splits > 1:
        parts = torch.empty(tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_attention_kernel[(tokens, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        slots,
        positions,
        out,
        parts,
        lse,
        1.4426950408889634 / head_dim**0.5,  # log2(e) / sqrt(D): scores in log2 units for exp2
        split_blocks * BLOCK_L,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        G=group,
        D=head_dim,
        SPLITS=num_splits,
        SPLIT_BLOCKS=split_blocks if _static_loops() else 0,  # read by static loops only: no recompiles
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_L=BLOCK_L,
        PRECISION=_dot_precision(q.dtype),
        UPCAST=_upcast_dots(),
        STATIC_LOOPS=_static_loops(),
        num_warps=4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(tokens, num_heads)](
            parts,
            lse,
            out,
            out.stride(0),
            out.stride(1),
            H=num_heads,
            D=head_dim,
            SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out
