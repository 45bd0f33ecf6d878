"""Structured outputs through the whole stack (`adaptergate serve`, the real SmolLM2 engine stepping synchronously
and asynchronously, the demo adapters) with the openai client: response_format json_schema and json_object, vLLM's
guided_json, guided_choice and guided_regex, whole and streamed; a schema the engine cannot compile is a 400 naming
its field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.conftest import DEV_KEY, ServerProcess
from tests.integration.engine.test_structured_outputs import CHOICES, PERSON, REGEX, check_person
from tests.integration.test_rest_real_engine import serve_real_engine

pytestmark = pytest.mark.slow

PERSON_PROMPT = [{"role": "user", "content": "Describe a person named Ann who is 31 years old as JSON."}]
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync-steps", "async-steps"])
def gateway(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serve_real_engine(tmp_path_factory, "--async-steps", request.param)


@pytest.fixture
def client(gateway: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=DEV_KEY, max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, model: str, messages: Any, **extra: Any) -> tuple[str, str, str]:
    """The reply's text and finish reason, and the same request's streamed text."""
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0, **extra)
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=64, temperature=0, stream=True, **extra
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    choice = reply.choices[0]
    return choice.message.content or "", choice.finish_reason, streamed


@pytest.mark.parametrize("model", ["base", "pirate"])
def test_a_json_schema_reply_follows_the_schema_whole_and_streamed(client: openai.OpenAI, model: str) -> None:
    text, finish, streamed = _chat(client, model, PERSON_PROMPT, response_format=PERSON_FORMAT)
    assert finish == "stop" and streamed == text
    check_person(text)
    # vLLM's guided_json, as an object and as a string: the same constraint, the same greedy reply.
    for schema in (PERSON, json.dumps(PERSON)):
        assert _chat(client, model, PERSON_PROMPT, extra_body={"guided_json": schema})[0] == text


def test_a_json_object_reply_is_an_object(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Give the capital of France as a JSON object with one key, city."}]
    text, finish, streamed = _chat(client, "base", messages, response_format={"type": "json_object"})
    assert finish == "stop" and streamed == text and isinstance(json.loads(text), dict)


@pytest.mark.parametrize("model", ["base", "pirate"])
def test_a_guided_choice_reply_is_one_of_the_choices(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Is the sea blue? Answer yes, no or maybe."}]
    text, finish, streamed = _chat(client, model, messages, extra_body={"guided_choice": CHOICES})
    assert finish == "stop" and text in CHOICES and streamed == text
    completion = client.completions.create(
        model=model,
        prompt="Is the sea blue?",
        max_tokens=8,
        temperature=1.0,
        seed=3,
        extra_body={"guided_choice": CHOICES},
    )
    assert completion.choices[0].text in CHOICES and completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("model", ["base", "pirate"])
def test_a_guided_regex_reply_matches_it(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Make up a product code."}]
    text, finish, streamed = _chat(client, model, messages, extra_body={"guided_regex": REGEX})
    assert finish == "stop" and re.fullmatch(REGEX, text) and streamed == text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"extra_body": {"guided_json": {"type": "object", "properties": 5}}}, "guided_json"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "guided_grammar"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex"),
    ],
)  # fmt: skip
def test_a_constraint_that_cannot_hold_is_a_400_naming_its_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="base", messages=PERSON_PROMPT, max_tokens=8, **extra)
    assert refused.value.param == param
