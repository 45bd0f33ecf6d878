"""`logprobs` over REST: the request fields, and the reply objects of chat and completions, whole and streamed."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.api import Done, Event, GatewayRequest, TokenChunk, TokenLogprob, TokenLogprobs, Usage
from protocols.rest import RestServer
from tests.unit.protocols.test_rest import KEY, FakeGateway, _chat, _sse

# The scripted completion: (token, its logprob, the chunk it arrives in). The third token is unlikely (outside a
# top 2); the last one completes a stop string, so it comes in a chunk of its own without text.
TOKENS = [("Hel", -0.5, 0), ("lo", -0.25, 1), (' "quoted"\n', -3.0, 1), ("END", -0.125, 2)]
CHUNKS = ["Hel", 'lo "quoted"\n', ""]
ALTERNATIVES = [("alt1", -1.0), ("alt2", -2.0), ("alt3", -math.inf)]


def made_up(token: str, logprob: float, top: int) -> TokenLogprobs:
    """`token`'s entry, its position's `top` most likely tokens taken from it and `ALTERNATIVES`."""
    candidates = sorted([(token, logprob), *ALTERNATIVES], key=lambda c: c[1], reverse=True)
    entry = [TokenLogprob(t, t.encode(), v) for t, v in candidates[:top]]
    return TokenLogprobs(TokenLogprob(token, token.encode(), logprob), tuple(entry))


class LogprobsGateway(FakeGateway):
    """Streams `TOKENS` in `CHUNKS`, with made-up log-probabilities when the request asks for them."""

    async def submit(self, request: GatewayRequest) -> AsyncIterator[Event]:
        self.requests.append(request)
        top = request.sampling.logprobs
        for i, text in enumerate(CHUNKS):
            tokens = [t for t in TOKENS if t[2] == i]
            entries = () if top is None else tuple(made_up(t, v, top) for t, v, _ in tokens)
            yield TokenChunk(text, len(tokens), None, entries)
        yield Done("stop", Usage(3, len(TOKENS)))


@pytest.fixture
async def served() -> AsyncIterator[tuple[LogprobsGateway, str]]:
    gateway = LogprobsGateway()
    async with RestServer(gateway, port=0, model_name="smol", health=gateway) as server:
        yield gateway, f"http://127.0.0.1:{server.port}"


async def _post(url: str, path: str, body: dict[str, Any]) -> Any:
    async with aiohttp.ClientSession(headers=KEY) as http, http.post(f"{url}{path}", json=body) as r:
        assert r.status == 200, await r.text()
        return await _sse(r) if body.get("stream") else await r.json()


def _chat_entry(token: str, logprob: float, top: int) -> dict[str, Any]:
    entry = made_up(token, logprob, top)
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)} for t in entry.top],
    }


async def test_chat_logprobs_whole_and_streamed(served: tuple[LogprobsGateway, str]) -> None:
    gateway, url = served
    body = _chat(logprobs=True, top_logprobs=2)
    whole = await _post(url, "/v1/chat/completions", body)
    assert gateway.requests[0].sampling.logprobs == 2
    expected = [_chat_entry(token, logprob, 2) for token, logprob, _ in TOKENS]
    assert whole["choices"][0]["logprobs"] == {"content": expected}
    assert expected[2]["top_logprobs"][0]["token"] == "alt1"  # the sampled token is not among its top 2
    chunks = await _post(url, "/v1/chat/completions", {**body, "stream": True})
    role, *texts, last = chunks
    assert role["choices"][0]["logprobs"] is None and last["choices"][0]["logprobs"] is None
    # Each chunk carries its own tokens' entries, the one without text too.
    assert [c["choices"][0]["delta"]["content"] for c in texts] == CHUNKS
    assert [c["choices"][0]["logprobs"]["content"] for c in texts] == [expected[:1], expected[1:3], expected[3:]]


async def test_completion_logprobs_whole_and_streamed(served: tuple[LogprobsGateway, str]) -> None:
    _, url = served
    body = {"model": "base", "prompt": "x", "logprobs": 2}
    whole = (await _post(url, "/v1/completions", body))["choices"][0]["logprobs"]
    assert whole == {
        "tokens": ["Hel", "lo", ' "quoted"\n', "END"],
        "token_logprobs": [-0.5, -0.25, -3.0, -0.125],
        # The 2 most likely, and the sampled token where it is not one of them (as OpenAI and vLLM send it).
        "top_logprobs": [
            {"Hel": -0.5, "alt1": -1.0},
            {"lo": -0.25, "alt1": -1.0},
            {"alt1": -1.0, "alt2": -2.0, ' "quoted"\n': -3.0},
            {"END": -0.125, "alt1": -1.0},
        ],
        "text_offset": [0, 3, 5, 15],  # 'Hello "quoted"\n': END comes after all 15 characters
    }
    chunks = await _post(url, "/v1/completions", {**body, "stream": True})
    parts = [c["choices"][0]["logprobs"] for c in chunks[:-1]]
    assert chunks[-1]["choices"][0]["logprobs"] is None  # the closing chunk has no token
    assert [len(p["tokens"]) for p in parts] == [1, 2, 1]
    assert {key: [v for p in parts for v in p[key]] for key in whole} == whole


async def test_no_top_tokens_asked_lists_none_beside_the_sampled_one(served: tuple[LogprobsGateway, str]) -> None:
    gateway, url = served
    chat = await _post(url, "/v1/chat/completions", _chat(logprobs=True))
    content = chat["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in content] == [v for _, v, _ in TOKENS] and all(
        e["top_logprobs"] == [] for e in content
    )
    completion = await _post(url, "/v1/completions", {"model": "base", "prompt": "x", "logprobs": 0})
    assert completion["choices"][0]["logprobs"]["top_logprobs"] == [{t: v} for t, v, _ in TOKENS]
    assert [r.sampling.logprobs for r in gateway.requests] == [0, 0]


async def test_unasked_logprobs_are_null_and_not_asked_of_the_engine(served: tuple[LogprobsGateway, str]) -> None:
    gateway, url = served
    off = [_chat(), _chat(logprobs=False, top_logprobs=0), _chat(stream=True)]
    replies = [await _post(url, "/v1/chat/completions", body) for body in off]
    for stream in (False, True):
        replies.append(await _post(url, "/v1/completions", {"model": "base", "prompt": "x", "stream": stream}))
    choices = [r["choices"][0] for r in replies if isinstance(r, dict)]
    choices += [c["choices"][0] for r in replies if isinstance(r, list) for c in r]
    assert len(choices) == 3 + 5 + 4 and all(c["logprobs"] is None for c in choices)  # 3 whole, 2 streams
    assert [r.sampling.logprobs for r in gateway.requests] == [None] * 5


async def test_a_token_the_model_rules_out_has_openais_floor_not_minus_infinity(
    served: tuple[LogprobsGateway, str],
) -> None:
    _, url = served
    async with aiohttp.ClientSession(headers=KEY) as http:
        body = _chat(logprobs=True, top_logprobs=4)
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            raw = await r.text()
    assert "Infinity" not in raw and "NaN" not in raw
    top = json.loads(raw)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert [(t["token"], t["logprob"]) for t in top] == [
        ("Hel", -0.5),
        ("alt1", -1.0),
        ("alt2", -2.0),
        ("alt3", -9999.0),
    ]


LIMIT = "Requested sample logprobs of 21, which is greater than max allowed: 20"
PROMPT_LIMIT = "Requested prompt logprobs of 21, which is greater than max allowed: 20"


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=21), "top_logprobs", LIMIT),
        ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=-1), "top_logprobs", "at least 0"),
        ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=2.0), "top_logprobs", "must be an integer"),
        ("/v1/chat/completions", _chat(top_logprobs=2), "top_logprobs", "needs logprobs to be true"),
        ("/v1/chat/completions", _chat(logprobs=False, top_logprobs=1), "top_logprobs", "needs logprobs to be true"),
        ("/v1/chat/completions", _chat(logprobs="true"), "logprobs", "true or false"),
        ("/v1/chat/completions", _chat(logprobs=1), "logprobs", "true or false"),
        ("/v1/completions", {"model": "base", "prompt": "x", "logprobs": 21}, "logprobs", LIMIT),
        ("/v1/completions", {"model": "base", "prompt": "x", "logprobs": -1}, "logprobs", "at least 0"),
        ("/v1/completions", {"model": "base", "prompt": "x", "logprobs": True}, "logprobs", "must be an integer"),
        ("/v1/completions", {"model": "base", "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", PROMPT_LIMIT),
    ],
)
async def test_out_of_range_logprobs_are_400s_naming_the_field(
    served: tuple[LogprobsGateway, str], path: str, body: dict[str, Any], param: str, message: str
) -> None:
    gateway, url = served
    async with aiohttp.ClientSession(headers=KEY) as http, http.post(f"{url}{path}", json=body) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert message in error["message"] and gateway.requests == []
