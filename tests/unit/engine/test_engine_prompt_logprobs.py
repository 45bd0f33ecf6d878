"""Prompt log-probabilities (vLLM's `prompt_logprobs`) through the whole engine step loop on a tiny random model,
sync and async steps: each prompt token's entry against log_softmax of the model's logits over the whole prompt
at once, whether the prompt is prefilled in one step or in chunks, beside other requests or after the same
prompt (which the prefix cache would otherwise serve)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.engine import LLMEngine
from engine.errors import EngineError
from engine.logprobs import PromptLogprob
from engine.model import SeqSlice
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput, Sequence
from engine.uploads import upload
from tests.support.random_model import write_tiny_llama
from tests.unit.engine.test_engine_logprobs import tiny_engine

PROMPT = [5, 17, 33, 2, 90, 41, 7, 7, 64, 3, 110, 21, 9, 58, 77, 12, 40]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("prompt-logprobs-model"))


@pytest.fixture(params=["off", "on"], ids=["sync-steps", "async-steps"])
def steps(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def engine(model: Path, steps: str) -> Iterator[LLMEngine]:
    eng = tiny_engine(model, steps, max_num_seqs=6)
    yield eng
    eng.stop()


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params, None, outputs[rid].append)
    engine.run_until_idle()
    return outputs


def reference(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of `prompt`, prefilled whole in one forward pass (in
    the KV cache's scratch row): row q is the distribution of token q + 1."""
    n, kv = len(prompt), engine.kv
    ids, positions = upload(prompt, torch.long, engine.device), torch.arange(n, device=engine.device)
    logits = engine.model(ids, positions, [SeqSlice(kv.scratch_slot, 0, n, n)], kv, None, list(range(n)))
    return torch.log_softmax(logits[1:].float(), dim=-1)


def check_prompt_logprobs(engine: LLMEngine, prompt: list[int], got: tuple[PromptLogprob, ...], k: int) -> None:
    want = reference(engine, prompt)
    assert len(got) == len(prompt) - 1
    for q, entry in enumerate(got):
        row, token = want[q], prompt[q + 1]
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry.rank == int((row >= row[token]).sum())
        best = row.topk(k) if k else None
        assert [i for i, _ in entry.top] == ([] if best is None else best.indices.tolist())
        assert [v for _, v in entry.top] == pytest.approx([] if best is None else best.values.tolist(), abs=1e-4)


def first_with_prompt_logprobs(outputs: list[RequestOutput]) -> tuple[PromptLogprob, ...]:
    """The prompt log-probabilities, checked to come once, with the first output."""
    assert outputs[0].prompt_logprobs is not None
    assert all(o.prompt_logprobs is None for o in outputs[1:])
    return outputs[0].prompt_logprobs


@pytest.mark.parametrize("k", [0, 3, 20])
def test_prompt_logprobs_match_the_models_whole_prompt_logits(engine: LLMEngine, k: int) -> None:
    outputs = run(engine, {"a": (PROMPT, SamplingParams(max_tokens=4, prompt_logprobs=k))})
    check_prompt_logprobs(engine, PROMPT, first_with_prompt_logprobs(outputs["a"]), k)
    assert outputs["a"][-1].completion_tokens == 4


def test_a_prompt_prefilled_in_chunks_gets_the_same_prompt_logprobs(model: Path, steps: str) -> None:
    whole = tiny_engine(model, steps)
    chunked = tiny_engine(model, steps, max_num_batched_tokens=5)  # 17 tokens: four chunks
    try:
        params = SamplingParams(max_tokens=3, prompt_logprobs=2)
        a = run(whole, {"a": (PROMPT, params)})["a"]
        forward, chunks = chunked.forward.logits, []

        def counted(*args: Any, **kwargs: Any) -> tuple[list[Sequence], torch.Tensor]:
            out = forward(*args, **kwargs)
            chunks.append(sum(len(r.targets) for r in chunked.forward.prompt_rows))
            return out

        chunked.forward.logits = counted  # type: ignore[method-assign]
        b = run(chunked, {"b": (PROMPT, params)})["b"]
        # 17 tokens in chunks of 5: each chunk's positions predict the next prompt tokens but the last position.
        assert chunks[:5] == [5, 5, 5, 1, 0]
        check_prompt_logprobs(chunked, PROMPT, first_with_prompt_logprobs(b), 2)
        for x, y in zip(first_with_prompt_logprobs(a), first_with_prompt_logprobs(b), strict=True):
            assert (x.rank, [i for i, _ in x.top]) == (y.rank, [i for i, _ in y.top])
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [t for o in a for t in o.token_ids] == [t for o in b for t in o.token_ids]
    finally:
        whole.stop()
        chunked.stop()


def test_a_request_with_prompt_logprobs_leaves_its_neighbours_tokens_alone(engine: LLMEngine) -> None:
    others = {
        "x": ([9, 8, 7, 6, 5], SamplingParams(max_tokens=8)),
        "y": ([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.9, seed=11)),
    }
    alone = run(engine, others)
    beside = run(
        engine, {**{f"{r}2": v for r, v in others.items()}, "p": (PROMPT, SamplingParams(8, prompt_logprobs=1))}
    )
    for rid in others:
        assert [t for o in beside[f"{rid}2"] for t in o.token_ids] == [t for o in alone[rid] for t in o.token_ids]
        assert all(o.prompt_logprobs is None for o in beside[f"{rid}2"])
    check_prompt_logprobs(engine, PROMPT, first_with_prompt_logprobs(beside["p"]), 1)


def test_a_repeated_prompt_skips_the_prefix_cache_and_gets_every_prompt_logprob(engine: LLMEngine) -> None:
    run(engine, {"warm": (PROMPT, SamplingParams(max_tokens=2))})
    plain = run(engine, {"plain": (PROMPT, SamplingParams(max_tokens=2))})["plain"]
    assert plain[-1].cached_tokens > 0  # the prefix cache holds the prompt
    again = run(engine, {"again": (PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=4))})["again"]
    assert again[-1].cached_tokens == 0
    check_prompt_logprobs(engine, PROMPT, first_with_prompt_logprobs(again), 4)


def test_max_tokens_0_gives_the_prompt_logprobs_alone(engine: LLMEngine) -> None:
    outputs = run(engine, {"echo": (PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=2))})["echo"]
    assert len(outputs) == 1
    out = outputs[0]
    assert (out.finish_reason, out.token_ids, out.text, out.completion_tokens) == ("length", (), "", 0)
    assert out.prompt_tokens == len(PROMPT)
    check_prompt_logprobs(engine, PROMPT, first_with_prompt_logprobs(outputs), 2)


def test_a_one_token_prompt_has_no_prompt_logprobs(engine: LLMEngine) -> None:
    outputs = run(engine, {"one": ([42], SamplingParams(max_tokens=2, prompt_logprobs=3))})["one"]
    assert first_with_prompt_logprobs(outputs) == ()


def test_max_tokens_0_needs_prompt_logprobs(engine: LLMEngine) -> None:
    with pytest.raises(EngineError, match="max_tokens"):
        engine.add_request("z", PROMPT, SamplingParams(max_tokens=0), None, lambda _: None)
    with pytest.raises(EngineError, match="prompt_logprobs"):
        engine.add_request("z", PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=21), None, lambda _: None)
