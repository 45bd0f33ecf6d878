from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from bench.fast_engine import FastEngineFixture, FastEngineOptions, fixture_logprobs
from engine import engine_pb2 as pb
from gateway.api import (
    Done,
    GatewayRequest,
    PromptLogprobs,
    SamplingParams,
    TokenChunk,
    TokenLogprob,
    TokenLogprobs,
)
from gateway.engine_client import EnginePool
from gateway.engine_wire import SMALLEST_TOP_P, generate_request
from gateway.errors import InvalidRequest
from gateway.registry import ResolvedAdapter
from gateway.replica import Replica, ReplicaFailed
from tests.conftest import free_port
from tests.support.waiting import until


def _request(rid: str = "r1", max_tokens: int | None = None, prompt: str = "hello there") -> GatewayRequest:
    return GatewayRequest(
        request_id=rid, tenant="t", adapter=None, prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens)
    )


def _adapter(name: str = "pirate", version: str = "v1", source: str = "adapters/pirate") -> ResolvedAdapter:
    return ResolvedAdapter(name, version, source, f"{name}@{version}", pin=True, priority=0)


@pytest.fixture
async def engines() -> AsyncIterator[list[FastEngineFixture]]:
    fixtures = [FastEngineFixture(FastEngineOptions(chunks=4)) for _ in range(2)]
    for f in fixtures:
        await f.start()
    yield fixtures
    for f in fixtures:
        await f.stop(0)


async def _collect(pool: EnginePool, request: GatewayRequest, adapter: ResolvedAdapter | None = None) -> list[object]:
    replica = pool.acquire(adapter.engine_name if adapter else None)
    assert replica is not None
    try:
        return [event async for event in pool.generate(replica, request, adapter)]
    finally:
        pool.release(replica)


async def test_streams_chunks_then_done_with_usage(engines: list[FastEngineFixture]) -> None:
    async with EnginePool([f"127.0.0.1:{engines[0].port}"]) as pool:
        events = await _collect(pool, _request(max_tokens=3))
    assert events[:3] == [TokenChunk("tok ", 1)] * 3
    done = events[3]
    assert isinstance(done, Done) and done.finish_reason == "length" and done.adapter_version is None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (2, 3)


async def test_logprobs_are_asked_for_and_come_back_with_their_chunks(engines: list[FastEngineFixture]) -> None:
    engines[0].record_requests = True
    asked = dataclasses.replace(_request(max_tokens=2), sampling=SamplingParams(max_tokens=2, logprobs=2))
    async with EnginePool([f"127.0.0.1:{engines[0].port}"]) as pool:
        events = await _collect(pool, asked)
        plain = await _collect(pool, _request(max_tokens=2))
    sent = [r.sampling for r in engines[0].requests_seen]
    assert sent[0].HasField("logprobs") and sent[0].logprobs == 2 and not sent[1].HasField("logprobs")
    alt = TokenLogprob("alt1", b"alt1", -1.0, 1001)
    toks = [TokenLogprob("tok ", b"tok ", -0.25, i) for i in range(2)]  # the fixture's ids: each token's index
    assert events[:2] == [TokenChunk("tok ", 1, None, (TokenLogprobs(tok, (tok, alt)),)) for tok in toks]
    assert plain[:2] == [TokenChunk("tok ", 1)] * 2


class _HeldBackEngine(FastEngineFixture):
    """Streams as the engine does around a stop string: a token whose text is held back, then one that
    releases it, then the one that completes the stop string on the final message, without text."""

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        yield pb.GenerateResponse(request_id=request.request_id, admitted=True)
        yield pb.GenerateResponse(token_ids=(0,), logprobs=(fixture_logprobs("E", 0, 1),))
        yield pb.GenerateResponse(text="EN", token_ids=(1,), logprobs=(fixture_logprobs("N", 1, 1),))
        yield pb.GenerateResponse(
            token_ids=(2,),
            logprobs=(fixture_logprobs("D", 2, 1),),
            finish_reason="stop",
            usage=pb.Usage(prompt_tokens=2, completion_tokens=3),
        )


async def test_logprobs_of_held_back_tokens_wait_for_their_text_and_none_is_lost() -> None:
    def entry(token: str, token_id: int) -> TokenLogprobs:
        sampled = TokenLogprob(token, token.encode(), -0.25, token_id)
        return TokenLogprobs(sampled, (sampled,))

    async with _HeldBackEngine() as engine, EnginePool([f"127.0.0.1:{engine.port}"]) as pool:
        events = await _collect(pool, _request())
    assert events[:2] == [
        TokenChunk("EN", 2, None, (entry("E", 0), entry("N", 1))),
        TokenChunk("", 1, None, (entry("D", 2),)),  # the stop string's last token: no text, but its logprobs
    ]
    assert isinstance(events[2], Done) and events[2].usage.completion_tokens == 3


class _PromptLogprobsEngine(FastEngineFixture):
    """Sends a prompt's log-probabilities with its first message past admission, as the engine does: with a token
    whose text is held back, or (max_tokens 0) with the final message."""

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        prompt = pb.PromptLogprobs(
            first=pb.TokenLogprob(token_id=7, token="Hi", token_bytes=b"Hi"),
            rest=[fixture_logprobs(" there", 8, 1)],
            ranks=[3],
        )
        yield pb.GenerateResponse(request_id=request.request_id, admitted=True)
        usage = pb.Usage(prompt_tokens=2, completion_tokens=0)
        if request.sampling.prompt_only:
            yield pb.GenerateResponse(finish_reason="length", usage=usage, prompt_logprobs=prompt)
            return
        yield pb.GenerateResponse(token_ids=(0,), prompt_logprobs=prompt)
        yield pb.GenerateResponse(text="EN", token_ids=(1,))
        yield pb.GenerateResponse(finish_reason="length", usage=usage)


async def test_prompt_logprobs_come_once_with_the_first_event() -> None:
    there = TokenLogprob(" there", b" there", -0.25, 8)
    want = PromptLogprobs(TokenLogprob("Hi", b"Hi", 0.0, 7), (TokenLogprobs(there, (there,)),), (3,))
    sampling = SamplingParams(max_tokens=2, prompt_logprobs=1)
    async with _PromptLogprobsEngine() as engine, EnginePool([f"127.0.0.1:{engine.port}"]) as pool:
        events = await _collect(pool, dataclasses.replace(_request(), sampling=sampling))
        alone = await _collect(pool, dataclasses.replace(_request(), sampling=SamplingParams(0, prompt_logprobs=1)))
    # The first message's token has no text yet: the prompt's log-probabilities wait for the chunk that has some.
    assert events[0] == TokenChunk("EN", 2, None, (), want)
    assert isinstance(events[1], Done) and events[1].prompt_logprobs is None
    assert len(alone) == 1 and isinstance(alone[0], Done) and alone[0].prompt_logprobs == want


async def test_registers_adapter_once_with_absolute_path(engines: list[FastEngineFixture]) -> None:
    engine = engines[0]
    adapter = _adapter()
    async with EnginePool([f"127.0.0.1:{engine.port}"]) as pool:
        results = await asyncio.gather(*(_collect(pool, _request(f"r{i}"), adapter) for i in range(8)))
    assert all(isinstance(r[-1], Done) and r[-1].adapter_version == "v1" for r in results)
    # The first chunk names the version too (a stream's headers go out before Done), the others do not repeat it.
    assert all([getattr(e, "adapter_version", None) for e in r[:-1]] == ["v1"] + [None] * (len(r) - 2) for r in results)
    assert len(engine.load_calls) == 1
    call = engine.load_calls[0]
    assert (call.name, call.path, call.pin, call.wait) == ("pirate@v1", f"{os.getcwd()}/adapters/pirate", True, False)


async def test_prefers_replica_holding_the_adapter_then_least_loaded(engines: list[FastEngineFixture]) -> None:
    async with EnginePool([f"127.0.0.1:{e.port}" for e in engines], max_concurrency=4) as pool:
        a, b = pool.replicas
        b.adapters["pirate@v1"] = "resident"
        assert pool.acquire("pirate@v1") is b
        assert pool.acquire("pirate@v1") is b  # still preferred while it has room
        assert pool.acquire(None) is a  # base: least loaded
        assert pool.acquire("other@v1") is a  # cold everywhere: least loaded (a 1/4, b 2/4)
        b.healthy = False
        assert pool.acquire("pirate@v1") is a
        assert pool.acquire(None) is a
        assert pool.acquire(None) is None  # a is full, b unhealthy
        assert not pool.has_capacity()
        woken: list[int] = []
        pool.add_capacity_listener(lambda: woken.append(1))
        pool.release(a)
        assert woken == [1]
        assert pool.has_capacity()


async def test_polled_figures_come_from_healthy_replicas_only(engines: list[FastEngineFixture]) -> None:
    """A replica that stopped answering must not keep reporting the load it had at its last poll."""
    async with EnginePool([f"127.0.0.1:{e.port}" for e in engines]) as pool:
        await pool.poll_once()
        a, b = pool.replicas
        figures = pool.polled_figures()
        assert set(figures) == {a.name, b.name}
        assert set(figures[a.name]) >= {"running_requests", "kv_slots_used", "slot_hits", "slot_misses", "fills_ahead"}
        b.healthy = False
        assert set(pool.polled_figures()) == {a.name}


async def test_engine_errors_map_to_gateway_errors() -> None:
    async with FastEngineFixture(FastEngineOptions(max_model_len=2)) as engine:
        async with EnginePool([f"127.0.0.1:{engine.port}"]) as pool:
            with pytest.raises(InvalidRequest, match="max_model_len"):
                await _collect(pool, _request(prompt="x" * 100))


async def test_closing_the_stream_cancels_on_the_engine() -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=1000, delay_s=0.005)) as engine:
        async with EnginePool([f"127.0.0.1:{engine.port}"]) as pool:
            replica = pool.acquire(None)
            assert replica is not None
            stream = pool.generate(replica, _request("gone"), None)
            assert isinstance(await anext(stream), TokenChunk)
            assert "gone" in engine.active
            await stream.aclose()
            for _ in range(100):
                if "gone" not in engine.active:
                    break
                await asyncio.sleep(0.01)
            assert "gone" not in engine.active
            assert replica.calls == set()


async def test_replica_death_fails_its_streams_and_marks_it_unhealthy(engines: list[FastEngineFixture]) -> None:
    slow = FastEngineFixture(FastEngineOptions(chunks=1000, delay_s=0.01))
    await slow.start()
    async with EnginePool([f"127.0.0.1:{slow.port}", f"127.0.0.1:{engines[0].port}"], poll_interval_s=0.05) as pool:
        dying = pool.replicas[0]
        replica = pool.acquire(None)
        assert replica is dying
        stream = pool.generate(replica, _request("doomed"), None)
        assert isinstance(await anext(stream), TokenChunk)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await slow.stop(0)
        with pytest.raises(ReplicaFailed) as failure:
            async for _ in stream:
                pass
        assert loop.time() - started < 2.0
        assert failure.value.before_admission is False
        pool.release(replica)
        for _ in range(100):
            if not dying.healthy:
                break
            await asyncio.sleep(0.02)
        assert not dying.healthy
        assert pool.acquire(None) is pool.replicas[1]


async def test_unreachable_replica_fails_before_admission() -> None:
    async with EnginePool([f"127.0.0.1:{free_port()}"], rpc_timeout_s=0.5) as pool:
        replica = pool.replicas[0]
        assert not replica.healthy
        replica.healthy = True  # pretend an old poll said so
        with pytest.raises(ReplicaFailed) as failure:
            async for _ in pool.generate(replica, _request(), None):
                pass
        assert failure.value.before_admission is True
        assert not replica.healthy


async def test_poll_restores_health_and_calls_listeners() -> None:
    engine = FastEngineFixture()
    port = free_port()
    async with EnginePool([f"127.0.0.1:{port}"], poll_interval_s=0.05, rpc_timeout_s=0.5) as pool:
        healthy: list[str] = []
        pool.add_health_listener(lambda r: healthy.append(r.name))
        assert pool.healthy_count() == 0
        await engine.start(port=port)
        try:
            for _ in range(200):
                if healthy:
                    break
                await asyncio.sleep(0.02)
            assert healthy == ["engine-0"]
            assert pool.residency()["engine-0"]["healthy"] is True
        finally:
            await engine.stop(0)


async def test_retired_versions_unload_once_idle() -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=30, delay_s=0.01)) as engine:
        async with EnginePool([f"127.0.0.1:{engine.port}"]) as pool:
            old = _adapter(version="v1")
            running = asyncio.create_task(_collect(pool, _request("old"), old))
            for _ in range(200):
                if "old" in engine.active:
                    break
                await asyncio.sleep(0.005)
            pool.adapters.retire(["pirate@v1"])
            await asyncio.sleep(0.05)
            assert "pirate@v1" in engine.adapters  # still in use
            events = await running
            assert isinstance(events[-1], Done)
            for _ in range(100):
                if "pirate@v1" not in engine.adapters:
                    break
                await asyncio.sleep(0.01)
            assert engine.unload_calls == ["pirate@v1"]


def test_top_p_zero_keeps_only_the_top_token() -> None:
    """top_p 0 once reached the engine as its wire default 0, "not set": the full distribution was sampled."""
    zero = GatewayRequest(request_id="r", tenant="t", adapter=None, prompt="hi", sampling=SamplingParams(top_p=0.0))
    assert generate_request(zero, "").sampling.top_p == pytest.approx(SMALLEST_TOP_P)
    assert 0 < SMALLEST_TOP_P < 1 / 200_000  # below any token's share of a real vocabulary: the top one alone
    assert generate_request(_request(), "").sampling.top_p == 1.0


def test_negative_seeds_reach_the_engine_as_distinct_uint64_seeds() -> None:
    # OpenAI's seeds are int64; the wire's is uint64 (a negative seed once made building the message raise).
    def seed(value: int) -> int:
        request = dataclasses.replace(_request(), sampling=SamplingParams(seed=value))
        return generate_request(request, "").sampling.seed

    assert seed(-1) == 2**64 - 1 and seed(-(2**63)) == 2**63 and seed(7) == 7
    assert len({seed(v) for v in (-2, -1, 0, 1, 2**64 - 1)}) == 4  # -1 and 2^64 - 1 are one seed


class _FailedAdapterEngine(FastEngineFixture):
    """Answers UNAVAILABLE for one adapter, as the engine does for an adapter whose load failed."""

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if request.adapter == "broken@v1":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "adapter 'broken@v1' failed to load: bad weights")
        async for response in super().Generate(request, context):
            yield response


async def test_engine_answering_unavailable_for_one_request_leaves_the_replica_serving() -> None:
    # The engine's own UNAVAILABLE (one adapter failed to load) once marked the whole replica dead: every
    # other stream on it was cut and, with no other replica, every queued request failed.
    async with _FailedAdapterEngine(FastEngineOptions(chunks=30, delay_s=0.01)) as engine:
        async with EnginePool([f"127.0.0.1:{engine.port}"], poll_interval_s=60) as pool:
            replica = pool.replicas[0]
            running = asyncio.create_task(_collect(pool, _request("running")))
            for _ in range(2000):  # streaming on the replica when the refusal comes
                if "running" in engine.active:
                    break
                await asyncio.sleep(0.005)
            assert "running" in engine.active
            with pytest.raises(ReplicaFailed, match="failed to load"):
                await _collect(pool, _request("bad"), _adapter("broken"))
            assert replica.healthy
            events = await running
            assert isinstance(events[-1], Done) and events[-1].finish_reason == "stop"


async def test_an_abort_after_the_pool_closed_is_dropped_quietly() -> None:
    # A stream cut during shutdown sends its Abort after the channels closed; it once raised UsageError in a
    # background task ("Task exception was never retrieved").
    async with FastEngineFixture(FastEngineOptions(chunks=2)) as engine:
        async with EnginePool([f"127.0.0.1:{engine.port}"], poll_interval_s=60) as pool:
            replica = pool.replicas[0]
        await pool._abort(replica, "late")


class _HeldStats(FastEngineFixture):
    """Takes its Stats snapshot at once but answers only when `release` is set (a reply still on its way)."""

    def __init__(self, options: FastEngineOptions | None = None) -> None:
        super().__init__(options)
        self.asked, self.release = asyncio.Event(), asyncio.Event()
        self.hold = False

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        snapshot = await super().Stats(request, context)
        if self.hold:
            self.asked.set()
            await self.release.wait()
        return snapshot


async def test_a_poll_answer_older_than_a_registration_does_not_undo_it() -> None:
    # The poll replaced `replica.adapters` with an answer taken before the registration finished: the
    # replica looked cold for a version it held (routing went elsewhere, the next request registered it again).
    engine = _HeldStats()
    async with engine:
        async with EnginePool([f"127.0.0.1:{engine.port}"], poll_interval_s=60) as pool:
            replica = pool.replicas[0]
            engine.hold = True
            polling = asyncio.create_task(pool.poll_once())
            await asyncio.wait_for(engine.asked.wait(), 5)
            await pool.adapters.register(replica, _adapter())
            engine.release.set()
            await polling
            assert "pirate@v1" in engine.adapters
            assert "pirate@v1" in replica.adapters


async def test_a_poll_answer_older_than_an_unload_does_not_bring_it_back() -> None:
    engine = _HeldStats()
    async with engine:
        async with EnginePool([f"127.0.0.1:{engine.port}"], poll_interval_s=60) as pool:
            replica = pool.replicas[0]
            await pool.adapters.register(replica, _adapter())
            engine.hold = True
            polling = asyncio.create_task(pool.poll_once())
            await asyncio.wait_for(engine.asked.wait(), 5)
            pool.adapters.retire(["pirate@v1"])
            await until(lambda: "pirate@v1" not in engine.adapters)
            engine.release.set()
            await polling
            assert "pirate@v1" not in replica.adapters


class _DrainingEngine(FastEngineFixture):
    """Drains like `python -m engine` after SIGTERM once `draining` is set: Stats says so, new requests are
    refused with UNAVAILABLE, the streams already open run to their end."""

    draining = False

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
        async for response in super().Generate(request, context):
            yield response

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        stats = await super().Stats(request, context)
        stats.draining = self.draining
        return stats


async def test_a_draining_replica_gets_no_new_requests_and_finishes_its_streams(
    engines: list[FastEngineFixture],
) -> None:
    # A draining engine once looked healthy to its polls: it kept being picked (least loaded, as its requests
    # finish), and each new request bounced off it with UNAVAILABLE.
    async with _DrainingEngine(FastEngineOptions(chunks=30, delay_s=0.01)) as engine:
        addresses = [f"127.0.0.1:{engine.port}", f"127.0.0.1:{engines[0].port}"]
        async with EnginePool(addresses, max_concurrency=4, poll_interval_s=60) as pool:
            draining, other = pool.replicas
            replica = pool.acquire(None)
            assert replica is draining
            running = asyncio.create_task(_collect_on(pool, replica, _request("running")))
            await until(lambda: "running" in engine.active)
            engine.draining = True
            await pool.poll_once()
            assert draining.healthy and draining.draining
            assert pool.residency()[draining.name]["draining"] is True
            figures = pool.polled_figures()  # adaptergate_engine_draining
            assert figures[draining.name]["draining"] == 1 and figures[other.name]["draining"] == 0
            assert pool.healthy_count() == 1
            assert [pool.acquire(None) for _ in range(4)] == [other] * 4  # never the draining one
            assert pool.acquire(None) is None and not pool.has_capacity()
            events = await running  # not cut: the stream in flight ends normally
            assert isinstance(events[-1], Done) and events[-1].finish_reason == "stop"
            assert draining.healthy
            # Another process at the same address (a restart between two polls) takes requests again.
            woken: list[int] = []
            pool.add_capacity_listener(lambda: woken.append(1))
            engine.draining = False
            await pool.poll_once()
            assert woken and pool.acquire(None) is draining


async def test_a_request_refused_by_a_draining_replica_is_retried_elsewhere(engines: list[FastEngineFixture]) -> None:
    async with _DrainingEngine() as engine:
        addresses = [f"127.0.0.1:{engine.port}", f"127.0.0.1:{engines[0].port}"]
        async with EnginePool(addresses, poll_interval_s=60) as pool:
            draining, other = pool.replicas
            engine.draining = True  # since the last poll
            replica = pool.acquire(None)
            assert replica is draining
            with pytest.raises(ReplicaFailed) as failure:
                await _collect_on(pool, replica, _request("bounced"))
            assert failure.value.before_admission  # retried by the gateway, and not on the same replica:
            assert draining.healthy and draining.draining
            assert pool.acquire(None) is other
            assert pool.acquire(None) is other


async def _collect_on(pool: EnginePool, replica: Replica, request: GatewayRequest) -> list[object]:
    try:
        return [event async for event in pool.generate(replica, request, None)]
    finally:
        pool.release(replica)


async def test_polling_goes_on_after_a_restart_closed_the_channel_of_a_poll_in_flight() -> None:
    # `set_address` closes the old channel; a Stats call still in flight on it raised CancelledError, which
    # ended the poll loop for good: no replica's health or drain was ever noticed again.
    old, new = _HeldStats(), _DrainingEngine()
    async with old, new:
        async with EnginePool([f"127.0.0.1:{old.port}"], poll_interval_s=0.02, rpc_timeout_s=5) as pool:
            replica = pool.replicas[0]
            old.hold = True
            await asyncio.wait_for(old.asked.wait(), 5)  # the poll loop waits on the old process
            pool.set_address(replica, f"127.0.0.1:{new.port}")
            await until(lambda: replica.healthy)
            new.draining = True
            await until(lambda: replica.draining, timeout_s=5)
            assert replica.healthy and replica.last_error == ""
            old.release.set()


class _HeldLoad(FastEngineFixture):
    """Answers LoadAdapter only once `release` is set."""

    def __init__(self, options: FastEngineOptions | None = None) -> None:
        super().__init__(options)
        self.asked, self.release = asyncio.Event(), asyncio.Event()

    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadAdapterResponse:
        self.asked.set()
        await self.release.wait()
        return await super().LoadAdapter(request, context)


async def test_a_registration_cut_by_a_restart_fails_the_request_as_retryable(
    engines: list[FastEngineFixture],
) -> None:
    # The closed channel's CancelledError reached the request's task, which was not cancelled: the protocol
    # took it for a client gone away and answered nothing, and the request was not retried.
    old = _HeldLoad()
    async with old:
        async with EnginePool([f"127.0.0.1:{old.port}"], poll_interval_s=60) as pool:
            replica = pool.replicas[0]
            request = asyncio.create_task(_collect(pool, _request("cold"), _adapter()))
            await asyncio.wait_for(old.asked.wait(), 5)
            pool.set_address(replica, f"127.0.0.1:{engines[0].port}")
            with pytest.raises(ReplicaFailed) as failure:
                await request
            assert failure.value.before_admission
            old.release.set()


class _SlowCheck(FastEngineFixture):
    """LoadAdapter times out: the engine's own check queued behind loads, or no answer within the RPC timeout."""

    own_timeout = True

    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadAdapterResponse:
        if self.own_timeout:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"adapter {request.name!r}: its check timed out")
        await asyncio.sleep(5)
        return await super().LoadAdapter(request, context)


@pytest.mark.parametrize("own_timeout", [True, False])
async def test_a_registration_timing_out_fails_the_request_as_retryable(own_timeout: bool) -> None:
    # It surfaced as DeadlineExceeded: a request without any deadline got 504 "Deadline Exceeded" (and was not
    # tried again) because the engine was slow to check an adapter.
    async with _SlowCheck() as engine:
        engine.own_timeout = own_timeout
        async with EnginePool([f"127.0.0.1:{engine.port}"], poll_interval_s=60, rpc_timeout_s=0.2) as pool:
            with pytest.raises(ReplicaFailed, match="pirate@v1") as failure:
                await _collect(pool, _request("cold"), _adapter())
            assert failure.value.before_admission
            assert pool.replicas[0].healthy


async def test_a_prompts_start_goes_back_to_the_replica_that_served_it_within_a_load_bound(
    engines: list[FastEngineFixture],
) -> None:
    # Least-loaded routing spread the turns of a chat, and the requests sharing a system prompt, over every
    # replica: each found its start in that engine's prefix cache one time in N.
    async with EnginePool([f"127.0.0.1:{e.port}" for e in engines], max_concurrency=8) as pool:
        a, b = pool.replicas
        first = pool.acquire(None, affinity="chat-1")
        assert first is a  # nothing known: the least loaded (the first of equals)
        other = pool.acquire(None, affinity="chat-2")
        assert other is b
        for _ in range(3):  # a as loaded as b, then 1/8 and 2/8 more: within the slack of 1/4
            assert pool.acquire(None, affinity="chat-1") is a
        assert pool.acquire(None, affinity="chat-1") is b  # a at 4/8 against b's 1/8: past the slack
        assert pool.acquire(None, affinity="chat-1") is b  # and b is the start's replica now
        # A replica holding the adapter still comes first; its use makes it the start's replica.
        a.adapters["pirate@v1"] = "resident"
        assert pool.acquire("pirate@v1", affinity="chat-3") is a
        pool.release(a)
        pool.release(a)
        assert pool.acquire("pirate@v1", affinity="chat-3") is a
        # A start whose replica stopped taking requests goes elsewhere.
        b.healthy = False
        assert pool.acquire(None, affinity="chat-2") is a
