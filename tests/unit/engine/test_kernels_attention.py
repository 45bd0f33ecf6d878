"""Decode attention kernels (`engine.kernels_attention`) against the torch path, interpreted on the CPU.

The interpreted cases run in a child pytest with TRITON_INTERPRET=1 (`test_triton_interpreted`).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from engine.model import apply_rope, rope_tables
from tests.support.decode_step import assert_as_accurate_as_torch, compare_decode_step, compare_prefill
from tests.unit.engine.interpreted import INTERPRETED, run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]
SLOTS = [3, 0, 5, 2, 1]  # one cache row per step row, in no order; rows 4 and 6 of the cache stay unused
MAX_LEN = 150  # three key blocks of 64, the last one partial


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def caches(kv_heads: int, head_dim: int, dtype: torch.dtype, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (7, kv_heads, MAX_LEN, head_dim)
    return torch.full(shape, fill, dtype=dtype), torch.full(shape, fill, dtype=dtype)


@needs_triton
def test_split_count_fills_the_gpu_within_the_keys() -> None:
    from engine.kernels_attention import MAX_SPLITS, split_count

    cpu = torch.device("cpu")  # counts as 132 SMs
    assert split_count(16, 3, 4096, cpu) == 6  # 48 programs -> 6 ranges fill 264
    assert split_count(16, 3, 100, cpu) == 2  # no more ranges than blocks of keys
    assert split_count(64, 32, 4096, cpu) == 1  # 2048 programs already
    assert split_count(1, 1, 1 << 20, cpu) == MAX_SPLITS


@needs_triton
def test_shapes_are_checked_before_launch() -> None:
    from engine.kernels_attention import decode_attention, rope_and_cache

    k, v = caches(2, 16, torch.float32, 0.0)
    slots, positions = torch.tensor(SLOTS), torch.zeros(5, dtype=torch.int64)
    cos = sin = torch.ones(5, 16)
    with pytest.raises(ValueError, match="qkv"):
        rope_and_cache(torch.zeros(5, 100), cos, sin, k, v, slots, positions, 4, 2)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(torch.zeros(5, 3, 16), k, v, slots, positions, MAX_LEN)
    with pytest.raises(ValueError, match="max_len"):
        decode_attention(torch.zeros(5, 4, 16), k, v, slots, positions, MAX_LEN + 1)
    with pytest.raises(ValueError, match="layout"):
        decode_attention(torch.zeros(5, 4, 16), k, v.transpose(2, 3), slots, positions, MAX_LEN)


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="parent process only; needs triton")
def test_triton_interpreted() -> None:
    run_interpreted(f"{__file__}::TestInterpreted")


@pytest.mark.skipif(not INTERPRETED, reason="runs inside test_triton_interpreted's child process")
class TestInterpreted:
    """The kernels interpreted on the CPU, on shapes that hit the masks: grouped heads, a head size that is no
    power of two, a partial last key block, rows of one key and of every key."""

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("head_dim", [16, 24])
    def test_rope_and_cache_matches_the_torch_path(self, dtype: torch.dtype, head_dim: int) -> None:
        from engine.kernels_attention import rope_and_cache

        heads, kv_heads = 4, 2
        gen = torch.Generator().manual_seed(head_dim)
        qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
        positions = torch.tensor([0, 149, 64, 63, 7])
        cos_table, sin_table = rope_tables(head_dim, MAX_LEN, 10000.0)
        cos, sin = cos_table[positions], sin_table[positions]
        k_cache, v_cache = caches(kv_heads, head_dim, dtype, 0.0)
        slots = torch.tensor(SLOTS)

        q = rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, positions, heads, kv_heads)

        rows = qkv.view(5, heads + 2 * kv_heads, head_dim)
        qk = apply_rope(rows[:, : heads + kv_heads], cos, sin)
        want_k, want_v = caches(kv_heads, head_dim, dtype, 0.0)
        want_k[slots, :, positions] = qk[:, heads:]
        want_v[slots, :, positions] = rows[:, heads + kv_heads :]
        assert rel_err(q, qk[:, :heads]) < TOLERANCE[dtype]
        assert rel_err(k_cache, want_k) < TOLERANCE[dtype]
        assert torch.equal(v_cache, want_v)  # values are copied, and nothing else in the caches is written

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (3, 3, 24), (6, 1, 16)])
    @pytest.mark.parametrize("splits", [1, 2, None], ids=["one-range", "two-ranges", "default"])
    def test_decode_attention_matches_sdpa(
        self, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, splits: int | None
    ) -> None:
        from engine.kernels_attention import decode_attention

        gen = torch.Generator().manual_seed(heads * 100 + head_dim)
        positions = torch.tensor([0, 149, 64, 63, 100])
        # Positions past each row's keys hold NaN: a kernel that read them would return NaN.
        k_cache, v_cache = caches(kv_heads, head_dim, dtype, float("nan"))
        for slot, position in zip(SLOTS, positions.tolist(), strict=True):
            n = position + 1
            k_cache[slot, :, :n] = torch.randn(kv_heads, n, head_dim, generator=gen).to(dtype)
            v_cache[slot, :, :n] = torch.randn(kv_heads, n, head_dim, generator=gen).to(dtype)
        q = torch.randn(5, heads, head_dim, generator=gen).to(dtype)

        got = decode_attention(q, k_cache, v_cache, torch.tensor(SLOTS), positions, MAX_LEN, splits=splits)

        for t, (slot, position) in enumerate(zip(SLOTS, positions.tolist(), strict=True)):
            keys = k_cache[slot, :, : position + 1].float()
            values = v_cache[slot, :, : position + 1].float()
            want = F.scaled_dot_product_attention(q[t].float()[:, None], keys, values, enable_gqa=True)[:, 0]
            assert rel_err(got[t], want) < TOLERANCE[dtype], (t, position)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_model_decode_step_matches_the_torch_path(self, dtype: torch.dtype) -> None:
        """`DecoderModel.decode` with the kernels, SmolLM2's attention shape: as accurate as the torch path."""
        assert_as_accurate_as_torch(compare_decode_step("smollm2", 256, dtype, torch.device("cpu")), dtype)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_model_prefill_matches_the_torch_path(self, dtype: torch.dtype) -> None:
        """`DecoderModel.prefill` with the rotary kernel writing the prompt's keys (one slot for all rows)."""
        assert_as_accurate_as_torch(compare_prefill("smollm2", 20, dtype, torch.device("cpu")), dtype)

    def test_rope_and_cache_writes_a_prompt_and_returns_its_rows(self) -> None:
        from engine.kernels_attention import rope_and_cache

        heads, kv_heads, head_dim, tokens = 4, 2, 16, 6
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(3))
        positions = torch.arange(tokens)
        cos_table, sin_table = rope_tables(head_dim, MAX_LEN, 10000.0)
        cos, sin = cos_table[positions], sin_table[positions]
        k_cache, v_cache = caches(kv_heads, head_dim, torch.float32, 0.0)
        rows = torch.empty(tokens, 2 * kv_heads, head_dim)

        q = rope_and_cache(qkv, cos, sin, k_cache, v_cache, torch.tensor([2]), positions, heads, kv_heads, rows)

        split = qkv.view(tokens, heads + 2 * kv_heads, head_dim)
        qk = apply_rope(split[:, : heads + kv_heads], cos, sin)
        assert rel_err(q, qk[:, :heads]) < 1e-6
        assert rel_err(rows[:, :kv_heads], qk[:, heads:]) < 1e-6
        assert torch.equal(rows[:, kv_heads:], split[:, heads + kv_heads :])
        assert torch.equal(k_cache[2, :, :tokens], rows[:, :kv_heads].transpose(0, 1))
        assert torch.equal(v_cache[2, :, :tokens], rows[:, kv_heads:].transpose(0, 1))
        assert not k_cache[[0, 1, 3, 4, 5, 6]].any() and not k_cache[2, :, tokens:].any()
