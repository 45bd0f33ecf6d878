"""Penalties, logit_bias, min_p and min_tokens through the whole engine step loop on a tiny random model: sync
and async steps give the same tokens, each greedy token is the argmax of the reference processing of the raw
row it came from (so a token still in flight was counted), and log-probabilities stay those of the raw rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.logits_processing import reference_process
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput
from tests.support.random_model import write_tiny_llama
from tests.unit.engine.test_engine_logprobs import PROMPT, Request, check_logprobs, run_recorded, tiny_engine

EOS = 1  # the tiny tokenizer's </s>
REQUESTS = {
    "plain": SamplingParams(max_tokens=20),
    "frequency": SamplingParams(max_tokens=20, frequency_penalty=2.0, presence_penalty=0.5, logprobs=2),
    "presence": SamplingParams(max_tokens=20, presence_penalty=-2.0, logprobs=0),
    "repetition": SamplingParams(max_tokens=16, repetition_penalty=1.6),
    "bias": SamplingParams(max_tokens=10, logit_bias=((90, -100.0), (85, -100.0), (61, 3.0))),
    "min_tokens": SamplingParams(max_tokens=12, min_tokens=5, logit_bias=((EOS, 100.0),)),
    "sampled": SamplingParams(
        max_tokens=16, temperature=1.0, seed=5, min_p=0.05, frequency_penalty=1.0, repetition_penalty=1.2
    ),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("penalties-model"))


@pytest.fixture(scope="module")
def runs(model: Path) -> Iterator[dict[str, tuple[dict[str, list[RequestOutput]], dict[str, list[torch.Tensor]]]]]:
    """Every request's outputs and raw logits rows, with sync and with async steps, all requests in one batch."""
    requests: dict[str, Request] = {rid: (PROMPT, None, params) for rid, params in REQUESTS.items()}
    out = {}
    for mode in ("off", "on"):
        engine = tiny_engine(model, mode)
        try:
            out[mode] = run_recorded(engine, requests)
        finally:
            engine.stop()
    yield out


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def test_sync_and_async_steps_give_the_same_tokens(runs: dict[str, tuple[dict[str, list[RequestOutput]], ...]]) -> None:
    sync, step_ahead = runs["off"][0], runs["on"][0]
    for rid in REQUESTS:
        assert _tokens(sync[rid]) == _tokens(step_ahead[rid]), rid
        assert sync[rid][-1].finish_reason == step_ahead[rid][-1].finish_reason, rid


@pytest.mark.parametrize("mode", ["off", "on"], ids=["sync-steps", "async-steps"])
def test_each_greedy_token_is_the_argmax_of_its_processed_row(
    runs: dict[str, tuple[dict[str, list[RequestOutput]], dict[str, list[torch.Tensor]]]], mode: str
) -> None:
    outputs, rows = runs[mode]
    for rid, params in REQUESTS.items():
        tokens = _tokens(outputs[rid])
        for k, (token, row) in enumerate(zip(tokens, rows[rid], strict=False)):
            processed = reference_process(row, params, PROMPT, tokens[:k], {EOS})
            if params.greedy:
                assert token == int(processed.argmax()), (rid, k)
            else:  # drawn from the processed row, where min-p kept it
                probs = torch.softmax(processed, dim=-1)
                assert probs[token] >= params.min_p * probs.max(), (rid, k)
    plain = _tokens(outputs["plain"])
    assert len(set(plain)) < len(plain)  # the unpenalized greedy completion repeats tokens ...
    frequency = _tokens(outputs["frequency"])
    assert len(set(frequency)) == len(frequency) and frequency[0] == plain[0]  # ... the penalized one does not
    assert not {90, 85} & set(_tokens(outputs["bias"])) and {90, 85} <= set(plain)
    assert len(set(_tokens(outputs["presence"]))) < len(set(plain))  # a negative presence penalty repeats


@pytest.mark.parametrize("mode", ["off", "on"], ids=["sync-steps", "async-steps"])
def test_min_tokens_holds_the_end_token_off_exactly_that_long(
    runs: dict[str, tuple[dict[str, list[RequestOutput]], dict[str, list[torch.Tensor]]]], mode: str
) -> None:
    outputs, _ = runs[mode]
    last = outputs["min_tokens"][-1]
    # The end token's logit is raised by 100: it comes as soon as min_tokens allows, and not one token later.
    assert (last.finish_reason, last.completion_tokens) == ("stop", 5)
    assert EOS not in _tokens(outputs["min_tokens"])


@pytest.mark.parametrize("mode", ["off", "on"], ids=["sync-steps", "async-steps"])
def test_logprobs_stay_those_of_the_raw_rows(
    runs: dict[str, tuple[dict[str, list[RequestOutput]], dict[str, list[torch.Tensor]]]], mode: str
) -> None:
    outputs, rows = runs[mode]
    for rid in ("frequency", "presence"):
        entries = check_logprobs(outputs[rid], rows[rid], REQUESTS[rid].logprobs)
        assert len(entries) == outputs[rid][-1].completion_tokens


def test_min_tokens_holds_stop_strings_off_as_vllm_does(model: Path) -> None:
    """A stop string counts only where it ends in the text of a token past min_tokens; once held off, an earlier
    occurrence is not found later."""
    engine = tiny_engine(model, "off")
    try:
        (probe,) = [run_recorded(engine, {"probe": (PROMPT, None, SamplingParams(max_tokens=12))})[0]["probe"]]
        words = [o.text for o in probe]
        stop = words[1]  # the second token's text, which comes again later (the plain greedy completion repeats)
        later = next(k for k in range(3, len(words)) if words[k] == stop)
        requests: dict[str, Request] = {
            "stops": (PROMPT, None, SamplingParams(max_tokens=12, stop=(stop,))),
            "held": (PROMPT, None, SamplingParams(max_tokens=12, stop=(stop,), min_tokens=3)),
        }
        outputs, _ = run_recorded(engine, requests)
    finally:
        engine.stop()
    assert "".join(o.text for o in outputs["stops"]) == words[0]
    held = outputs["held"]
    assert "".join(o.text for o in held) == "".join(words[:later])
    assert (held[-1].finish_reason, held[-1].completion_tokens) == ("stop", later + 1)
