from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.api import Done, Error, Event, GatewayRequest, Origin, TokenChunk, Usage
from gateway.errors import Status, Unauthenticated
from protocols.rest import RestServer
from tests.support.waiting import until

KEY = {"Authorization": "Bearer good"}


class FakeGateway:
    """A scripted Submitter: behaviour is chosen by the adapter name of the request."""

    def __init__(self) -> None:
        self.requests: list[GatewayRequest] = []
        self.release = asyncio.Event()
        self.closed: list[str] = []
        self.ready = (True, "1/1 engine replicas healthy")
        self.refusals: list[tuple[str | None, Status]] = []

    def authenticate(self, api_key: str | None) -> str:
        if api_key is None:
            raise Unauthenticated("missing API key")
        if api_key != "good":
            raise Unauthenticated("invalid API key")
        return "t1"

    def models_for(self, tenant: str) -> list[str]:
        return ["base", "pirate"]

    def refused(self, tenant: str | None, status: Status, origin: Origin) -> None:
        self.refusals.append((tenant, status))

    def health(self) -> tuple[bool, str]:
        return self.ready

    async def submit(self, request: GatewayRequest) -> AsyncIterator[Event]:
        self.requests.append(request)
        try:
            if request.adapter == "nope":
                yield Error(Status.NOT_FOUND, "adapter 'nope' not found")
            elif request.adapter == "busy":
                yield Error(Status.RESOURCE_EXHAUSTED, "tenant 't1' has 64 requests queued", 2.5)
            elif request.adapter == "midfail":
                yield TokenChunk("partial")
                yield Error(Status.UNAVAILABLE, "engine replica engine-0 unavailable")
            else:
                if request.adapter == "slow":
                    yield TokenChunk("waiting ")
                    await self.release.wait()
                yield TokenChunk("Hel", 1, "v1" if request.adapter else None)  # the first chunk names it
                yield TokenChunk('lo "quoted"\n', 2)
                yield Done("stop", Usage(3, 3), "v1" if request.adapter else None)
        finally:
            self.closed.append(request.request_id)


@pytest.fixture
async def rest() -> AsyncIterator[tuple[RestServer, FakeGateway, str]]:
    gateway = FakeGateway()
    server = RestServer(
        gateway, port=0, max_body_bytes=4096, request_timeout_s=30, drain_timeout_s=5, model_name="smol", health=gateway
    )
    async with server:
        yield server, gateway, f"http://127.0.0.1:{server.port}"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": "base", "messages": [{"role": "user", "content": "hi"}], **kw}


async def _sse(response: aiohttp.ClientResponse) -> list[Any]:
    text = await response.text()
    assert text.endswith("data: [DONE]\n\n")
    events = [block for block in text.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in events)
    return [json.loads(block[6:]) for block in events[:-1]]


async def test_chat_completion(rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession) -> None:
    _, gateway, url = rest
    body = _chat(model="base:pirate", max_tokens=8, temperature=0, top_p=0.5, stop="END", seed=7, user="u1")
    headers = {**KEY, "X-Request-Id": "req-1", "X-Routing-Key": "k9"}
    sent = time.monotonic()
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200
        assert r.headers["X-Request-Id"] == "req-1"
        assert r.headers["X-Adapter-Version"] == "v1"
        reply = await r.json()
    answered = time.monotonic()
    assert reply["object"] == "chat.completion" and reply["id"] == "chatcmpl-req-1"
    assert reply["model"] == "base:pirate"
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": 'Hello "quoted"\n'}
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    seen = gateway.requests[0]
    assert (seen.request_id, seen.tenant, seen.adapter, seen.routing_key) == ("req-1", "t1", "pirate", "k9")
    assert seen.messages is not None and seen.messages[0].content == "hi" and seen.prompt is None
    s = seen.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.stop, s.seed) == (8, 0.0, 0.5, ("END",), 7)
    # request_timeout_s (30) from when the server took the request, however long the round trip took.
    assert seen.deadline is not None and sent + 30 <= seen.deadline <= answered + 30


async def test_completion_routing_key_defaults_to_user(
    rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession
) -> None:
    _, gateway, url = rest
    body = {"model": "smol", "prompt": ["once"], "user": "u7"}
    async with http.post(f"{url}/v1/completions", json=body, headers=KEY) as r:
        reply = await r.json()
    assert reply["object"] == "text_completion" and reply["choices"][0]["text"] == 'Hello "quoted"\n'
    seen = gateway.requests[0]
    assert (seen.adapter, seen.prompt, seen.routing_key, len(seen.request_id)) == (None, "once", "u7", 32)


async def test_chat_stream_with_usage(rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession) -> None:
    _, _, url = rest
    body = _chat(model="pirate", stream=True, stream_options={"include_usage": True})
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=KEY) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["X-Adapter-Version"] == "v1"  # streams had no way to tell which version served them
        chunks = await _sse(r)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "pirate" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == 'Hello "quoted"\n'
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 6


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_stream_ids_stay_valid_json_whatever_the_request_id(
    rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession, path: str
) -> None:
    # X-Request-Id may hold any printable ASCII; it once went into the SSE chunks' JSON unescaped.
    _, _, url = rest
    body = _chat(stream=True) if "chat" in path else {"model": "base", "prompt": "x", "stream": True}
    async with http.post(f"{url}{path}", json=body, headers={**KEY, "X-Request-Id": 'r"1\\'}) as r:
        assert r.headers["X-Request-Id"] == 'r"1\\'
        assert "X-Adapter-Version" not in r.headers  # the base model has no version
        chunks = await _sse(r)
    prefix = "chatcmpl-" if "chat" in path else "cmpl-"
    assert chunks and all(c["id"] == prefix + 'r"1\\' for c in chunks)


async def test_completion_stream_without_usage(
    rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession
) -> None:
    _, _, url = rest
    async with http.post(
        f"{url}/v1/completions", json={"model": "base", "prompt": "x", "stream": True}, headers=KEY
    ) as r:
        chunks = await _sse(r)
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", 'lo "quoted"\n', ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "usage" not in chunks[-1]


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/chat/completions", b"{not json", None, "not valid JSON"),
        ("/v1/chat/completions", b"", None, "body is empty"),
        ("/v1/chat/completions", b"[1, 2]", None, "must be a JSON object"),
        ("/v1/chat/completions", b"[" * 2000 + b"]" * 2000, None, "nested too deeply"),
        ("/v1/chat/completions", b'{"model": "base", "x": "\xff"}', None, "not valid JSON"),
        ("/v1/chat/completions", _chat(temperature=float("nan")), "temperature", "must be a number"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "model", "model is required"),
        ("/v1/chat/completions", {"model": "base"}, "messages", "messages must be a non-empty array"),
        ("/v1/chat/completions", _chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role", "role"),
        ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "content"),
        ("/v1/chat/completions", _chat(n=17), "n", "n must be at most 16, got 17"),
        ("/v1/chat/completions", _chat(cache_salt=""), "cache_salt", "cache_salt must be a non-empty string"),
        ("/v1/chat/completions", _chat(cache_salt=7), "cache_salt", "cache_salt must be a non-empty string"),
        ("/v1/completions", {"model": "base", "prompt": "x", "cache_salt": "s" * 1025}, "cache_salt", "at most 1024"),
        ("/v1/chat/completions", _chat(n=0), "n", "n must be at least 1, got 0"),
        ("/v1/chat/completions", _chat(n=2.0), "n", "n must be an integer"),
        ("/v1/completions", {"model": "base", "prompt": "x", "n": 100}, "n", "n must be at most 16, got 100"),
        ("/v1/completions", {"model": "base", "prompt": "x", "n": 2, "best_of": 2}, "best_of", "use n for several"),
        ("/v1/chat/completions", _chat(temperature="hot"), "temperature", "must be a number"),
        ("/v1/chat/completions", _chat(temperature=3), "temperature", "between 0 and 2"),
        ("/v1/chat/completions", _chat(max_tokens=0), "max_tokens", "at least 1"),
        ("/v1/chat/completions", _chat(max_tokens=True), "max_tokens", "must be an integer"),
        ("/v1/chat/completions", _chat(stop=["a"] * 5), "stop", "at most 4"),
        ("/v1/chat/completions", _chat(stream="yes"), "stream", "true or false"),
        ("/v1/chat/completions", _chat(tools=[{"type": "function"}]), "tools", "not supported"),
        ("/v1/chat/completions", _chat(model="base:"), "model", "names no adapter"),
        ("/v1/completions", {"model": "base", "prompt": [1, 2]}, "prompt", "send exactly one prompt"),
        ("/v1/completions", {"model": "base", "prompt": [[1, 2]]}, "prompt", "token-id prompts"),
        ("/v1/chat/completions", _chat(echo=True), "echo", "not supported on chat completions"),
        ("/v1/completions", {"model": "base", "prompt": "x", "max_tokens": 0}, "max_tokens", "at least 1"),
        ("/v1/completions", {"model": "base", "prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens", "least 0"),
        ("/v1/completions", {"model": "base", "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "max allowed"),
        ("/v1/completions", {"model": "base", "prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs", "at least 0"),
        ("/v1/completions", {"model": "base", "prompt": "x", "prompt_logprobs": True}, "prompt_logprobs", "integer"),
        ("/v1/completions", {"model": "base", "prompt": "x", "prompt_logprobs": 1.5}, "prompt_logprobs", "integer"),
        ("/v1/chat/completions", _chat(prompt_logprobs="2"), "prompt_logprobs", "must be an integer"),
        ("/v1/chat/completions", _chat(prompt_logprobs=1, stream=True), "prompt_logprobs", "not available when"),
        (
            "/v1/completions",
            {"model": "base", "prompt": "x", "prompt_logprobs": 3, "stream": True},
            "prompt_logprobs",
            "`stream=True`",
        ),
        # Shapes that once escaped validation and crashed a handler (500) or the engine call.
        ("/v1/chat/completions", _chat(messages=[{"role": ["user"], "content": "x"}]), "messages[0].role", "role"),
        ("/v1/chat/completions", _chat(messages=[{"role": {}, "content": "x"}]), "messages[0].role", "role"),
        # Refused by the engine only after the request had waited in the queue.
        ("/v1/chat/completions", _chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].role", "'tool'"),
        ("/v1/chat/completions", _chat(temperature=10**400), "temperature", "between 0 and 2"),
        ("/v1/completions", {"model": "base", "prompt": "x", "top_p": -(10**400)}, "top_p", "between 0 and 1"),
        ("/v1/chat/completions", _chat(seed=-(2**63) - 1), "seed", "at least"),
        ("/v1/chat/completions", _chat(seed=2**64), "seed", "at most"),
        ("/v1/chat/completions", _chat(top_k=2**32), "top_k", "at most"),
        ("/v1/completions", {"model": "base", "prompt": "a\ud800b"}, "prompt", "unpaired surrogate"),
        (
            "/v1/chat/completions",
            _chat(messages=[{"role": "user", "content": "\udc00"}]),
            "messages[0].content",
            "surrogate",
        ),
        ("/v1/chat/completions", _chat(stop=["ok", "\ud800"]), "stop", "unpaired surrogate"),
        # Once unchecked whenever max_completion_tokens was present.
        ("/v1/chat/completions", _chat(max_completion_tokens=5, max_tokens="x"), "max_tokens", "must be an integer"),
        # Once refused whatever their value; now honoured, within OpenAI's and vLLM's ranges.
        ("/v1/chat/completions", _chat(frequency_penalty=2.5), "frequency_penalty", "between -2 and 2"),
        ("/v1/completions", {"model": "base", "prompt": "x", "presence_penalty": -3}, "presence_penalty", "-2 and 2"),
        ("/v1/chat/completions", _chat(logit_bias={"50256": -101}), "logit_bias", "between -100 and 100"),
        ("/v1/chat/completions", _chat(logit_bias={"x": 1}), "logit_bias", "keys must be token ids"),
        ("/v1/chat/completions", _chat(repetition_penalty=0), "repetition_penalty", "greater than 0"),
        ("/v1/chat/completions", _chat(min_p=1.5), "min_p", "between 0 and 1"),
        ("/v1/chat/completions", _chat(min_tokens=6, max_tokens=5), "min_tokens", "at most max_tokens (5)"),
        ("/v1/chat/completions", _chat(tools={}), "tools", "not supported"),
        ("/v1/chat/completions", _chat(top_logprobs=2), "top_logprobs", "needs logprobs to be true"),
        ("/v1/completions", {"model": "base", "prompt": "x", "echo": 0}, "echo", "must be true or false"),
    ],
)
async def test_bad_input_is_a_400_naming_the_problem(
    rest: tuple[RestServer, FakeGateway, str],
    http: aiohttp.ClientSession,
    path: str,
    body: Any,
    param: str | None,
    message: str,
) -> None:
    _, gateway, url = rest
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(f"{url}{path}", data=data, headers={**KEY, "Content-Type": "application/json"}) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"]
    assert gateway.requests == []


async def test_no_op_values_of_unsupported_fields_are_accepted(
    rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession
) -> None:
    _, gateway, url = rest
    no_ops = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none"}
    body = _chat(**no_ops, logprobs=False, top_logprobs=0, max_tokens=9, max_completion_tokens=5)
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=KEY) as r:
        assert r.status == 200
    body = {"model": "base", "prompt": "x", **no_ops, "logprobs": 0, "echo": False, "suffix": "", "best_of": 1}
    del body["tools"], body["tool_choice"]
    async with http.post(f"{url}/v1/completions", json=body, headers=KEY) as r:
        assert r.status == 200
    assert gateway.requests[0].sampling.max_tokens == 5  # max_completion_tokens wins


async def test_a_cache_salt_reaches_the_gateway_request(
    rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession
) -> None:
    _, gateway, url = rest
    async with http.post(f"{url}/v1/chat/completions", json=_chat(cache_salt="s3cret"), headers=KEY) as r:
        assert r.status == 200
    async with http.post(f"{url}/v1/chat/completions", json=_chat(), headers=KEY) as r:
        assert r.status == 200
    assert [request.cache_salt for request in gateway.requests] == ["s3cret", None]


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, "missing API key"),
        ({"Authorization": "Bearer bad"}, "invalid API key"),
        ({"Authorization": "Basic Zm9v"}, "must be 'Bearer <API key>'"),
    ],
)
async def test_authentication_failures_are_401(
    rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession, headers: dict[str, str], message: str
) -> None:
    _, _, url = rest
    async with http.post(f"{url}/v1/chat/completions", json=_chat(), headers=headers) as r:
        assert r.status == 401
        error = (await r.json())["error"]
    assert error["type"] == "authentication_error" and message in error["message"]


async def test_gateway_errors_map_to_http_statuses(
    rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession
) -> None:
    _, _, url = rest
    async with http.post(f"{url}/v1/chat/completions", json=_chat(model="nope", stream=True), headers=KEY) as r:
        assert r.status == 404
        error = (await r.json())["error"]
        assert (error["param"], error["code"], error["type"]) == ("model", "model_not_found", "not_found_error")
    async with http.post(f"{url}/v1/completions", json={"model": "busy", "prompt": "x"}, headers=KEY) as r:
        assert r.status == 429 and r.headers["Retry-After"] == "3"
        assert (await r.json())["error"]["type"] == "rate_limit_error"


async def test_error_after_streaming_started_is_an_sse_error(
    rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession
) -> None:
    _, _, url = rest
    async with http.post(f"{url}/v1/chat/completions", json=_chat(model="midfail", stream=True), headers=KEY) as r:
        assert r.status == 200
        chunks = await _sse(r)
    assert chunks[-1]["error"]["type"] == "service_unavailable"
    assert "engine-0 unavailable" in chunks[-1]["error"]["message"]


async def test_oversized_body_is_413(rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession) -> None:
    _, gateway, url = rest
    body = _chat(messages=[{"role": "user", "content": "x" * 5000}])
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=KEY) as r:
        assert r.status == 413
        assert (await r.json())["error"]["code"] == "payload_too_large"
    assert gateway.requests == []


async def test_unknown_routes_and_methods_are_openai_errors(
    rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession
) -> None:
    _, _, url = rest
    async with http.get(f"{url}/v2/nothing") as r:
        assert r.status == 404 and "no route" in (await r.json())["error"]["message"]
    async with http.get(f"{url}/v1/chat/completions") as r:
        assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"


async def test_models_openapi_and_health(
    rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession
) -> None:
    _, gateway, url = rest
    async with http.get(f"{url}/v1/models", headers=KEY) as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["base", "pirate"]
    async with http.get(f"{url}/v1/models/pirate", headers=KEY) as r:
        assert (await r.json())["id"] == "pirate"
    async with http.get(f"{url}/v1/models/ghost", headers=KEY) as r:
        assert r.status == 404 and (await r.json())["error"]["param"] == "model"
    async with http.get(f"{url}/v1/models") as r:
        assert r.status == 401
    async with http.get(f"{url}/openapi.json") as r:
        spec = await r.json()
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(spec["paths"])
    async with http.get(f"{url}/healthz") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    gateway.ready = (False, "0/1 engine replicas healthy")
    async with http.get(f"{url}/healthz") as r:
        assert r.status == 503 and (await r.json())["detail"] == "0/1 engine replicas healthy"


async def test_request_timeout_header(rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession) -> None:
    _, gateway, url = rest
    sent = time.monotonic()
    async with http.post(
        f"{url}/v1/completions", json={"model": "base", "prompt": "x"}, headers={**KEY, "X-Request-Timeout": "0.5"}
    ) as r:
        assert r.status == 200
    answered = time.monotonic()
    deadline = gateway.requests[0].deadline
    assert deadline is not None and sent + 0.5 <= deadline <= answered + 0.5
    async with http.post(
        f"{url}/v1/completions", json={"model": "base", "prompt": "x"}, headers={**KEY, "X-Request-Timeout": "soon"}
    ) as r:
        assert r.status == 400 and "X-Request-Timeout" in (await r.json())["error"]["message"]


async def test_client_disconnect_closes_the_event_stream(
    rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession
) -> None:
    _, gateway, url = rest
    response = await http.post(
        f"{url}/v1/chat/completions", json=_chat(model="slow", stream=True), headers={**KEY, "X-Request-Id": "leaver"}
    )
    assert response.status == 200
    await response.content.readline()  # first chunk arrived: the request is in the slow phase
    response.close()
    for _ in range(200):
        if "leaver" in gateway.closed:
            break
        await asyncio.sleep(0.01)
    assert gateway.closed == ["leaver"]


async def test_drain_refuses_new_requests_and_waits_for_running_ones(
    rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession
) -> None:
    server, gateway, url = rest
    running = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=_chat(model="slow"), headers=KEY))
    for _ in range(200):
        if gateway.requests:
            break
        await asyncio.sleep(0.01)
    drain = asyncio.create_task(server.drain())
    await asyncio.sleep(0.05)
    async with aiohttp.ClientSession() as other:
        async with other.post(f"{url}/v1/chat/completions", json=_chat(), headers=KEY) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "draining"
        async with other.get(f"{url}/healthz") as r:
            assert r.status == 503
    assert not drain.done()
    gateway.release.set()
    response = await running
    assert response.status == 200 and (await response.json())["choices"][0]["message"]["content"].endswith("\n")
    await asyncio.wait_for(drain, 2)


async def test_protocol_span_parents_the_core_spans(
    rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession, spans: Any
) -> None:
    _, gateway, url = rest
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {**KEY, "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    async with http.post(f"{url}/v1/completions", json={"model": "base", "prompt": "x"}, headers=headers) as r:
        assert r.status == 200
    (span,) = [s for s in spans.get_finished_spans() if s.name == "POST /v1/completions"]
    assert f"{span.context.trace_id:032x}" == trace_id
    handed_on = gateway.requests[0].trace_context["traceparent"]
    assert handed_on == f"00-{trace_id}-{span.context.span_id:016x}-01"


async def test_refusals_before_submit_are_counted_once_with_their_tenant(
    rest: tuple[RestServer, FakeGateway, str], http: aiohttp.ClientSession
) -> None:
    # Requests the REST layer refused itself (bad JSON, bad fields, a malformed Authorization header, an
    # oversized body) never reached the core's count: adaptergate_requests_total did not see any 400.
    _, gateway, url = rest
    chat = f"{url}/v1/chat/completions"
    async with http.post(chat, data=b"{not json", headers={**KEY, "Content-Type": "application/json"}) as r:
        assert r.status == 400
    async with http.post(chat, json=_chat(temperature=9), headers=KEY) as r:
        assert r.status == 400
    async with http.post(chat, json=_chat(), headers={"Authorization": "Basic abc"}) as r:
        assert r.status == 401
    async with http.post(chat, json=_chat(), headers={"Authorization": "Bearer wrong"}) as r:
        assert r.status == 401
    async with http.post(chat, data=b"x" * 8000, headers={**KEY, "Content-Type": "application/json"}) as r:
        assert r.status == 413
    async with http.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}) as r:
        assert r.status == 401  # not an inference request: not counted
    assert gateway.refusals == [
        ("t1", Status.INVALID_ARGUMENT),
        ("t1", Status.INVALID_ARGUMENT),
        (None, Status.UNAUTHENTICATED),
        (None, Status.UNAUTHENTICATED),
        ("t1", Status.INVALID_ARGUMENT),
    ]
    assert gateway.requests == []  # none reached submit, so none is counted twice


async def test_drain_timeout_ends_running_requests_with_an_error_not_a_dropped_connection(
    http: aiohttp.ClientSession,
) -> None:
    gateway = FakeGateway()
    server = RestServer(gateway, port=0, request_timeout_s=30, drain_timeout_s=0.3, model_name="smol")
    await server.__aenter__()
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    try:
        whole = asyncio.create_task(http.post(url, json=_chat(model="slow"), headers={**KEY, "X-Request-Id": "w"}))
        streamed = await http.post(url, json=_chat(model="slow", stream=True), headers={**KEY, "X-Request-Id": "s"})
        assert streamed.status == 200
        await streamed.content.readline()  # its first chunk is out: the stream has started
        await until(lambda: len(gateway.requests) == 2)
    finally:
        await server.__aexit__(None, None, None)  # gateway.release is never set: the drain times out
    response = await whole
    assert response.status == 503
    assert (await response.json())["error"]["code"] == "unavailable"
    rest_of_stream = (await streamed.text()).strip().split("\n\n")  # after the chunk read above
    assert rest_of_stream[-1] == "data: [DONE]"
    assert json.loads(rest_of_stream[-2].removeprefix("data: "))["error"]["code"] == "unavailable"
    assert sorted(gateway.closed) == ["s", "w"]


async def test_a_drain_cut_does_not_swallow_a_cancellation_of_its_own() -> None:
    # The cut's uncancel() ignored the count it returned: a handler cancelled by the drain and, at the same
    # moment, by aiohttp for a client gone away (handler_cancellation) answered as if only the drain had asked.
    server = RestServer(FakeGateway(), port=0, model_name="smol")
    started = asyncio.Event()

    async def endless() -> AsyncIterator[tuple[int, Event]]:
        started.set()
        await asyncio.Event().wait()
        yield 0, TokenChunk("never")

    async def handler() -> list[Event]:
        return [event async for _, event in server._until_cut(endless())]

    cut_alone, cut_and_gone = asyncio.create_task(handler()), asyncio.create_task(handler())
    await started.wait()
    await asyncio.sleep(0)  # both wait inside `endless`
    server._cut = {cut_alone, cut_and_gone}
    cut_alone.cancel()
    cut_and_gone.cancel()  # the drain's cut
    cut_and_gone.cancel()  # the client's disconnect
    events = await cut_alone
    assert len(events) == 1 and isinstance(events[0], Error) and events[0].status is Status.UNAVAILABLE
    with pytest.raises(asyncio.CancelledError):
        await cut_and_gone
