"""Structured outputs at the REST boundary: OpenAI's response_format and vLLM's guided_* fields become the engine's
(kind, spec); every bad shape is a 400 naming its field, and so is a schema the engine cannot compile."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.api import Error, Event, GatewayRequest
from gateway.errors import Status
from protocols.rest import RestServer
from protocols.rest_input import FieldError, parse_chat, parse_completion
from tests.unit.protocols.test_rest import KEY, FakeGateway

CHAT = {"model": "base", "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": "base", "prompt": "x"}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _sampling(body: dict[str, Any]) -> tuple[str, str]:
    s = parse_chat(body, "smol").sampling
    return s.structured_kind, s.structured_spec


def test_response_format_types_become_engine_kinds() -> None:
    assert _sampling({**CHAT, "response_format": {"type": "text"}}) == ("", "")
    assert _sampling({**CHAT, "response_format": {"type": "json_object"}}) == ("json_object", "")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kind, spec = _sampling({**CHAT, "response_format": fmt})
    assert kind == "json_schema" and json.loads(spec) == PERSON
    assert parse_chat({**CHAT, "response_format": fmt}, "smol").structured_field == "response_format"


def test_completions_accept_response_format_too() -> None:  # as vLLM's do
    parsed = parse_completion({**COMPLETION, "response_format": {"type": "json_object"}}, "smol")
    assert parsed.sampling.structured_kind == "json_object"


@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_guided_fields_become_engine_kinds(parse: Any) -> None:
    base = {**CHAT, **COMPLETION}
    cases = {
        "guided_json": (PERSON, "json_schema", PERSON),
        "guided_regex": ("[0-9]{3}", "regex", "[0-9]{3}"),
        "guided_choice": (["yes", "no"], "choice", ["yes", "no"]),
        "guided_grammar": ('root ::= "a" | "b"', "grammar", 'root ::= "a" | "b"'),
    }
    for name, (value, kind, spec) in cases.items():
        parsed = parse({**base, name: value}, "smol")
        got = parsed.sampling.structured_spec
        assert parsed.sampling.structured_kind == kind and parsed.structured_field == name
        assert (json.loads(got) if kind in ("json_schema", "choice") else got) == spec
    # guided_json as a string holding the schema (vLLM takes both)
    parsed = parse({**base, "guided_json": json.dumps(PERSON)}, "smol")
    assert json.loads(parsed.sampling.structured_spec) == PERSON
    assert parse(base, "smol").sampling.structured_kind == ""


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"response_format": "json_object"}, "response_format", "must be an object"),
        ({"response_format": {"type": "xml"}}, "response_format", "one of text, json_object, json_schema"),
        ({"response_format": {}}, "response_format", "one of text"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name and a schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
            "response_format.json_schema.name",
            "1 to 64",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}}},
            "response_format.json_schema.name",
            "letters",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
            "response_format.json_schema.schema",
            "JSON schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": "{}"}}},
            "response_format.json_schema.schema",
            "an object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "strict": 1}}},
            "response_format.json_schema.strict",
            "true or false",
        ),
        ({"guided_json": "not json"}, "guided_json", "a string holding one"),
        ({"guided_json": "[1]"}, "guided_json", "an object"),
        ({"guided_json": 5}, "guided_json", "JSON schema"),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        ({"guided_regex": ["a"]}, "guided_regex", "non-empty string"),
        ({"guided_grammar": 1}, "guided_grammar", "non-empty string"),
        ({"guided_choice": []}, "guided_choice", "non-empty array"),
        ({"guided_choice": "yes"}, "guided_choice", "non-empty array"),
        ({"guided_choice": ["yes", 1]}, "guided_choice", "strings"),
        ({"guided_choice": ["yes", ""]}, "guided_choice", "non-empty strings"),
        ({"guided_choice": ["\ud800"]}, "guided_choice", "unpaired surrogate"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "guided_regex, guided_choice"),
        (
            {"response_format": {"type": "json_object"}, "guided_json": PERSON},
            "guided_json",
            "only use one kind of structured outputs constraint",
        ),
    ],
)
@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_bad_shapes_are_400s_naming_the_field(parse: Any, extra: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(FieldError) as refused:
        parse({**CHAT, **COMPLETION, **extra}, "smol")
    assert refused.value.status is Status.INVALID_ARGUMENT
    assert refused.value.param == param and words in refused.value.message


def test_text_response_format_is_no_constraint_beside_a_guided_field() -> None:
    parsed = parse_chat({**CHAT, "response_format": {"type": "text"}, "guided_regex": "a+"}, "smol")
    assert parsed.sampling.structured_kind == "regex" and parsed.structured_field == "guided_regex"


class RefusingGateway(FakeGateway):
    """Answers every request as an engine answers a schema it cannot compile (engine/structured.py's words)."""

    async def submit(self, request: GatewayRequest) -> AsyncIterator[Event]:
        self.requests.append(request)
        yield Error(Status.INVALID_ARGUMENT, 'Failed to transform json schema into a grammar: Unsupported type "nope"')


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "x"}}}},
            "response_format",
        ),
        ("/v1/completions", {**COMPLETION, "guided_json": {"type": "nope"}}, "guided_json"),
    ],
)
async def test_a_schema_the_engine_refuses_is_a_400_naming_its_field(
    stream: bool, path: str, body: dict[str, Any], param: str
) -> None:
    gateway = RefusingGateway()
    async with RestServer(gateway, port=0, model_name="smol") as server, aiohttp.ClientSession(headers=KEY) as http:
        async with http.post(f"http://127.0.0.1:{server.port}{path}", json={**body, "stream": stream}) as r:
            assert r.status == 400
            error = (await r.json())["error"]
    assert error["param"] == param and "Unsupported type" in error["message"]
    assert gateway.requests[0].sampling.structured_kind == "json_schema"
