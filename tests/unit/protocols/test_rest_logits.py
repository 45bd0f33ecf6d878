"""Logit processing over REST: penalties, logit_bias, min_p and min_tokens reach the gateway's request as sent,
and each bad value is a 400 naming its field (the engine applies them: tests/unit/engine/test_logits_processing.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from protocols.rest import RestServer
from protocols.rest_input import FieldError, parse_chat, parse_completion
from tests.unit.protocols.test_rest import KEY, FakeGateway

CHAT = {"model": "base", "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": "base", "prompt": "x"}
ALL = {
    "presence_penalty": -1.5,
    "frequency_penalty": 2,
    "repetition_penalty": 1.25,
    "logit_bias": {"50256": -100, "0": 100, "7": 0.5},
    "min_p": 0.05,
    "min_tokens": 4,
    "max_tokens": 9,
}


@pytest.fixture
async def rest() -> AsyncIterator[tuple[FakeGateway, str]]:
    gateway = FakeGateway()
    async with RestServer(gateway, port=0, model_name="smol", health=gateway) as server:
        yield gateway, f"http://127.0.0.1:{server.port}"


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
async def test_every_field_reaches_the_gateway_as_sent(
    rest: tuple[FakeGateway, str], path: str, body: dict[str, Any]
) -> None:
    gateway, url = rest
    async with aiohttp.ClientSession() as http, http.post(f"{url}{path}", json={**body, **ALL}, headers=KEY) as r:
        assert r.status == 200, await r.text()
    s = gateway.requests[0].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (-1.5, 2.0, 1.25)
    assert s.logit_bias == ((50256, -100.0), (0, 100.0), (7, 0.5))
    assert (s.min_p, s.min_tokens, s.max_tokens) == (0.05, 4, 9)


@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_absent_or_null_fields_change_nothing(parse: Any) -> None:
    for extra in ({}, dict.fromkeys(ALL)):
        s = parse({**CHAT, **COMPLETION, **extra}, "smol").sampling
        assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.logit_bias) == (0, 0, 1, ())
        assert (s.min_p, s.min_tokens) == (0, 0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("presence_penalty", 2.01, "between -2 and 2, got 2.01"),
        ("frequency_penalty", -2.5, "between -2 and 2"),
        ("frequency_penalty", "1", "must be a number"),
        ("repetition_penalty", 0, "greater than 0 and at most"),
        ("repetition_penalty", -1.0, "greater than 0"),
        ("repetition_penalty", 10**400, "greater than 0 and at most"),  # past float32: not on the engine's wire
        ("min_p", -0.1, "between 0 and 1"),
        ("min_p", True, "must be a number"),
        ("min_tokens", -1, "at least 0"),
        ("min_tokens", 1.5, "must be an integer"),
        ("logit_bias", [[5, 1]], "must be an object"),
        ("logit_bias", {"5": 100.5}, "logit_bias['5'] must be between -100 and 100, got 100.5"),
        ("logit_bias", {"5": None}, "logit_bias['5'] must be a number"),
        ("logit_bias", {"5": "1"}, "must be a number"),
        ("logit_bias", {"-1": 1}, "keys must be token ids (integers from 0 to 999999999), got '-1'"),
        ("logit_bias", {"07": 1}, "got '07'"),  # "7" and "07" would name one id twice
        ("logit_bias", {"1000000000": 1}, "got '1000000000'"),
        ("logit_bias", {" 5": 1}, "got ' 5'"),
        ("logit_bias", {str(i): 1 for i in range(301)}, "at most 300 token ids, got 301"),
    ],
)
@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_bad_values_are_refused_naming_the_field(parse: Any, field: str, value: object, message: str) -> None:
    with pytest.raises(FieldError) as refused:
        parse({**CHAT, **COMPLETION, field: value}, "smol")
    assert refused.value.param == field and message in refused.value.message


def test_min_tokens_is_bounded_by_the_max_tokens_that_applies() -> None:
    assert parse_completion({**COMPLETION, "min_tokens": 5, "max_tokens": 5}, "smol").sampling.min_tokens == 5
    # Without max_tokens the engine's default applies, which only the engine knows: it refuses past it.
    assert parse_completion({**COMPLETION, "min_tokens": 10**6}, "smol").sampling.min_tokens == 10**6
    # Chat's max_completion_tokens wins over max_tokens, for min_tokens' bound too.
    body = {**CHAT, "min_tokens": 7, "max_tokens": 9, "max_completion_tokens": 6}
    with pytest.raises(FieldError, match=r"at most max_tokens \(6\), got 7") as refused:
        parse_chat(body, "smol")
    assert refused.value.param == "min_tokens"
    assert parse_chat({**body, "max_completion_tokens": 7}, "smol").sampling.min_tokens == 7
