"""engine/structured.py on SmolLM2's real tokenizer: compiling each kind (cached, refusals in xgrammar's words),
the matchers' verdicts, and the masks a step puts on its constrained rows only."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.loader import resolve_model
from engine.structured import Grammar, StructuredOutputs, choice_grammar, mask_logits
from engine.tokenizer import Tokenizer

VOCAB = 49152  # SmolLM2's model vocabulary (its tokenizer's too)
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(EngineConfig().model))


@pytest.fixture(scope="module")
def structured(tokenizer: Tokenizer) -> StructuredOutputs:
    return StructuredOutputs(tokenizer, VOCAB + 64)  # a padded LM head: ids past the tokenizer's


def _feed(grammar: Grammar, ids: list[int]) -> bool:
    return all(grammar.accept(t) for t in ids)


def test_each_kind_accepts_its_sentences_and_refuses_others(
    structured: StructuredOutputs, tokenizer: Tokenizer
) -> None:
    enc = tokenizer.hf_tokenizer.encode
    cases: list[tuple[str, str, str, str]] = [
        ("json_schema", json.dumps(PERSON), '{"name": "Ann", "age": 31}', '{"name": 31}'),
        ("json_object", "", '{"a": [1, 2]}', "[1, 2]"),
        ("regex", r"[0-9]{3}-[a-z]+", "123-abc", "12a"),
        ("choice", json.dumps(["yes", "no"]), "no", "nope"),
        ("grammar", 'root ::= "a" ("b" | "c")*', "abcb", "ba"),
    ]
    for kind, spec, good, bad in cases:
        grammar = structured.grammar(kind, spec)
        assert _feed(grammar, enc(good)) and not grammar.terminated, kind
        eos = next(iter(tokenizer.eos_token_ids))
        assert grammar.accept(eos) and grammar.terminated, kind  # the end token ends a complete sentence
        assert not _feed(structured.grammar(kind, spec), enc(bad)), kind


def test_the_end_token_is_refused_before_the_sentence_is_complete(
    structured: StructuredOutputs, tokenizer: Tokenizer
) -> None:
    grammar = structured.grammar("regex", "[0-9]{3}")
    assert _feed(grammar, tokenizer.hf_tokenizer.encode("12"))
    assert not grammar.accept(next(iter(tokenizer.eos_token_ids))) and not grammar.terminated


def test_compiled_grammars_are_cached_by_spec(structured: StructuredOutputs) -> None:
    first = structured.compile("regex", "[a-z]{2}")
    assert structured.compile("regex", "[a-z]{2}") is first
    assert structured.compile("regex", "[a-z]{3}") is not first
    assert structured.compile("grammar", 'root ::= "[a-z]{2}"') is not first  # the kind is part of the key


@pytest.mark.parametrize(
    ("kind", "spec", "words"),
    [
        ("regex", "(ab", "Failed to transform regex into a grammar: Regex parsing error"),
        ("json_schema", '{"type": "nope"}', 'Failed to transform json schema into a grammar: Unsupported type "nope"'),
        ("json_schema", "{not json", "Failed to transform json schema into a grammar"),
        (
            "grammar",
            "root ::= missing",
            'Invalid grammar specification: EBNF parser error at line 1, column 10: Rule "',
        ),
        ("choice", "[]", "Failed to transform choices into a grammar: choices must be a non-empty array"),
    ],
)
def test_a_spec_that_does_not_compile_is_refused_with_the_reason(
    structured: StructuredOutputs, kind: str, spec: str, words: str
) -> None:
    with pytest.raises(ValueError) as refused:
        structured.grammar(kind, spec)
    assert str(refused.value).startswith(words)
    assert not re.search(r"\.cc:[0-9]+", str(refused.value))  # xgrammar's source position is dropped


def test_choices_are_escaped_into_literals(structured: StructuredOutputs, tokenizer: Tokenizer) -> None:
    choices = ['say "hi"', "back\\slash", "two\nlines"]
    assert choice_grammar(choices) == 'root ::= "say \\"hi\\"" | "back\\\\slash" | "two\\nlines"'
    for choice in choices:
        grammar = structured.grammar("choice", json.dumps(choices))
        assert _feed(grammar, tokenizer.hf_tokenizer.encode(choice)), choice


def _seq(grammar: Grammar | None) -> Any:
    return SimpleNamespace(grammar=grammar)


def test_masks_touch_only_constrained_rows_and_leave_the_logits_as_they_are(
    structured: StructuredOutputs, tokenizer: Tokenizer
) -> None:
    logits = torch.randn(3, VOCAB + 64)
    before = logits.clone()
    grammar = structured.grammar("choice", json.dumps(["yes", "no"]))
    masked = mask_logits(logits, [_seq(None), _seq(grammar), _seq(None)])
    assert torch.equal(logits, before)  # a copy: log-probabilities read the raw logits
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    allowed = set(torch.nonzero(masked[1] > float("-inf")).flatten().tolist())
    # The first tokens of "yes" and "no" and nothing else (the padded ids past the tokenizer's included).
    firsts = {tokenizer.hf_tokenizer.encode(w)[0] for w in ("yes", "no")}
    assert firsts <= allowed and all(t < VOCAB for t in allowed)
    assert all(tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed)
    assert masked[1][list(allowed)].equal(logits[1][list(allowed)])
    unconstrained = torch.randn(2, VOCAB + 64)
    assert mask_logits(unconstrained, [_seq(None), _seq(None)]) is unconstrained
