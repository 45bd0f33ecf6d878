"""Log-probabilities through the whole engine step loop on a tiny random model, sync and async steps: each
output token's entry against log_softmax of the very logits row it was sampled from."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.logprobs import TokenLogprobs
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput, Sequence
from tests.support.random_model import write_tiny_llama

PROMPT = [5, 17, 33, 2, 90, 41, 7]
REQUESTS = {
    "greedy": SamplingParams(max_tokens=12, logprobs=5),
    "seeded": SamplingParams(max_tokens=10, temperature=1.3, top_k=20, seed=7, logprobs=2),
    "none": SamplingParams(max_tokens=10),
    "zero": SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=0),
}
Request = tuple[list[int], str | None, SamplingParams]  # prompt, adapter, params


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("logprobs-model"))


def tiny_engine(model: Path, async_steps: str, max_num_seqs: int = 8, **settings: Any) -> LLMEngine:
    """An engine on the tiny model, on the CPU in float32, stepping synchronously or not (`async_steps`); other
    `EngineConfig` settings as given."""
    config = EngineConfig(
        model=str(model),
        device="cpu",
        dtype="float32",
        max_num_seqs=max_num_seqs,
        max_model_len=64,
        async_steps=async_steps,
        **settings,
    )
    return LLMEngine(config)


@pytest.fixture(params=["off", "on"], ids=["sync-steps", "async-steps"])
def engine(request: pytest.FixtureRequest, model: Path) -> Iterator[LLMEngine]:
    eng = tiny_engine(model, request.param, max_num_seqs=6)
    yield eng
    eng.stop()


def run_recorded(
    engine: LLMEngine, requests: dict[str, Request]
) -> tuple[dict[str, list[RequestOutput]], dict[str, list[torch.Tensor]]]:
    """Every request's outputs, and the logits rows each was given, in step order (tests/gpu runs it too)."""
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    rows: dict[str, list[torch.Tensor]] = defaultdict(list)
    forward = engine.forward.logits

    def recorded(*args: Any, **kwargs: Any) -> tuple[list[Sequence], torch.Tensor]:
        order, logits = forward(*args, **kwargs)
        for seq, row in zip(order, logits, strict=True):
            rows[seq.request_id].append(row.clone())
        return order, logits

    engine.forward.logits = recorded  # type: ignore[method-assign]
    for rid, (prompt, adapter, params) in requests.items():
        engine.add_request(rid, prompt, params, adapter, outputs[rid].append)
    engine.run_until_idle()
    engine.forward.logits = forward  # type: ignore[method-assign]
    return outputs, rows


def check_logprobs(outputs: list[RequestOutput], rows: list[torch.Tensor], wanted: int | None) -> list[TokenLogprobs]:
    """The request's log-probabilities, checked against its rows: the k-th token was sampled from the k-th."""
    tokens = [t for o in outputs for t in o.token_ids]
    entries = [e for o in outputs for e in o.logprobs]
    # One entry per token of each output when asked; async steps give an ended request one dropped row more.
    expected = [len(o.token_ids) if wanted is not None else 0 for o in outputs]
    assert [len(o.logprobs) for o in outputs] == expected and len(rows) >= len(tokens)
    for token, entry, row in zip(tokens, entries, rows, strict=False):
        reference = torch.log_softmax(row.float(), dim=-1)
        assert entry.logprob == pytest.approx(float(reference[token]), abs=1e-5)
        best = reference.topk(wanted or 1)
        assert [i for i, _ in entry.top] == (best.indices.tolist() if wanted else [])
        assert [v for _, v in entry.top] == pytest.approx(best.values.tolist() if wanted else [], abs=1e-5)
    return entries


def test_each_token_carries_the_logprobs_of_the_row_it_was_sampled_from(engine: LLMEngine) -> None:
    outputs, rows = run_recorded(engine, {rid: (PROMPT, None, params) for rid, params in REQUESTS.items()})
    for rid, params in REQUESTS.items():
        entries = check_logprobs(outputs[rid], rows[rid], params.logprobs)
        assert len(entries) == (outputs[rid][-1].completion_tokens if params.logprobs is not None else 0)
    greedy = [t for o in outputs["greedy"] for t in o.token_ids]
    assert [e.top[0][0] for o in outputs["greedy"] for e in o.logprobs] == greedy


def test_the_token_that_completes_a_stop_string_keeps_its_logprobs(engine: LLMEngine) -> None:
    probe, _ = run_recorded(engine, {"probe": (PROMPT, None, SamplingParams(max_tokens=8, logprobs=1))})
    text = "".join(o.text for o in probe["probe"])
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    stopping = SamplingParams(max_tokens=8, logprobs=1, stop=(stop,))
    outputs, rows = run_recorded(engine, {"stop": (PROMPT, None, stopping)})
    last = outputs["stop"][-1]
    assert last.finish_reason == "stop" and last.token_ids and last.logprobs
    entries = check_logprobs(outputs["stop"], rows["stop"], 1)
    assert len(entries) == last.completion_tokens < 8
