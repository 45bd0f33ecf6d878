"""`n` choices through the REST layer over the real gateway core and fast engine fixtures."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from bench.fast_engine import FastEngineFixture, FastEngineOptions
from gateway.api import Error, Event, GatewayRequest, PolicyDecision, PolicyInput, TokenChunk
from gateway.core import Gateway
from gateway.errors import Status
from gateway.registry import AdapterInstance, AdapterVersion, Registry
from protocols.rest import RestServer
from protocols.rest_choices import choice_requests, merged_events
from tests.support.gateways import serving_gateway
from tests.support.waiting import until
from tests.unit.protocols.test_rest import KEY, FakeGateway

TENANTS: list[dict[str, Any]] = [
    {"name": "t1", "plain_api_keys": ["good"]},
    {"name": "tight", "plain_api_keys": ["tight-key"], "limits": {"max_queue_depth": 1}},
]
TIGHT = {"Authorization": "Bearer tight-key"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class AllowFirst:
    """A policy (a quota, say) that allows its first `allowed` checks and denies the rest."""

    def __init__(self, allowed: int) -> None:
        self.allowed = allowed

    async def check(self, item: PolicyInput) -> PolicyDecision:
        self.allowed -= 1
        return PolicyDecision(self.allowed >= 0, "quota used up")


class FailsLater(FakeGateway):
    """Every choice starts; once released, choice 1 fails and the others would run on until closed."""

    async def submit(self, request: GatewayRequest) -> AsyncIterator[Event]:
        self.requests.append(request)
        try:
            yield TokenChunk("partial ")
            await self.release.wait()
            if request.request_id.endswith("-1"):
                yield Error(Status.UNAVAILABLE, "engine replica engine-0 unavailable")
            await asyncio.Event().wait()
        finally:
            self.closed.append(request.request_id)


@asynccontextmanager
async def _served(
    engine: FastEngineFixture, *, capacity: int = 8, policy: Any = None
) -> AsyncIterator[tuple[Gateway, str]]:
    registry = Registry.open(":memory:")
    versions = (AdapterVersion("v1", "/adapters/pirate/v1", 50), AdapterVersion("v2", "/adapters/pirate/v2", 50))
    registry.apply(AdapterInstance(name="pirate", base_model="smollm2", versions=versions))
    addresses = [f"127.0.0.1:{engine.port}"]
    async with serving_gateway(addresses, registry, TENANTS, capacity=capacity, policy=policy) as gateway:
        async with RestServer(gateway, port=0, model_name="smol") as server:
            yield gateway, f"http://127.0.0.1:{server.port}"
    registry.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _body(path: str, **kw: Any) -> dict[str, Any]:
    if path == CHAT:
        return {"model": "base", "messages": [{"role": "user", "content": "hello there"}], **kw}
    return {"model": "base", "prompt": "hello there", **kw}


def _client_ids(engine: FastEngineFixture) -> list[str]:
    """The request ids behind the engine calls (the core calls `<tenant>/<id>#<call>`)."""
    return [r.request_id.split("/", 1)[1].rsplit("#", 1)[0] for r in engine.requests_seen]


def _idle(gateway: Gateway, engine: FastEngineFixture, tenant: str = "t1") -> bool:
    stats = gateway.queue_stats()[tenant]
    in_flight = (stats.depth, stats.in_flight_requests, stats.in_flight_tokens, gateway.pool.replicas[0].in_flight)
    return not engine.active and in_flight == (0, 0, 0, 0)


async def _sse(response: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    text = await response.text()
    blocks = [block for block in text.split("\n\n") if block]
    assert blocks[-1] == "data: [DONE]" and text.count("[DONE]") == 1
    return [json.loads(block.removeprefix("data: ")) for block in blocks[:-1]]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_whole_reply_has_n_choices_and_the_prompt_counted_once(http: aiohttp.ClientSession, path: str) -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=4)) as engine, _served(engine) as (gateway, url):
        engine.record_requests = True
        logprobs: dict[str, Any] = {"logprobs": True, "top_logprobs": 2} if path == CHAT else {"logprobs": 2}
        headers = {**KEY, "X-Request-Id": "req-n"}
        async with http.post(f"{url}{path}", json=_body(path, n=3, seed=7, **logprobs), headers=headers) as r:
            assert r.status == 200 and r.headers["X-Request-Id"] == "req-n"
            reply = await r.json()
        async with http.post(f"{url}{path}", json=_body(path), headers=KEY) as r:
            single = await r.json()
        assert reply["id"].endswith("-req-n")
        assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
        for choice in reply["choices"]:
            text = choice["message"]["content"] if path == CHAT else choice["text"]
            assert text == "tok " * 4 and choice["finish_reason"] == "stop"
            entries = choice["logprobs"]["content"] if path == CHAT else choice["logprobs"]["tokens"]
            assert len(entries) == 4
        prompt = single["usage"]["prompt_tokens"]
        assert reply["usage"] == {
            "prompt_tokens": prompt,
            "completion_tokens": 12,
            "total_tokens": prompt + 12,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        # One engine request per choice, each with an id of its own and seed + i; the reply keeps the client's id.
        assert _client_ids(engine)[:3] == ["req-n-0", "req-n-1", "req-n-2"]
        assert [r.sampling.seed for r in engine.requests_seen[:3]] == [7, 8, 9]
        assert not engine.requests_seen[3].sampling.HasField("seed")
        assert _idle(gateway, engine)


async def test_choices_without_a_seed_stay_unseeded_and_share_one_adapter_version(http: aiohttp.ClientSession) -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=2)) as engine, _served(engine) as (gateway, url):
        engine.record_requests = True
        for _ in range(3):
            async with http.post(f"{url}{CHAT}", json=_body(CHAT, model="pirate", n=16), headers=KEY) as r:
                assert r.status == 200
                assert len((await r.json())["choices"]) == 16
            # pirate has two versions at 50% each: without one routing key, 16 choices would scatter over both.
            seen = engine.requests_seen[-16:]
            assert len({request.adapter for request in seen}) == 1
            assert not any(request.sampling.HasField("seed") for request in seen)
            assert _idle(gateway, engine)


async def test_a_stream_interleaves_the_choices_and_ends_each_then_the_request(http: aiohttp.ClientSession) -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=6, delay_s=0.01)) as engine:
        async with _served(engine) as (gateway, url):
            body = _body(CHAT, n=2, stream=True, stream_options={"include_usage": True})
            async with http.post(f"{url}{CHAT}", json=body, headers=KEY) as r:
                assert r.status == 200
                chunks = await _sse(r)
            *choices, usage = chunks
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
            assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 12
            assert all(len(c["choices"]) == 1 and "usage" not in c for c in choices)
            order = [c["choices"][0]["index"] for c in choices]
            # Each choice's role chunk comes first, then text of both as it comes, not one after the other.
            assert order[:2] == [0, 1] and all(c["choices"][0]["delta"]["role"] == "assistant" for c in choices[:2])
            texts = [c for c in choices[2:] if c["choices"][0]["delta"].get("content")]
            text_order = [c["choices"][0]["index"] for c in texts]
            assert text_order != sorted(text_order)
            for index in (0, 1):
                mine = [c["choices"][0] for c in choices if c["choices"][0]["index"] == index]
                assert "".join(c["delta"].get("content", "") for c in mine) == "tok " * 6
                assert [c["finish_reason"] for c in mine].count("stop") == 1 and mine[-1]["finish_reason"] == "stop"
            await until(lambda: _idle(gateway, engine))


async def test_a_completion_stream_names_each_choice(http: aiohttp.ClientSession) -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=3)) as engine, _served(engine) as (_, url):
        async with http.post(f"{url}{COMPLETIONS}", json=_body(COMPLETIONS, n=3, stream=True), headers=KEY) as r:
            chunks = await _sse(r)
        for index in (0, 1, 2):
            mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
            assert "".join(c["text"] for c in mine) == "tok " * 3
            assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["stop"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_choice_over_the_queue_limit_refuses_the_request_and_stops_the_others(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    # One engine slot and a queue of one: choice 0 runs, choice 1 waits, choice 2 is over the tenant's limit.
    async with FastEngineFixture(FastEngineOptions(chunks=1000, delay_s=0.01)) as engine:
        engine.record_requests = True
        async with _served(engine, capacity=1) as (gateway, url):
            headers = {**TIGHT, "X-Request-Id": "three"}
            async with http.post(f"{url}{CHAT}", json=_body(CHAT, n=3, stream=stream), headers=headers) as r:
                assert r.status == 429 and r.headers["Content-Type"].startswith("application/json")
                assert int(r.headers["Retry-After"]) >= 1
                error = (await r.json())["error"]
            assert error["type"] == "rate_limit_error" and "requests queued (limit 1)" in error["message"]
            # Choice 0 is cut short (if its engine call had started at all); the waiting one never runs.
            assert set(_client_ids(engine)) <= {"three-0"}
            await until(lambda: _idle(gateway, engine, "tight"), timeout_s=2)
            await asyncio.sleep(0.1)
            assert _idle(gateway, engine, "tight") and engine.tokens_generated < 100


async def test_a_choice_the_policy_denies_refuses_the_request_and_stops_the_others(
    http: aiohttp.ClientSession,
) -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=1000, delay_s=0.01)) as engine:
        engine.record_requests = True
        async with _served(engine, policy=AllowFirst(1)) as (gateway, url):
            async with http.post(f"{url}{CHAT}", json=_body(CHAT, n=2, stream=True), headers=KEY) as r:
                assert r.status == 403
                assert (await r.json())["error"]["message"] == "quota used up"
            await until(lambda: _idle(gateway, engine), timeout_s=2)
            await asyncio.sleep(0.1)
            assert _idle(gateway, engine) and engine.tokens_generated < 100


async def test_a_client_gone_mid_stream_stops_every_choice(http: aiohttp.ClientSession) -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=1000, delay_s=0.01)) as engine:
        engine.record_requests = True
        async with _served(engine) as (gateway, url):
            r = await http.post(f"{url}{CHAT}", json=_body(CHAT, n=3, stream=True), headers=KEY)
            assert r.status == 200
            await r.content.readline()
            await until(lambda: len(engine.active) == 3)
            r.close()
            # Left running, the choices would take 10 s (1000 chunks 10 ms apart); 2 s was too tight on a
            # loaded 2-core machine, where the gateway sees the closed socket at its next write.
            # The Aborts go out in the background: the streams' cancellation alone may idle the engine first.
            await until(lambda: _idle(gateway, engine) and len(engine.aborted) == 3, timeout_s=8)
            assert len(engine.aborted) == 3 and engine.tokens_generated < 3000


async def test_an_error_mid_stream_ends_the_stream_of_every_choice(
    http: aiohttp.ClientSession,
) -> None:
    gateway = FailsLater()
    async with RestServer(gateway, port=0, model_name="smol") as server:
        body = _body(CHAT, n=2, stream=True)
        headers = {**KEY, "X-Request-Id": "mid"}
        async with http.post(f"http://127.0.0.1:{server.port}{CHAT}", json=body, headers=headers) as r:
            assert r.status == 200  # both choices started
            gateway.release.set()
            *chunks, error = await _sse(r)
    assert error["error"]["code"] == "unavailable"
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)  # no choice ends as if it were complete
    assert sorted(gateway.closed) == ["mid-0", "mid-1"]


async def test_each_choice_takes_a_place_in_the_tenants_queue(http: aiohttp.ClientSession) -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=1000, delay_s=0.01)) as engine:
        async with _served(engine, capacity=1) as (gateway, url):
            busy = asyncio.create_task(http.post(f"{url}{CHAT}", json=_body(CHAT), headers=KEY))
            await until(lambda: len(engine.active) == 1)  # holds the only engine slot
            waiting = asyncio.create_task(http.post(f"{url}{CHAT}", json=_body(CHAT, n=3), headers=KEY))
            await until(lambda: gateway.queue_stats()["t1"].depth == 3)
            for task in (busy, waiting):
                task.cancel()
            await asyncio.gather(busy, waiting, return_exceptions=True)
            await until(lambda: _idle(gateway, engine), timeout_s=2)


async def test_a_drain_cut_ends_a_stream_of_several_choices_with_its_error(http: aiohttp.ClientSession) -> None:
    gateway = FakeGateway()
    server = RestServer(gateway, port=0, drain_timeout_s=0.3, model_name="smol")
    await server.__aenter__()
    try:
        body = _body(CHAT, model="slow", n=2, stream=True)
        headers = {**KEY, "X-Request-Id": "cut"}
        streamed = await http.post(f"http://127.0.0.1:{server.port}{CHAT}", json=body, headers=headers)
        assert streamed.status == 200
    finally:
        await server.__aexit__(None, None, None)  # gateway.release is never set: the drain times out
    *chunks, error = await _sse(streamed)
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    assert error["error"]["code"] == "unavailable"
    assert sorted(gateway.closed) == ["cut-0", "cut-1"]


async def test_a_choice_whose_events_fail_is_raised_not_dropped() -> None:
    # A reply must never go on without one choice's events.
    async def submit(request: GatewayRequest) -> AsyncIterator[Event]:
        if request.request_id.endswith("-1"):
            raise RuntimeError("a bug in choice 1")
        yield TokenChunk("tok", 1)

    requests = choice_requests(GatewayRequest(request_id="r", tenant="t", adapter=None, prompt="hi"), 2)
    with pytest.raises(RuntimeError, match="a bug in choice 1"):
        async for _ in merged_events(submit, requests):
            pass
