"""Structured outputs on the real engine (SmolLM2), sync and async steps, base model and the pirate adapter: a JSON
schema's reply parses and follows the schema, a choice's is one of them, a regex's matches it, and constrained
rows batched with unconstrained ones leave those rows' greedy tokens as they are."""

from __future__ import annotations

import json
import re

from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from tests.integration.engine.conftest import run
from tests.support.model_files import demo_adapter_dir

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CHOICES = ["yes", "no", "maybe"]


def check_person(text: str) -> dict[str, object]:
    """`text` parsed, checked against PERSON (no JSON-schema library is installed; xgrammar's strict mode, the
    default, allows no other properties)."""
    person = json.loads(text)
    assert isinstance(person, dict) and set(person) == {"name", "age"}, text
    assert isinstance(person["name"], str) and type(person["age"]) is int, text
    return person


def _chat(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([("user", text)])


def _constrained(kind: str, spec: str, temperature: float = 0.0, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=64, temperature=temperature, seed=seed, structured_kind=kind, structured_spec=spec)


def test_each_kind_of_constraint_holds_on_base_and_adapter(engine: LLMEngine) -> None:
    engine.load_adapter("pirate", str(demo_adapter_dir("pirate")), wait=True)
    person = _chat(engine, "Describe a person named Ann who is 31 years old as JSON.")
    question = _chat(engine, "Is the sea blue? Answer yes, no or maybe.")
    code = _chat(engine, "Make up a product code.")
    for adapter in (None, "pirate"):
        sinks = {
            "schema": run(
                engine, f"schema-{adapter}", person, _constrained("json_schema", json.dumps(PERSON)), adapter
            ),
            "sampled": run(
                engine,
                f"sampled-{adapter}",
                person,
                _constrained("json_schema", json.dumps(PERSON), temperature=1.0, seed=7),
                adapter,
            ),
            "choice": run(engine, f"choice-{adapter}", question, _constrained("choice", json.dumps(CHOICES)), adapter),
            "regex": run(engine, f"regex-{adapter}", code, _constrained("regex", REGEX), adapter),
        }
        finals = {name: sink.wait() for name, sink in sinks.items()}
        assert all(f.finish_reason == "stop" and f.error is None for f in finals.values()), finals
        check_person(sinks["schema"].text)
        check_person(sinks["sampled"].text)
        assert sinks["choice"].text in CHOICES
        assert re.fullmatch(REGEX, sinks["regex"].text), sinks["regex"].text
        # The text is the tokens' (no end token among them, nothing held back or lost).
        for sink in sinks.values():
            assert engine.tokenizer.decode(sink.token_ids) == sink.text


def test_unconstrained_rows_keep_their_greedy_tokens_beside_constrained_ones(engine: LLMEngine) -> None:
    prompt = _chat(engine, "Describe a person named Ann who is 31 years old as JSON.")
    greedy = SamplingParams(max_tokens=40)
    alone = run(engine, "alone", prompt, greedy)
    alone.wait()
    mixed = {
        "plain": run(engine, "mixed-plain", prompt, greedy),
        "schema": run(engine, "mixed-schema", prompt, _constrained("json_schema", json.dumps(PERSON))),
        "object": run(engine, "mixed-object", prompt, _constrained("json_object", "")),
        "plain2": run(engine, "mixed-plain2", prompt, greedy),
    }
    for sink in mixed.values():
        sink.wait()
    assert mixed["plain"].token_ids == alone.token_ids and mixed["plain2"].token_ids == alone.token_ids
    assert mixed["plain"].text == alone.text and not alone.text.startswith("{")  # the model's own reply differs
    check_person(mixed["schema"].text)
    assert mixed["object"].text.startswith("{")
