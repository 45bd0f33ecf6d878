"""The pure helpers behind the benchmarks' printed figures: percentiles, warm-up accounting, bandwidth bounds."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import torch

from bench import engine_gpu, engine_gpu_e2e, fairness
from bench.gateway_rest import Run, percentile


def test_percentile_is_nearest_rank() -> None:
    """int(q * n) read one rank high: the p99 of 100 samples was their maximum, the p50 of two the larger."""
    hundred = [float(i) for i in range(1, 101)]
    assert percentile(hundred, 0.99) == 99.0
    assert percentile(hundred, 0.5) == 50.0
    assert percentile(hundred, 0.07) == 7.0  # 0.07 * 100 is 7.000000000000001 in floating point
    assert percentile([2.0, 1.0], 0.5) == 1.0
    assert percentile([5.0], 0.99) == 5.0
    assert percentile(hundred, 1.0) == 100.0


def test_run_reports_nearest_rank_percentiles() -> None:
    run = Run("x", latencies=[float(i) for i in range(100, 0, -1)])
    assert (run.pct(0.5), run.pct(0.9), run.pct(0.99)) == (50.0, 90.0, 99.0)
    assert math.isnan(run.pct(0.5, []))


def test_e2e_p99_stays_within_the_samples() -> None:
    """statistics.quantiles' default method put the p99 of 1..10 at 10.89, past every sample."""
    assert engine_gpu_e2e.p99([float(i) for i in range(1, 11)]) <= 10.0
    assert engine_gpu_e2e.p99([3.0, 3.0, 3.0]) == 3.0
    many = [float(i) for i in range(1, 1001)]
    assert 989.0 <= engine_gpu_e2e.p99(many) <= 991.0


def test_fairness_counts_waits_after_the_warm_up_only() -> None:
    """Served tokens skipped the warm-up windows, the light tenant's waits did not."""
    cfg = fairness.SimConfig(seconds=10.0, warmup_s=10.0)
    result = fairness.simulate(lambda _clock: fairness.FifoQueue(cfg.total_depth, None), cfg, seed=1)
    assert result.waits == {"heavy": [], "light": []}
    longer = fairness.simulate(
        lambda _clock: fairness.FifoQueue(cfg.total_depth, None), fairness.SimConfig(seconds=20.0), seed=1
    )
    assert longer.waits["light"]


def test_llama_7b_bandwidth_bound_at_kv_512() -> None:
    """Goal (b)'s bound for 64 distinct rank-16 adapters on all seven projections: about 0.85x."""
    h, i, rank = 4096, 11008, 16
    one = 2 * rank * (6 * h + i + 4 * h + 2 * i + h)  # A of q/k/v/o/gate/up [r, h], down [r, i]; B the outputs
    assert engine_gpu.adapter_bytes(rank) == one == 2_498_560

    def meta(*shape: int) -> torch.Tensor:  # sizes without memory: DecodeLayer's own tensors need a GPU
        return torch.empty(*shape, device="meta", dtype=torch.bfloat16)

    layer = SimpleNamespace(
        w={"qkv": meta(3 * h, h), "o": meta(h, h), "gate_up": meta(2 * i, h), "down": meta(h, i)},
        k_cache=meta(engine_gpu.BATCH, engine_gpu.HEADS, engine_gpu.KV_LEN, engine_gpu.HEAD_DIM),
    )
    base = engine_gpu.DecodeLayer.base_bytes(layer)  # type: ignore[arg-type]
    weights, kv = 2 * (4 * h * h + 3 * h * i), 2 * 2 * 64 * 512 * h
    assert weights + kv < base < 1.05 * (weights + kv)  # plus the step's activations
    bound = engine_gpu.bandwidth_bound(base, 64 * one)
    assert 0.85 < bound < 0.87
    assert engine_gpu.bandwidth_bound(base, one) > 0.997


def test_random_model_saves_the_asked_dtype_and_llama_7b_has_the_goals_dims(tmp_path: Path) -> None:
    """Goal figures are at Llama-7B's dimensions; a 7B model is written as bfloat16 (27 GB in float32)."""
    from safetensors import safe_open

    from tests.support.random_model import SHAPES, write_random_llama

    seven = SHAPES["llama-7b"]
    assert (seven["hidden"], seven["inter"], seven["hidden"] // seven["heads"], seven["kv_heads"]) == (
        4096,
        11008,
        128,
        32,
    )
    words = tmp_path / "tok"
    words.mkdir()
    (words / "tokenizer.json").write_text("{}")
    folder = write_random_llama(
        tmp_path / "m", words, 1, hidden=8, inter=16, heads=2, kv_heads=1, vocab=4, dtype=torch.bfloat16
    )
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
