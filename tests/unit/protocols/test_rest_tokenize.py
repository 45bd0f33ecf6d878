"""vLLM's /tokenize and /detokenize over REST: what each body becomes, every refusal a 400 naming its field, the
service's errors as a completion's, and replies as the OpenAPI document describes them (the real engine's
tokenizer behind them: tests/integration/test_rest_tokenize.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.api import ChatMessage, DetokenizeRequest, TokenizeRequest, Tokens
from gateway.errors import InvalidRequest, NotFound, Unavailable
from protocols.rest import RestServer
from protocols.rest_input import FieldError
from protocols.rest_tokenize import MAX_DETOKENIZE_TOKENS, parse_detokenize, parse_tokenize
from tests.unit.protocols.test_openapi import SCHEMAS, _conforms
from tests.unit.protocols.test_rest import KEY, FakeGateway

CHAT = [{"role": "user", "content": "Hi"}]


class FakeTokens(FakeGateway):
    """A scripted TokenService beside the scripted Submitter: one token per character, the model chosen by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[TokenizeRequest | DetokenizeRequest] = []

    async def tokenize(self, request: TokenizeRequest) -> Tokens:
        self.seen.append(request)
        _refuse(request.adapter)
        text = request.prompt if request.prompt is not None else "".join(m.content for m in request.messages or ())
        strs = tuple(text) if request.return_token_strs else None
        return Tokens(tuple(ord(c) for c in text), 2048, strs)

    async def detokenize(self, request: DetokenizeRequest) -> str:
        self.seen.append(request)
        _refuse(request.adapter)
        if any(t >= 0x110000 for t in request.ids):
            raise InvalidRequest("tokens[0] is outside the vocabulary")
        return "".join(chr(t) for t in request.ids)


def _refuse(adapter: str | None) -> None:
    if adapter == "nope":
        raise NotFound("adapter 'nope' not found")
    if adapter == "down":
        raise Unavailable("no engine replica is available", retry_after_s=2.0)


# -- validation -------------------------------------------------------------------------------------------------


def test_a_prompt_body_becomes_the_request_a_completion_would_tokenize() -> None:
    got = parse_tokenize({"model": "base:pirate", "prompt": "héllo"}, "smol", "t1")
    assert got == TokenizeRequest("t1", "pirate", "héllo", None, True, True, False)
    got = parse_tokenize(
        {"model": "smol", "prompt": "", "add_special_tokens": False, "return_token_strs": True}, "smol"
    )
    assert (got.adapter, got.prompt, got.add_special_tokens, got.return_token_strs) == (None, "", False, True)


def test_a_chat_body_becomes_the_request_a_chat_completion_would_tokenize() -> None:
    got = parse_tokenize({"model": "pirate", "messages": [{"role": "developer", "content": "x"}, *CHAT]}, "smol")
    assert got.messages == (ChatMessage("system", "x"), ChatMessage("user", "Hi"))
    assert (got.prompt, got.add_special_tokens, got.add_generation_prompt) == (None, False, True)
    got = parse_tokenize(
        {"model": "base", "messages": CHAT, "add_generation_prompt": False, "add_special_tokens": True}, "smol"
    )
    assert (got.add_special_tokens, got.add_generation_prompt) == (True, False)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ([], None, "must be a JSON object"),
        ({"prompt": "x"}, "model", "model is required"),
        ({"model": 3, "prompt": "x"}, "model", "model is required"),
        ({"model": "base:", "prompt": "x"}, "model", "names no adapter"),
        ({"model": "base"}, "prompt", "prompt (a string) or messages (a chat) is required"),
        ({"model": "base", "prompt": "x", "messages": CHAT}, "messages", "not both"),
        ({"model": "base", "prompt": ["x"]}, "prompt", "prompt must be a string"),
        ({"model": "base", "prompt": "\ud800"}, "prompt", "unpaired surrogate"),
        ({"model": "base", "prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens", "true or false"),
        ({"model": "base", "prompt": "x", "return_token_strs": 1}, "return_token_strs", "true or false"),
        ({"model": "base", "prompt": "x", "add_generation_prompt": True}, "add_generation_prompt", "not to a prompt"),
        ({"model": "base", "messages": []}, "messages", "non-empty array"),
        ({"model": "base", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "must be one of"),
        ({"model": "base", "messages": [{"role": "user"}]}, "messages[0].content", "must be a string"),
        ({"model": "base", "messages": CHAT, "add_generation_prompt": 0}, "add_generation_prompt", "true or false"),
    ],
)
def test_bad_tokenize_bodies_are_refused_naming_the_field(body: object, param: str | None, message: str) -> None:
    with pytest.raises(FieldError, match=message.replace("(", r"\(").replace(")", r"\)")) as refused:
        parse_tokenize(body, "smol")
    assert refused.value.param == param


def test_a_detokenize_body_becomes_its_ids() -> None:
    assert parse_detokenize({"model": "pirate", "tokens": [0, 7, 999_999_999]}, "smol", "t1") == DetokenizeRequest(
        "t1", "pirate", (0, 7, 999_999_999)
    )
    assert len(parse_detokenize({"model": "base", "tokens": [1] * MAX_DETOKENIZE_TOKENS}, "smol").ids) == 131_072


@pytest.mark.parametrize(
    "tokens",
    [None, [], "1 2", [1, -1], [1.0], [True], ["1"], [10**9], [[1]], [1] * (MAX_DETOKENIZE_TOKENS + 1)],
    ids=lambda v: repr(v)[:20],
)
def test_bad_token_lists_are_refused_naming_tokens(tokens: object) -> None:
    body = {"model": "base"} if tokens is None else {"model": "base", "tokens": tokens}
    with pytest.raises(FieldError, match="tokens must be a non-empty array of at most 131072 token ids") as refused:
        parse_detokenize(body, "smol")
    assert refused.value.param == "tokens"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "base", "prompt": "x"},
        {"model": "base", "messages": CHAT, "return_token_strs": True},
        {"model": "base", "prompt": "x", "messages": CHAT},
        {"model": "base"},
        {"model": "base", "prompt": "x", "add_generation_prompt": True},
        {"model": "base", "messages": CHAT, "add_generation_prompt": None, "add_special_tokens": True},
        {"model": "base", "prompt": 3},
    ],
)
def test_the_document_accepts_the_tokenize_bodies_the_parser_accepts(body: dict[str, Any]) -> None:
    try:
        parse_tokenize(body, "smol")
        accepted = True
    except FieldError:
        accepted = False
    assert _conforms(SCHEMAS["TokenizeRequest"], body) == accepted
    for example in SCHEMAS["TokenizeRequest"]["examples"]:
        parse_tokenize(example, "smol")
    for example in SCHEMAS["DetokenizeRequest"]["examples"]:
        assert _conforms(SCHEMAS["DetokenizeRequest"], example)
        parse_detokenize(example, "smol")


# -- over the wire ----------------------------------------------------------------------------------------------


@pytest.fixture
async def rest() -> AsyncIterator[tuple[FakeTokens, str]]:
    service = FakeTokens()
    async with RestServer(service, port=0, model_name="smol", tokens=service) as server:
        yield service, f"http://127.0.0.1:{server.port}"


async def _post(url: str, body: object, headers: dict[str, str] = KEY) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_tokenize_and_detokenize_replies(rest: tuple[FakeTokens, str]) -> None:
    service, url = rest
    status, reply = await _post(f"{url}/tokenize", {"model": "pirate", "prompt": "Hi", "return_token_strs": True})
    assert status == 200
    assert reply == {"count": 2, "max_model_len": 2048, "tokens": [72, 105], "token_strs": ["H", "i"]}
    assert _conforms(SCHEMAS["TokenizeResponse"], reply)
    assert service.seen[-1] == TokenizeRequest("t1", "pirate", "Hi", None, True, True, True)
    status, reply = await _post(f"{url}/tokenize", {"model": "base", "messages": CHAT})
    assert (status, reply["tokens"], reply["token_strs"]) == (200, [72, 105], None)
    status, reply = await _post(f"{url}/detokenize", {"model": "base", "tokens": [72, 105]})
    assert (status, reply) == (200, {"prompt": "Hi"})
    assert _conforms(SCHEMAS["DetokenizeResponse"], reply)
    assert service.seen[-1] == DetokenizeRequest("t1", None, (72, 105))


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model", "model_not_found"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model", "model_not_found"),
        ("/detokenize", {"model": "base", "tokens": [0x110000]}, 400, "tokens", "invalid_argument"),
        ("/tokenize", {"model": "base", "prompt": "x", "messages": CHAT}, 400, "messages", "invalid_argument"),
        ("/tokenize", {"model": "down", "prompt": "x"}, 503, None, "unavailable"),
    ],
)
async def test_errors_are_openai_shaped_and_name_their_field(
    rest: tuple[FakeTokens, str], path: str, body: dict[str, Any], status: int, param: str | None, code: str
) -> None:
    _, url = rest
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}{path}", json=body, headers={**KEY, "X-Request-Id": "r-1"}) as r,
    ):
        reply = await r.json()
        assert (r.status, reply["error"]["param"], reply["error"]["code"]) == (status, param, code), reply
        assert r.headers["X-Request-Id"] == "r-1"
        assert _conforms(SCHEMAS["Error"], reply)
        if status == 503:
            assert r.headers["Retry-After"] == "2"


async def test_bad_json_and_missing_keys_are_refused_before_the_service(rest: tuple[FakeTokens, str]) -> None:
    service, url = rest
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/tokenize", data=b"{", headers=KEY) as r:
            assert r.status == 400
            assert "not valid JSON" in (await r.json())["error"]["message"]
        async with http.post(f"{url}/detokenize", json={"model": "base", "tokens": [1]}) as r:
            assert r.status == 401
    assert service.seen == []


async def test_without_a_token_service_the_routes_answer_404() -> None:
    gateway = FakeGateway()
    async with RestServer(gateway, port=0, model_name="smol") as server:
        status, reply = await _post(f"http://127.0.0.1:{server.port}/tokenize", {"model": "base", "prompt": "x"})
    assert (status, reply["error"]["code"]) == (404, "not_found")
