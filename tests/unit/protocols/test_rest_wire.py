"""REST edge cases found by black-box testing as an OpenAI / vLLM client: raw HTTP against the in-process server."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from protocols.rest import RestServer
from protocols.rest_input import FieldError, parse_chat, parse_completion
from tests.unit.protocols.test_rest import KEY, FakeGateway


@pytest.fixture
async def url() -> AsyncIterator[str]:
    gateway = FakeGateway()
    server = RestServer(gateway, port=0, max_body_bytes=4096, request_timeout_s=30, model_name="smol", health=gateway)
    async with server:
        yield f"http://127.0.0.1:{server.port}"


async def _raw(port: int, request: bytes) -> tuple[bytes, bytes]:
    """Send raw bytes on one connection; return (what came back, what a second request on it got)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
        first = head + await reader.readexactly(length)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer good\r\n\r\n")
        await writer.drain()
        second = await asyncio.wait_for(reader.read(65536), 5)
    finally:
        writer.close()
    return first, second


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_its_content_encoding_cannot_decode_is_a_400_and_closes(
    url: str, encoding: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Once a 500 "internal error" with a traceback logged, and the connection dropped without a word (a keep-alive
    # client's next request failed with a broken pipe).
    body = b'{"model": "base", "prompt": "hi"}'  # plain JSON, labelled compressed
    port = int(url.rsplit(":", 1)[1])
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer good\r\nX-Request-Id: zip-1\r\n"
        f"Content-Type: application/json\r\nContent-Encoding: {encoding}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with caplog.at_level(logging.ERROR):
        first, second = await _raw(port, request)
    head, _, payload = first.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), first
    headers = head.lower().split(b"\r\n")
    assert b"connection: close" in headers and b"x-request-id: zip-1" in headers
    error = json.loads(payload)["error"]
    assert error["type"] == "invalid_request_error" and encoding in error["message"]
    assert second == b""  # closed, as announced
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_a_gzip_body_is_read(url: str) -> None:
    body = gzip.compress(json.dumps({"model": "base", "prompt": "hi"}).encode())
    headers = {**KEY, "Content-Encoding": "gzip", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/completions", data=body, headers=headers) as r:
        assert r.status == 200 and (await r.json())["choices"][0]["text"] == 'Hello "quoted"\n'


@pytest.mark.parametrize("model", ["base", "smol", "pirate", "base:pirate"])
async def test_every_model_name_a_completion_accepts_can_be_retrieved(url: str, model: str) -> None:
    # "smol" (the base model's own name) and "base:pirate" were served by /v1/chat/completions but 404 here, so a
    # client that checks models.retrieve(model) before use refused a model it could use.
    async with aiohttp.ClientSession() as http, http.get(f"{url}/v1/models/{model}", headers=KEY) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["id"] == model


@pytest.mark.parametrize("model", ["ghost", "base:ghost", "base:"])
async def test_unknown_models_are_still_404(url: str, model: str) -> None:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/v1/models/{model}", headers=KEY) as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/chat/completions", 405),
        ("DELETE", "/v1/models", 405),
        ("POST", "/v1/nowhere", 404),
        ("GET", "/v1/models/ghost", 404),
    ],
)
async def test_refusals_echo_the_request_id(url: str, method: str, path: str, status: int) -> None:
    # 401 and 400 replies echoed X-Request-Id; 404 and 405 did not (OpenAI's errors all carry one).
    headers = {**KEY, "X-Request-Id": "mine-1"}
    async with aiohttp.ClientSession() as http, http.request(method, f"{url}{path}", headers=headers) as r:
        assert r.status == status and r.headers.get("X-Request-Id") == "mine-1"
        assert set((await r.json())["error"]) == {"message", "type", "param", "code"}


# vLLM's sampling extensions the engine has no knob for: anything but their no-op value would change the answer
# unannounced. They were ignored silently. (repetition_penalty, min_p, min_tokens and the stop options are
# honoured: test_rest_logits, test_rest_stops.)
_VLLM_EXTRAS: list[tuple[str, Any, Any]] = [
    ("use_beam_search", True, False),
    ("guided_whitespace_pattern", "[ ]?", None),
    ("structured_outputs", {"choice": ["yes", "no"]}, None),
]


@pytest.mark.parametrize(("name", "value", "no_op"), _VLLM_EXTRAS)
@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_vllm_sampling_extras_are_refused_unless_no_op(parse: Any, name: str, value: Any, no_op: Any) -> None:
    base = {"model": "base", "messages": [{"role": "user", "content": "x"}], "prompt": "x"}
    with pytest.raises(FieldError) as refused:
        parse({**base, name: value}, "smol")
    assert refused.value.param == name and "not supported" in refused.value.message
    parse({**base, name: no_op}, "smol")


@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_vllm_top_k_minus_one_means_off(parse: Any) -> None:
    # vLLM's own "no top-k" value (its clients, e.g. LangChain's VLLM wrappers, send it by default).
    base = {"model": "base", "messages": [{"role": "user", "content": "x"}], "prompt": "x"}
    assert parse({**base, "top_k": -1}, "smol").sampling.top_k == 0
