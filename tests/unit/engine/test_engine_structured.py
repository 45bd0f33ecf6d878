"""Structured outputs through the whole engine step loop on a tiny random model, sync and async steps: a constrained
request's tokens follow its grammar and its end ends it ("stop"), greedy or sampled, beside unconstrained ones whose
tokens do not change; log-probabilities stay the model's own; min_tokens and ignore_eos do not outlast the grammar."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from engine.engine import LLMEngine
from engine.errors import EngineError
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput
from tests.support.random_model import write_tiny_llama
from tests.unit.engine.test_engine_logprobs import PROMPT, run_recorded, tiny_engine

# The tiny tokenizer's words are "w2" ... "w127", each a token of its own (token "wN" is id N).
THREE = 'root ::= ("w5" | "w9") ("w5" | "w9") ("w7" | "w8")'


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync-steps", "async-steps"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLMEngine]:
    eng = tiny_engine(write_tiny_llama(tmp_path_factory.mktemp("structured-model")), request.param)
    yield eng
    eng.stop()


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def _follows_three(tokens: list[int]) -> bool:
    return len(tokens) == 3 and tokens[0] in (5, 9) and tokens[1] in (5, 9) and tokens[2] in (7, 8)


def test_constrained_rows_follow_their_grammar_and_leave_their_neighbours_alone(engine: LLMEngine) -> None:
    plain = SamplingParams(max_tokens=8)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    alone, _ = run_recorded(engine, {"plain": (PROMPT, None, plain), "sampled": (PROMPT, None, sampled)})
    grammar = SamplingParams(max_tokens=8, structured_kind="grammar", structured_spec=THREE)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=5, structured_kind="grammar", structured_spec=THREE)
    mixed, _ = run_recorded(
        engine,
        {
            "plain": (PROMPT, None, plain),
            "grammar": (PROMPT, None, grammar),
            "sampled": (PROMPT, None, sampled),
            "seeded": (PROMPT, None, seeded),
        },
    )
    assert _tokens(mixed["plain"]) == _tokens(alone["plain"]) and len(_tokens(alone["plain"])) == 8
    assert _tokens(mixed["sampled"]) == _tokens(alone["sampled"])  # seeded draws do not depend on neighbours
    for rid in ("grammar", "seeded"):
        last = mixed[rid][-1]
        assert _follows_three(_tokens(mixed[rid])), rid
        # The end token the complete grammar allowed ends the request; it is not an output token.
        assert last.finish_reason == "stop" and last.completion_tokens == 3 and last.error is None
        assert "".join(o.text for o in mixed[rid]).split() == [f"w{t}" for t in _tokens(mixed[rid])]


def test_log_probabilities_are_the_models_own(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=8, logprobs=2, structured_kind="grammar", structured_spec=THREE)
    outputs, rows = run_recorded(engine, {"g": (PROMPT, None, params)})
    tokens = _tokens(outputs["g"])
    entries = [e for o in outputs["g"] for e in o.logprobs]
    assert _follows_three(tokens) and len(entries) == 3
    for token, entry, row in zip(tokens, entries, rows["g"], strict=False):
        raw = torch.log_softmax(row.float(), dim=-1)
        assert entry.logprob == pytest.approx(float(raw[token]), abs=1e-5)
        assert [i for i, _ in entry.top] == raw.topk(2).indices.tolist()  # outside the grammar too


def test_a_complete_choice_ends_the_request_whatever_min_tokens_and_ignore_eos_say(engine: LLMEngine) -> None:
    choices = json.dumps(["w5w9", "w8"])
    params = SamplingParams(
        max_tokens=8, min_tokens=6, ignore_eos=True, structured_kind="choice", structured_spec=choices
    )
    outputs, _ = run_recorded(engine, {"c": (PROMPT, None, params)})
    tokens, last = _tokens(outputs["c"]), outputs["c"][-1]
    assert tokens in ([5, 9], [8]) and last.finish_reason == "stop" and last.error is None


def test_max_tokens_cuts_a_constrained_reply_short(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=2, structured_kind="grammar", structured_spec=THREE)
    outputs, _ = run_recorded(engine, {"short": (PROMPT, None, params)})
    tokens = _tokens(outputs["short"])
    assert outputs["short"][-1].finish_reason == "length" and _follows_three([*tokens, 7])


@pytest.mark.parametrize(
    ("kind", "spec", "words"),
    [
        ("regex", "(w5", "Failed to transform regex into a grammar"),
        ("json_schema", '{"type": 5}', "Failed to transform json schema into a grammar"),
        ("grammar", "root ::= nothing", "Invalid grammar specification"),
        ("xml", "<a/>", "structured_kind must be one of json_object, json_schema, regex, choice, grammar"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_on_admission(
    engine: LLMEngine, kind: str, spec: str, words: str
) -> None:
    params = SamplingParams(max_tokens=4, structured_kind=kind, structured_spec=spec)
    with pytest.raises(EngineError) as refused:
        engine.add_request("bad", PROMPT, params, None, lambda out: None)
    assert refused.value.code == "INVALID_ARGUMENT" and refused.value.message.startswith(words)
