"""The start-up warm-up (`engine/warm_up.py`) on a tiny random model on the CPU: it runs joins beside a step in
flight, sampled rows and log-probabilities, and leaves nothing behind that a request or the stats could see.

Whether it removes the first joins' stall of a fresh process is a GPU figure (`bench/RESULTS-gpu.md`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput
from engine.warm_up import warm_up
from tests.support.random_model import write_tiny_llama
from tests.unit.engine.test_engine_logprobs import tiny_engine

PROMPT = [5, 17, 33, 2, 90, 41, 7]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("warm-up-model"))


@pytest.fixture(params=["off", "on"], ids=["sync-steps", "async-steps"])
def engine(request: pytest.FixtureRequest, model: Path) -> Iterator[LLMEngine]:
    eng = tiny_engine(model, request.param, max_num_seqs=4, prefix_caching="on")
    yield eng
    eng.stop()


def test_the_warm_up_joins_requests_beside_running_ones_and_samples(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps: list[tuple[int, bool, list[Any]]] = []  # (prefill rows, a step in flight, sampling params of the rows)
    logits = engine.forward.logits

    def recorded(running: list[Any], prefills: dict[Any, int], previous: Any, trace: Any = None) -> Any:
        order, out = logits(running, prefills, previous, trace)
        steps.append((len(prefills), previous is not None, [s.params for s in order]))
        return order, out

    monkeypatch.setattr(engine.forward, "logits", recorded)

    taken = warm_up(engine)

    assert taken == len(steps) > 2
    joins = [s for s in steps[1:] if s[0] > 0]  # prefills after the first step: requests joining running ones
    assert joins and all(len(s[2]) > s[0] for s in joins)  # each beside decoding rows
    if engine.async_steps:
        assert any(in_flight for _, in_flight, _ in joins)
    params = [p for _, _, rows in steps for p in rows]
    assert any(p.temperature > 0 and p.seed is not None for p in params)
    assert any(p.logprobs for p in params)


def test_the_warm_up_leaves_no_trace(engine: LLMEngine) -> None:
    assert warm_up(engine) > 0

    stats = engine.stats()
    assert (stats.steps, stats.tokens_generated, stats.running, stats.waiting, stats.kv_slots_used) == (0, 0, 0, 0, 0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    assert engine.prefix_cache.enabled and engine.prefix_cache.cached_rows() == 0
    assert not engine._live and engine._inflight is None


def _tokens(engine: LLMEngine, params: SamplingParams) -> list[int]:
    outputs: list[RequestOutput] = []
    engine.add_request("r", PROMPT, params, None, outputs.append)
    engine.run_until_idle()
    assert outputs[-1].finish_reason == "length"
    return [t for o in outputs for t in o.token_ids]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=1.2, seed=11)],
    ids=["greedy", "seeded"],
)
def test_requests_after_the_warm_up_get_the_tokens_of_an_engine_without_it(
    engine: LLMEngine, model: Path, params: SamplingParams
) -> None:
    cold = tiny_engine(model, engine.config.async_steps, max_num_seqs=4, prefix_caching="on")
    try:
        warm_up(engine)
        torch.manual_seed(0)
        warmed = _tokens(engine, params)
        torch.manual_seed(0)
        assert warmed == _tokens(cold, params)
    finally:
        cold.stop()


def test_no_warm_up_where_the_context_is_too_short_for_it(model: Path) -> None:
    short = LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_model_len=6, async_steps="on"))
    try:
        assert warm_up(short) == 0
        assert short.stats().steps == 0
    finally:
        short.stop()


def test_an_engine_set_to_warm_up_does_so_when_it_is_built(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[int] = []
    monkeypatch.setattr("engine.engine.warm_up", lambda engine: ran.append(warm_up(engine)) or ran[-1])
    for setting, runs in (("on", 1), ("off", 0), ("auto", 0)):  # auto: on where decode graphs are captured
        ran.clear()
        eng = tiny_engine(model, "on", warm_up=setting)
        try:
            assert len(ran) == runs and all(steps > 0 for steps in ran)
            assert eng.stats().steps == 0
        finally:
            eng.stop()


def test_a_warm_up_never_keeps_an_engine_from_starting(model: Path) -> None:
    """Requests beyond `max_waiting` are left out of the warm-up, not raised."""
    small = tiny_engine(model, "on", max_num_seqs=1, max_waiting=1, warm_up="on")
    try:
        assert small.stats().steps == 0 and small.stats().kv_slots_used == 0
        outputs: list[RequestOutput] = []
        small.add_request("r", PROMPT, SamplingParams(max_tokens=3), None, outputs.append)
        small.run_until_idle()
        assert outputs[-1].finish_reason == "length"
    finally:
        small.stop()
