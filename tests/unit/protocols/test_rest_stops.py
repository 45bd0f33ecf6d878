"""vLLM's stop options over REST: ignore_eos, stop_token_ids and include_stop_str_in_output reach the gateway's
request as sent, and each bad value is a 400 naming its field (the engine applies them: tests/unit/engine/
test_engine_stops.py; ids past the vocabulary are the engine's to refuse: tests/integration)."""

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
ALL = {"ignore_eos": True, "stop_token_ids": [2, 0, 999999999, 2], "include_stop_str_in_output": True}
PATHS = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]


@pytest.fixture
async def rest() -> AsyncIterator[tuple[FakeGateway, str]]:
    gateway = FakeGateway()
    async with RestServer(gateway, port=0, model_name="smol", health=gateway) as server:
        yield gateway, f"http://127.0.0.1:{server.port}"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body"), PATHS)
async def test_every_field_reaches_the_gateway_as_sent(
    rest: tuple[FakeGateway, str], path: str, body: dict[str, Any], stream: bool
) -> None:
    gateway, url = rest
    sent = {**body, **ALL, "stream": stream}
    async with aiohttp.ClientSession() as http, http.post(f"{url}{path}", json=sent, headers=KEY) as r:
        assert r.status == 200, await r.text()
    s = gateway.requests[0].sampling
    assert (s.ignore_eos, s.stop_token_ids, s.include_stop_str_in_output) == (True, (2, 0, 999999999, 2), True)


@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_absent_null_or_empty_fields_change_nothing(parse: Any) -> None:
    for extra in (
        {},
        dict.fromkeys(ALL),
        {"ignore_eos": False, "stop_token_ids": [], "include_stop_str_in_output": False},
    ):
        s = parse({**CHAT, **COMPLETION, **extra}, "smol").sampling
        assert (s.ignore_eos, s.stop_token_ids, s.include_stop_str_in_output) == (False, (), False)


def test_sixty_four_stop_token_ids_are_accepted() -> None:
    ids = list(range(64))
    assert parse_completion({**COMPLETION, "stop_token_ids": ids}, "smol").sampling.stop_token_ids == tuple(ids)


_IDS = "stop_token_ids must be an array of at most 64 token ids (integers from 0 to 999999999)"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("ignore_eos", 1, "ignore_eos must be true or false"),
        ("ignore_eos", "true", "ignore_eos must be true or false"),
        ("include_stop_str_in_output", 0, "include_stop_str_in_output must be true or false"),
        ("include_stop_str_in_output", [True], "include_stop_str_in_output must be true or false"),
        ("stop_token_ids", 2, _IDS),
        ("stop_token_ids", "2", _IDS),
        ("stop_token_ids", {"2": 1}, _IDS),
        ("stop_token_ids", ["2"], _IDS),
        ("stop_token_ids", [2.0], _IDS),
        ("stop_token_ids", [True], _IDS),
        ("stop_token_ids", [None], _IDS),
        ("stop_token_ids", [[2]], _IDS),
        ("stop_token_ids", [-1], _IDS),
        ("stop_token_ids", [3, 10**9], _IDS),
        ("stop_token_ids", [10**30], _IDS),
        ("stop_token_ids", list(range(65)), _IDS),
    ],
)
@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_bad_values_are_refused_naming_the_field(parse: Any, field: str, value: object, message: str) -> None:
    with pytest.raises(FieldError) as refused:
        parse({**CHAT, **COMPLETION, field: value}, "smol")
    assert refused.value.param == field and message in refused.value.message


@pytest.mark.parametrize(("path", "body"), PATHS)
async def test_a_bad_value_is_a_400_over_http(rest: tuple[FakeGateway, str], path: str, body: dict[str, Any]) -> None:
    gateway, url = rest
    sent = {**body, "stop_token_ids": [5, -3], "stream": True}
    async with aiohttp.ClientSession() as http, http.post(f"{url}{path}", json=sent, headers=KEY) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert (error["param"], error["type"]) == ("stop_token_ids", "invalid_request_error") and _IDS in error["message"]
    assert gateway.requests == []
