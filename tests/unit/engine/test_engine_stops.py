"""vLLM's stop options through the whole engine step loop on a tiny random model, sync and async steps:
stop_token_ids end a request at the token (counted, with its log-probabilities, its text left out unless
include_stop_str_in_output), min_tokens holds them off, ignore_eos lets the end token through, and a stop string
kept in the output is streamed as it comes and cut at its end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput
from tests.support.random_model import write_tiny_llama
from tests.unit.engine.test_engine_logprobs import PROMPT, Request, check_logprobs, run_recorded, tiny_engine

EOS = 1  # the tiny tokenizer's </s>
MAX = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("stops-model"))


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync-steps", "async-steps"])
def engine(request: pytest.FixtureRequest, model: Path) -> Iterator[LLMEngine]:
    eng = tiny_engine(model, request.param)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def probe(engine: LLMEngine) -> list[RequestOutput]:
    """The plain greedy completion, one output per token (no stop string holds text back)."""
    outputs = run_recorded(engine, {"probe": (PROMPT, None, SamplingParams(max_tokens=MAX))})[0]["probe"]
    assert outputs[-1].finish_reason == "length" and EOS not in _tokens(outputs)
    return outputs


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def _text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


def _first_new(tokens: list[int], start: int) -> int:
    """The position of the first token from `start` on that did not come before it."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def test_a_stop_token_ends_the_request_at_once_its_text_left_out_unless_asked(
    engine: LLMEngine, probe: list[RequestOutput]
) -> None:
    tokens = _tokens(probe)
    k = _first_new(tokens, 3)
    stop = tokens[k]
    requests: dict[str, Request] = {
        "left_out": (PROMPT, None, SamplingParams(max_tokens=MAX, stop_token_ids=(stop, 127), logprobs=1)),
        "kept": (PROMPT, None, SamplingParams(max_tokens=MAX, stop_token_ids=(stop,), include_stop_str_in_output=True)),
        # The stop string would end the reply only at a later token: the stop token comes first.
        "both": (PROMPT, None, SamplingParams(max_tokens=MAX, stop_token_ids=(stop,), stop=(_text(probe[k + 1 :]),))),
    }
    outputs, rows = run_recorded(engine, requests)
    for rid, text in (("left_out", _text(probe[:k])), ("kept", _text(probe[: k + 1])), ("both", _text(probe[:k]))):
        got = outputs[rid]
        assert _tokens(got) == tokens[: k + 1], rid  # the stop token is an output token ...
        assert (got[-1].finish_reason, got[-1].completion_tokens) == ("stop", k + 1), rid  # ... counted
        assert _text(got) == text, rid
    assert _text(probe[k : k + 1]).strip()  # the stop token does have text, which "left_out" did leave out
    entries = check_logprobs(outputs["left_out"], rows["left_out"], 1)
    assert len(entries) == k + 1 and outputs["left_out"][-1].token_ids == (stop,)  # its log-probabilities too


def test_min_tokens_holds_stop_tokens_off_exactly_that_long(engine: LLMEngine) -> None:
    forced = ((40, 100.0),)  # the stop token is the greedy choice wherever it is allowed
    requests: dict[str, Request] = {
        "held": (PROMPT, None, SamplingParams(max_tokens=MAX, stop_token_ids=(40,), logit_bias=forced, min_tokens=5)),
        "free": (PROMPT, None, SamplingParams(max_tokens=MAX, stop_token_ids=(40,), logit_bias=forced)),
    }
    outputs, _ = run_recorded(engine, requests)
    held, free = _tokens(outputs["held"]), _tokens(outputs["free"])
    assert free == [40] and outputs["free"][-1].completion_tokens == 1 and _text(outputs["free"]) == ""
    assert len(held) == 6 and 40 not in held[:5] and held[5] == 40
    assert (outputs["held"][-1].finish_reason, outputs["held"][-1].completion_tokens) == ("stop", 6)


def test_ignore_eos_runs_to_max_tokens_and_stop_token_ids_still_stop(engine: LLMEngine) -> None:
    forced = ((EOS, 100.0),)
    requests: dict[str, Request] = {
        "ends": (PROMPT, None, SamplingParams(max_tokens=6, logit_bias=forced)),
        "ignored": (PROMPT, None, SamplingParams(max_tokens=6, logit_bias=forced, ignore_eos=True)),
        "listed": (
            PROMPT,
            None,
            SamplingParams(max_tokens=6, logit_bias=forced, ignore_eos=True, stop_token_ids=(EOS,)),
        ),
    }
    outputs, _ = run_recorded(engine, requests)
    ends, ignored, listed = outputs["ends"][-1], outputs["ignored"][-1], outputs["listed"][-1]
    assert (ends.finish_reason, ends.completion_tokens, _tokens(outputs["ends"])) == ("stop", 0, [])
    assert (ignored.finish_reason, ignored.completion_tokens) == ("length", 6)
    assert _tokens(outputs["ignored"]) == [EOS] * 6
    assert (listed.finish_reason, listed.completion_tokens, _tokens(outputs["listed"])) == ("stop", 1, [EOS])
    assert _text(outputs["listed"]) == ""


def _token_at(probe: list[RequestOutput], char: int) -> int:
    """The position of the token whose text holds the probe's character `char`."""
    ends = [len(_text(probe[: k + 1])) for k in range(len(probe))]
    return next(k for k, end in enumerate(ends) if char < end)


def test_a_stop_string_kept_in_the_output_is_streamed_as_it_comes_and_cut_at_its_end(
    engine: LLMEngine, probe: list[RequestOutput]
) -> None:
    words, text = [o.text for o in probe], _text(probe)
    assert all(len(w) >= 3 for w in words)
    # It ends inside a token's text: the reply is cut there, mid-token, and nothing after it was ever sent.
    stop = words[1] + words[2][:2]
    start = text.index(stop)
    k = _token_at(probe, start + len(stop) - 1)
    assert len(_text(probe[: k + 1])) > start + len(stop)  # mid-token indeed
    requests: dict[str, Request] = {
        "kept": (PROMPT, None, SamplingParams(max_tokens=MAX, stop=(stop,), include_stop_str_in_output=True)),
        "cut": (PROMPT, None, SamplingParams(max_tokens=MAX, stop=(stop,))),
    }
    outputs, _ = run_recorded(engine, requests)
    kept, cut = outputs["kept"], outputs["cut"]
    assert _text(kept) == text[: start + len(stop)] and _text(cut) == text[:start]
    for got in (kept, cut):
        assert _tokens(got) == _tokens(probe)[: k + 1]
        assert (got[-1].finish_reason, got[-1].completion_tokens) == ("stop", k + 1)
    # Kept: each token's text goes out with it (nothing is held back for a stop string that may come) ...
    assert [o.text for o in kept[:-1]] == words[:k]
    # ... cut: the text that could begin the stop string waits (its length less one character).
    before = _text(probe[:k])
    assert _text(cut[:-1]) == before[: len(before) - (len(stop) - 1)]


def test_of_two_stop_strings_kept_the_one_that_ends_first_cuts(engine: LLMEngine, probe: list[RequestOutput]) -> None:
    words, text = [o.text for o in probe], _text(probe)
    j = _first_new(_tokens(probe), 2)
    # Both end in token j's text, first there: the longer one starts earlier but ends later.
    early_end, late_end = words[j][:-1], words[j - 1] + words[j]
    assert text.index(early_end) == len(_text(probe[:j])) and text.index(late_end) == len(_text(probe[: j - 1]))
    params = SamplingParams(max_tokens=MAX, stop=(late_end, early_end), include_stop_str_in_output=True)
    outputs, _ = run_recorded(engine, {"two": (PROMPT, None, params)})
    assert _text(outputs["two"]) == text[: len(_text(probe[:j])) + len(early_end)]
    assert outputs["two"][-1].completion_tokens == j + 1
