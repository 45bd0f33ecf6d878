from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest

from bench.fast_engine import FastEngineFixture, FastEngineOptions
from gateway.api import (
    ChatMessage,
    Done,
    Error,
    Event,
    GatewayRequest,
    PolicyDecision,
    PolicyInput,
    SamplingParams,
    TokenChunk,
)
from gateway.core import Gateway
from gateway.errors import Status, Unauthenticated
from gateway.registry import AdapterInstance, AdapterVersion, Registry
from tests.conftest import free_port
from tests.support.gateways import serving_gateway
from tests.support.waiting import until
from tests.unit.gateway.test_engine_client import _DrainingEngine

TENANTS: list[dict[str, Any]] = [
    {"name": "alice", "plain_api_keys": ["key-a"]},
    {"name": "bob", "plain_api_keys": ["key-b"], "allowed_adapters": ["shout"], "limits": {"max_queue_depth": 1}},
]


def _instance(name: str, *versions: tuple[str, float], tenants: tuple[str, ...] = ("*",)) -> AdapterInstance:
    return AdapterInstance(
        name=name,
        base_model="smollm2",
        versions=tuple(AdapterVersion(v, f"/adapters/{name}/{v}", w) for v, w in versions),
        allowed_tenants=tenants,
    )


def _req(rid: str, tenant: str = "alice", adapter: str | None = None, **kw: Any) -> GatewayRequest:
    kw.setdefault("prompt", "hello")
    return GatewayRequest(request_id=rid, tenant=tenant, adapter=adapter, **kw)


async def _run(gateway: Gateway, request: GatewayRequest) -> list[Event]:
    return [event async for event in gateway.submit(request)]


def _client_ids(engine: FastEngineFixture) -> list[str]:
    """The client request ids behind the engine calls it saw (the core calls `<tenant>/<id>#<call>`)."""
    return [r.request_id.split("/", 1)[1].rsplit("#", 1)[0] for r in engine.requests_seen]


def _engine_id(engine: FastEngineFixture, client_id: str) -> str | None:
    return next((rid for rid in engine.active if rid.split("/", 1)[1].rsplit("#", 1)[0] == client_id), None)


class DenyLongPrompts:
    async def check(self, item: PolicyInput) -> PolicyDecision:
        return PolicyDecision(item.prompt_chars < 50, "prompt too long for this test policy")


@asynccontextmanager
async def _gateway(
    engines: Sequence[FastEngineFixture | int], *, capacity: int = 8, policy: Any = None, poll_s: float = 0.05
) -> AsyncIterator[Gateway]:
    registry = Registry.open(":memory:")
    registry.apply(_instance("pirate", ("v1", 100)))
    registry.apply(_instance("shout", ("v1", 100), tenants=("alice",)))
    addresses = [f"127.0.0.1:{e if isinstance(e, int) else e.port}" for e in engines]
    async with serving_gateway(addresses, registry, TENANTS, capacity=capacity, policy=policy, poll_s=poll_s) as g:
        yield g
    registry.close()


@pytest.fixture
async def engine() -> AsyncIterator[FastEngineFixture]:
    async with FastEngineFixture(FastEngineOptions(chunks=4)) as fixture:
        yield fixture


async def test_streams_tokens_then_done_and_charges_the_tenant(engine: FastEngineFixture) -> None:
    async with _gateway([engine]) as gateway:
        events = await _run(gateway, _req("a1", adapter="pirate"))
        assert [type(e) for e in events] == [TokenChunk] * 4 + [Done]
        done = events[-1]
        assert isinstance(done, Done) and done.adapter_version == "v1"
        stats = gateway.queue_stats()["alice"]
        assert stats.served_tokens == done.usage.total_tokens
        assert (stats.depth, stats.in_flight_requests, stats.in_flight_tokens) == (0, 0, 0)
        chat = await _run(gateway, _req("a2", prompt=None, messages=(ChatMessage("user", "hi"),)))
        assert isinstance(chat[-1], Done)


async def test_engines_get_the_registry_versions_at_start(engine: FastEngineFixture) -> None:
    async with _gateway([engine]):
        assert set(engine.adapters) == {"pirate@v1", "shout@v1"}


@pytest.mark.parametrize(
    ("request_", "status", "message"),
    [
        (_req("x", adapter="nope"), Status.NOT_FOUND, "adapter 'nope' not found"),
        (_req("x", tenant="bob", adapter="pirate"), Status.PERMISSION_DENIED, "tenant 'bob' may not use adapter"),
        (_req("x", tenant="bob", adapter="shout"), Status.PERMISSION_DENIED, "tenant 'bob' may not use adapter"),
        (_req("x", sampling=SamplingParams(max_tokens=5000)), Status.PERMISSION_DENIED, "max_tokens 5000 exceeds"),
        (_req("x", prompt="y" * 100), Status.PERMISSION_DENIED, "prompt too long for this test policy"),
    ],
)
async def test_refusals_become_one_error_event(
    engine: FastEngineFixture, request_: GatewayRequest, status: Status, message: str
) -> None:
    policy = DenyLongPrompts() if "y" * 100 == request_.prompt else None
    engine.record_requests = True
    async with _gateway([engine], policy=policy) as gateway:
        events = await _run(gateway, request_)
    assert len(events) == 1 and isinstance(events[0], Error)
    assert events[0].status is status and message in events[0].message
    assert engine.requests_seen == []


async def test_authentication_and_models(engine: FastEngineFixture) -> None:
    async with _gateway([engine]) as gateway:
        assert gateway.authenticate("key-b") == "bob"
        with pytest.raises(Unauthenticated, match="invalid API key"):
            gateway.authenticate("wrong")
        with pytest.raises(Unauthenticated, match="missing API key"):
            gateway.authenticate(None)
        assert gateway.models_for("alice") == ["base", "pirate", "shout"]
        assert gateway.models_for("bob") == ["base"]  # may use shout, but shout's spec excludes bob


async def test_deadline_while_queued_never_reaches_the_engine() -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=50, delay_s=0.01)) as slow:
        slow.record_requests = True
        async with _gateway([slow], capacity=1) as gateway:
            busy = asyncio.create_task(_run(gateway, _req("busy")))
            await until(lambda: _engine_id(slow, "busy") is not None)
            started = time.monotonic()
            events = await _run(gateway, _req("late", deadline=time.monotonic() + 0.1))
            assert isinstance(events[0], Error) and events[0].status is Status.DEADLINE_EXCEEDED
            assert time.monotonic() - started > 0.08
            # Failed while the only slot was still busy (0.5 s of chunks): in the queue, not after dispatch.
            assert not busy.done()
            assert _client_ids(slow) == ["busy"]
            assert gateway.queue_stats()["alice"].depth == 0
            assert isinstance((await busy)[-1], Done)


async def test_queued_requests_fail_at_once_when_the_last_replica_starts_draining() -> None:
    # A draining replica takes no new requests, but its health listeners were not told: the queued requests
    # waited until the engine process exited (up to its drain timeout) before they failed.
    async with _DrainingEngine(FastEngineOptions(chunks=100, delay_s=0.01)) as draining:
        async with _gateway([draining], capacity=1) as gateway:
            running = asyncio.create_task(_run(gateway, _req("running")))
            await until(lambda: _engine_id(draining, "running") is not None)
            queued = asyncio.create_task(_run(gateway, _req("queued")))
            await until(lambda: gateway.queue_stats()["alice"].depth == 1)
            draining.draining = True
            events = await asyncio.wait_for(queued, timeout=0.5)  # the running stream still has ~0.8 s to go
            assert isinstance(events[0], Error) and events[0].status is Status.UNAVAILABLE
            assert gateway.health() == (False, "0/1 engine replicas healthy (1 more draining)")
            assert not running.done()
            assert isinstance((await running)[-1], Done)  # the stream in flight ends normally


async def test_two_gateways_give_one_client_id_different_engine_ids(engine: FastEngineFixture) -> None:
    # Engine ids were "<tenant>/<id>#<n>" with n counted from 0 in every gateway process: a client id sent
    # through two gateways sharing an engine made one engine id, which the engine refuses while in use, and
    # one gateway's Abort could end the other's call.
    engine.record_requests = True
    async with _gateway([engine]) as first, _gateway([engine]) as second:
        for gateway in (first, second):
            assert isinstance((await _run(gateway, _req("same")))[-1], Done)
    one, two = (r.request_id for r in engine.requests_seen)
    assert one != two and one.startswith("alice/same#") and two.startswith("alice/same#")


async def test_queue_limits_throttle_with_retry_after() -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=50, delay_s=0.01)) as slow:
        async with _gateway([slow], capacity=1) as gateway:
            running = asyncio.create_task(_run(gateway, _req("b1", tenant="bob")))
            queued = asyncio.create_task(_run(gateway, _req("b2", tenant="bob")))
            await until(lambda: _engine_id(slow, "b1") is not None and gateway.queue_stats()["bob"].depth == 1)
            events = await _run(gateway, _req("b3", tenant="bob"))
            assert isinstance(events[0], Error) and events[0].status is Status.RESOURCE_EXHAUSTED
            assert events[0].retry_after_s is not None and events[0].retry_after_s > 0
            assert all(isinstance(r[-1], Done) for r in await asyncio.gather(running, queued))


async def test_cancel_while_queued_leaves_the_queue() -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=50, delay_s=0.01)) as slow:
        slow.record_requests = True
        async with _gateway([slow], capacity=1) as gateway:
            busy = asyncio.create_task(_run(gateway, _req("busy")))
            await until(lambda: _engine_id(slow, "busy") is not None)
            waiting = asyncio.create_task(_run(gateway, _req("waiting")))
            await until(lambda: gateway.queue_stats()["alice"].depth == 1)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert gateway.queue_stats()["alice"].depth == 0
            await busy
            assert _client_ids(slow) == ["busy"]
            assert gateway.pool.replicas[0].in_flight == 0


async def test_client_gone_mid_stream_aborts_on_the_engine() -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=1000, delay_s=0.005)) as slow:
        async with _gateway([slow]) as gateway:
            stream = gateway.submit(_req("leaver"))
            assert isinstance(await anext(stream), TokenChunk)
            await stream.aclose()  # type: ignore[attr-defined]
            for _ in range(100):
                if not slow.active:
                    break
                await asyncio.sleep(0.01)
            assert slow.active == {}
            stats = gateway.queue_stats()["alice"]
            assert (stats.in_flight_requests, stats.in_flight_tokens) == (0, 0)
            assert gateway.pool.replicas[0].in_flight == 0


async def test_fair_pick_serves_a_late_tenant_before_the_backlog_ends() -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=2, delay_s=0.002)) as slow:
        slow.record_requests = True
        async with _gateway([slow], capacity=1) as gateway:
            tasks = [asyncio.create_task(_run(gateway, _req(f"a{i}"))) for i in range(12)]
            await asyncio.sleep(0)
            tasks.append(asyncio.create_task(_run(gateway, _req("b0", tenant="bob"))))
            await asyncio.gather(*tasks)
            order = _client_ids(slow)
    # FIFO would serve bob 13th. The fair queue lifts bob to alice's counter (which includes the
    # reservation of her running request, 17 tokens), then serves him once alice's real usage
    # (3 tokens a request) passes it: 7th or 8th.
    assert 1 <= order.index("b0") <= 8, order


async def test_replica_death_fails_running_requests_and_others_move_on() -> None:
    slow = FastEngineFixture(FastEngineOptions(chunks=1000, delay_s=0.01))
    healthy = FastEngineFixture(FastEngineOptions(chunks=4))
    await slow.start()
    await healthy.start()
    try:
        async with _gateway([slow, healthy], capacity=1) as gateway:
            gateway.pool.replicas[1].in_flight = 1  # occupy the healthy replica so the first goes to slow
            doomed = asyncio.create_task(_run(gateway, _req("doomed")))
            await until(lambda: _engine_id(slow, "doomed") is not None)
            gateway.pool.replicas[1].in_flight = 0
            gateway.queue.pump()
            waiting = [asyncio.create_task(_run(gateway, _req(f"w{i}"))) for i in range(3)]
            started = time.monotonic()
            await slow.stop(0)
            events = await doomed
            assert isinstance(events[-1], Error) and events[-1].status is Status.UNAVAILABLE
            assert time.monotonic() - started < 2.0
            for result in await asyncio.gather(*waiting):
                assert isinstance(result[-1], Done)
    finally:
        await healthy.stop(0)


async def test_request_on_a_replica_dead_before_admission_is_retried_elsewhere(engine: FastEngineFixture) -> None:
    # No polls after the first: only the request's own failed call can find out that `dead` is dead.
    async with _gateway([free_port(), engine], poll_s=60) as gateway:
        dead, alive = gateway.pool.replicas
        dead.healthy = True  # stale health: the first request will find out
        alive.in_flight = alive.capacity  # force the first pick onto the dead one
        task = asyncio.create_task(_run(gateway, _req("retry")))
        await until(lambda: not dead.healthy)
        assert not task.done()  # not failed: waiting for a slot on the live replica
        alive.in_flight = 0
        gateway.queue.pump()
        events = await task
        assert isinstance(events[-1], Done), events
        assert not dead.healthy


async def test_hot_version_switch_lets_in_flight_finish() -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=40, delay_s=0.01)) as slow:
        async with _gateway([slow]) as gateway:
            old = asyncio.create_task(_run(gateway, _req("old", adapter="pirate")))
            await until(lambda: _engine_id(slow, "old") is not None)
            await asyncio.to_thread(gateway.registry.apply, _instance("pirate", ("v1", 0), ("v2", 100)))
            for _ in range(100):
                if "pirate@v2" in slow.adapters:
                    break
                await asyncio.sleep(0.01)
            assert "pirate@v2" in slow.adapters
            new = await _run(gateway, _req("new", adapter="pirate"))
            assert isinstance(new[-1], Done) and new[-1].adapter_version == "v2"
            previous = await old
            assert isinstance(previous[-1], Done) and previous[-1].adapter_version == "v1"
            for _ in range(100):
                if "pirate@v1" not in slow.adapters:
                    break
                await asyncio.sleep(0.01)
            assert "pirate@v1" not in slow.adapters


async def test_without_any_healthy_engine_requests_fail_fast() -> None:
    async with _gateway([free_port()]) as gateway:
        # Not queued to wait for a replica that may never come: nothing would end the wait.
        events = await asyncio.wait_for(_run(gateway, _req("nowhere")), 5)
        assert isinstance(events[0], Error) and events[0].status is Status.UNAVAILABLE
        assert events[0].retry_after_s is not None


async def test_without_any_healthy_engine_bad_requests_still_get_their_own_refusal() -> None:
    # Every request was answered 503 "no engine replica is available" (Retry-After 2) while the engines were down,
    # an unknown adapter or a policy denial too: clients retried requests that could never succeed.
    async with _gateway([free_port()]) as gateway:
        unknown = await asyncio.wait_for(_run(gateway, _req("unknown", adapter="nope")), 5)
        assert isinstance(unknown[0], Error) and unknown[0].status is Status.NOT_FOUND
        forbidden = await asyncio.wait_for(_run(gateway, _req("forbidden", tenant="bob", adapter="pirate")), 5)
        assert isinstance(forbidden[0], Error) and forbidden[0].status is Status.PERMISSION_DENIED


async def test_losing_the_last_engine_fails_queued_requests() -> None:
    slow = FastEngineFixture(FastEngineOptions(chunks=1000, delay_s=0.01))
    await slow.start()
    async with _gateway([slow], capacity=1) as gateway:
        running = asyncio.create_task(_run(gateway, _req("running")))
        queued = [asyncio.create_task(_run(gateway, _req(f"q{i}"))) for i in range(3)]
        await until(lambda: _engine_id(slow, "running") is not None and gateway.queue_stats()["alice"].depth == 3)
        await slow.stop(0)
        results = await asyncio.wait_for(asyncio.gather(running, *queued), 3)
        assert all(isinstance(r[-1], Error) and r[-1].status is Status.UNAVAILABLE for r in results)
        assert gateway.queue_stats()["alice"].depth == 0


async def test_anonymous_tenant_when_configured(engine: FastEngineFixture) -> None:
    async with _gateway([engine]) as gateway:
        gateway._anonymous = "alice"
        assert gateway.authenticate(None) == "alice"
        assert gateway.authenticate("key-b") == "bob"


async def test_queue_and_engine_spans_join_the_callers_trace(engine: FastEngineFixture, spans: Any) -> None:
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    context = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    async with _gateway([engine]) as gateway:
        events = await _run(gateway, _req("traced", trace_context=context))
    assert isinstance(events[-1], Done)
    finished = {s.name: s for s in spans.get_finished_spans()}
    assert {"gateway.queue", "gateway.engine"} <= set(finished)
    for name in ("gateway.queue", "gateway.engine"):
        span = finished[name]
        assert f"{span.context.trace_id:032x}" == trace_id
        assert span.parent is not None and f"{span.parent.span_id:016x}" == parent_id
    assert finished["gateway.engine"].attributes["engine.replica"] == "engine-0"


async def test_engine_that_forgot_an_adapter_gets_it_registered_again(engine: FastEngineFixture) -> None:
    async with _gateway([engine], poll_s=60) as gateway:
        engine.adapters.clear()  # as if the engine restarted between two polls
        events = await _run(gateway, _req("again", adapter="pirate"))
        assert isinstance(events[-1], Done) and events[-1].adapter_version == "v1"
        assert [c.name for c in engine.load_calls].count("pirate@v1") == 2


async def test_retry_with_no_healthy_replica_left_fails_fast() -> None:
    # No polls after the first: the request itself finds the replica dead, and its retry has nowhere to go.
    async with _gateway([free_port()], poll_s=60) as gateway:
        replica = gateway.pool.replicas[0]
        replica.healthy = True  # stale: the request finds out it is dead
        events = await asyncio.wait_for(_run(gateway, _req("stranded")), 10)
        assert isinstance(events[-1], Error) and events[-1].status is Status.UNAVAILABLE
        assert not replica.healthy


@pytest.mark.parametrize(
    "request_",
    [
        _req("big-top-k", sampling=SamplingParams(top_k=2**32)),
        _req("surrogate", prompt="a\ud800b"),
        _req("surrogate-chat", prompt=None, messages=(ChatMessage("user", "\udc80"),)),
    ],
)
async def test_request_the_engine_wire_cannot_carry_is_one_error_event(
    engine: FastEngineFixture, request_: GatewayRequest
) -> None:
    # Values outside the engine's proto field ranges once raised out of `submit` (a 500 at the REST
    # boundary) instead of ending the stream with one Error event.
    async with _gateway([engine]) as gateway:
        events = await _run(gateway, request_)
        assert len(events) == 1 and isinstance(events[0], Error)
        assert events[0].status is Status.INVALID_ARGUMENT
        stats = gateway.queue_stats()["alice"]
        assert (stats.depth, stats.in_flight_requests, stats.in_flight_tokens) == (0, 0, 0)
        assert gateway.pool.replicas[0].in_flight == 0


async def test_two_tenants_may_use_the_same_request_id_at_once() -> None:
    # Request ids once were one namespace for all tenants: bob's "r1" was refused while alice's ran, which
    # also told bob which ids alice used.
    async with FastEngineFixture(FastEngineOptions(chunks=20, delay_s=0.005)) as slow:
        async with _gateway([slow]) as gateway:
            alice = asyncio.create_task(_run(gateway, _req("r1")))
            await until(lambda: _engine_id(slow, "r1") is not None)
            bob = await _run(gateway, _req("r1", tenant="bob"))
            assert isinstance(bob[-1], Done), bob
            assert isinstance((await alice)[-1], Done)
            events = await _run(gateway, _req("r1"))  # alice's "r1" is done: the id is free again
            assert isinstance(events[-1], Done)


async def test_a_request_id_is_still_refused_while_its_tenant_runs_it() -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=20, delay_s=0.005)) as slow:
        async with _gateway([slow]) as gateway:
            first = asyncio.create_task(_run(gateway, _req("twice")))
            await until(lambda: _engine_id(slow, "twice") is not None)
            events = await _run(gateway, _req("twice"))
            assert isinstance(events[0], Error) and events[0].status is Status.INVALID_ARGUMENT
            assert events[0].message == "request id 'twice' is already queued or running"  # the client's id
            assert isinstance((await first)[-1], Done)


async def test_each_engine_call_has_its_own_id() -> None:
    # The Abort of a stream the client left goes out in the background. With the client's id as the engine's,
    # it could reach the client's next request of the same id.
    async with FastEngineFixture(FastEngineOptions(chunks=1000, delay_s=0.005)) as slow:
        slow.record_requests = True
        async with _gateway([slow]) as gateway:
            stream = gateway.submit(_req("same"))
            assert isinstance(await anext(stream), TokenChunk)
            await stream.aclose()  # type: ignore[attr-defined]
            events = await _run(gateway, _req("same", sampling=SamplingParams(max_tokens=3)))
            assert isinstance(events[-1], Done), events
            first, second = (r.request_id for r in slow.requests_seen)
            assert first != second and _client_ids(slow) == ["same", "same"]


class HeldPolicy:
    """Allows everything, once `release` is set (a policy server that takes its time)."""

    def __init__(self) -> None:
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def check(self, item: PolicyInput) -> PolicyDecision:
        self.entered.set()
        await self.release.wait()
        return PolicyDecision(True, "")


async def test_losing_the_last_engine_during_the_policy_check_fails_fast() -> None:
    # Engines were checked only before the (awaited) policy check: a request that passed it after the last
    # engine died was queued with no engine left to serve it, and waited until its deadline, or forever.
    engine = FastEngineFixture(FastEngineOptions(chunks=4))
    await engine.start()
    policy = HeldPolicy()
    async with _gateway([engine], policy=policy) as gateway:
        pending = asyncio.create_task(_run(gateway, _req("late")))
        await asyncio.wait_for(policy.entered.wait(), 5)
        await engine.stop(0)
        await until(lambda: gateway.pool.healthy_count() == 0)
        policy.release.set()
        events = await asyncio.wait_for(pending, 5)
        assert isinstance(events[-1], Error) and events[-1].status is Status.UNAVAILABLE
        assert gateway.queue_stats()["alice"].depth == 0


async def test_the_access_log_line_carries_the_requests_trace_id(
    engine: FastEngineFixture, caplog: pytest.LogCaptureFixture
) -> None:
    # No span is made current, so a log line had no way back to the request's trace.
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    context = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}
    async with _gateway([engine]) as gateway:
        with caplog.at_level("INFO", logger="adaptergate.access"):
            await _run(gateway, _req("traced-log", trace_context=context))
            await _run(gateway, _req("untraced-log"))
    lines = {r.request_id: r for r in caplog.records if r.name == "adaptergate.access"}  # type: ignore[attr-defined]
    assert lines["traced-log"].trace_id == trace_id  # type: ignore[attr-defined]
    assert not hasattr(lines["untraced-log"], "trace_id")


async def test_a_deadline_passing_while_generating_is_named_as_such() -> None:
    # It reached the client as gRPC's own text, "Stream removed (Deadline Exceeded)".
    async with FastEngineFixture(FastEngineOptions(chunks=200, delay_s=0.01)) as slow:
        async with _gateway([slow]) as gateway:
            events = await _run(gateway, _req("slow", deadline=time.monotonic() + 0.3))
    assert isinstance(events[0], TokenChunk)  # it was generating
    assert isinstance(events[-1], Error) and events[-1].status is Status.DEADLINE_EXCEEDED
    assert "deadline passed while the engine was generating" in events[-1].message


async def test_the_turns_of_a_chat_go_to_one_replica_where_its_start_is_cached() -> None:
    # Least-loaded routing sent a chat's turns to whichever replica had the fewest requests; each engine caches
    # the prompts it served, so a turn found the chat's start cached one time in the number of replicas.
    options = FastEngineOptions(chunks=2)
    async with FastEngineFixture(options) as one, FastEngineFixture(options) as two:
        for engine in (one, two):
            engine.record_requests = True
        async with _gateway([one, two]) as gateway:
            system = ChatMessage("system", "You answer questions about tides.")
            conversation = [system, ChatMessage("user", "When is high tide?")]
            busy = gateway.pool.replicas[0]
            for turn in range(4):
                request = _req(f"t{turn}", prompt=None, messages=tuple(conversation))
                assert isinstance((await _run(gateway, request))[-1], Done)
                conversation += [ChatMessage("assistant", "At six."), ChatMessage("user", f"And turn {turn}?")]
                if turn == 0:  # the chat's replica gets another request to run: no longer the least loaded
                    busy.in_flight += 1
            other = _req("other", prompt=None, messages=(ChatMessage("user", "Something else entirely."),))
            assert isinstance((await _run(gateway, other))[-1], Done)
            busy.in_flight -= 1
        assert set(_client_ids(one)) == {"t0", "t1", "t2", "t3"}
        assert _client_ids(two) == ["other"]  # a start of its own goes to the least loaded
