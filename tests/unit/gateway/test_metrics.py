from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.fast_engine import FastEngineFixture, FastEngineOptions
from gateway.api import Done, Event, GatewayRequest, Origin, PolicyDecision, PolicyInput, TokenChunk
from gateway.config import ServerConfig
from gateway.core import Gateway
from gateway.engine_client import EnginePool
from gateway.errors import Status, Unauthenticated
from gateway.metrics import GatewayMetrics
from gateway.queue import QueueLimits, TenantStats
from gateway.registry import AdapterInstance, AdapterVersion, Registry
from gateway.tenancy import TenantDirectory
from policy.static import StaticPolicy
from tests.support.waiting import until


def _samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_requests_are_counted_by_tenant_status_and_protocol() -> None:
    metrics = GatewayMetrics()
    metrics.request_done("alice", "ok", "rest", 0.004)
    metrics.request_done("alice", "ok", "rest", 0.2)
    metrics.request_done("bob", "not_found", "rest", 0.001)
    samples = _samples(metrics)
    ok = (("protocol", "rest"), ("status", "ok"), ("tenant", "alice"))
    assert samples[("adaptergate_requests_total", ok)] == 2
    assert samples[("adaptergate_request_duration_seconds_count", ok)] == 2
    assert abs(samples[("adaptergate_request_duration_seconds_sum", ok)] - 0.204) < 1e-9
    assert samples[("adaptergate_request_duration_seconds_bucket", (("le", "0.005"), *ok))] == 1
    bob = (("protocol", "rest"), ("status", "not_found"), ("tenant", "bob"))
    assert samples[("adaptergate_requests_total", bob)] == 1


def test_queue_state_is_read_at_scrape_time() -> None:
    metrics = GatewayMetrics()
    state = {"alice": TenantStats(3, 1.5, 120, 2, 64, 1)}
    metrics.observe_queue(lambda: state)
    metrics.observe_engines(lambda: {"engine-0": True, "engine-1": False})
    samples = _samples(metrics)
    alice = (("tenant", "alice"),)
    assert samples[("adaptergate_queue_depth", alice)] == 3
    assert samples[("adaptergate_queue_oldest_wait_seconds", alice)] == 1.5
    assert samples[("adaptergate_served_tokens_total", alice)] == 120
    assert samples[("adaptergate_in_flight_requests", alice)] == 2
    assert samples[("adaptergate_queue_rejected_total", alice)] == 1
    assert samples[("adaptergate_engine_healthy", (("replica", "engine-1"),))] == 0
    state["alice"] = TenantStats(0, 0.0, 200, 0, 0, 1)
    assert _samples(metrics)[("adaptergate_queue_depth", alice)] == 0


def test_engine_figures_are_read_at_scrape_time() -> None:
    metrics = GatewayMetrics()
    figures = {
        "engine-0": {
            "running_requests": 3,
            "waiting_requests": 1,
            "kv_slots_used": 3,
            "draining": 1,
            "slot_hits": 40,
            "slot_misses": 5,
            "evictions": 2,
            "loads": 6,
            "fills_ahead": 4,
        }
    }
    metrics.observe_engine_stats(lambda: figures)
    samples = _samples(metrics)
    replica = (("replica", "engine-0"),)
    assert samples[("adaptergate_engine_running_requests", replica)] == 3
    assert samples[("adaptergate_engine_kv_slots_used", replica)] == 3
    assert samples[("adaptergate_engine_draining", replica)] == 1  # the name README gives
    assert samples[("adaptergate_engine_adapter_slot_hits_total", replica)] == 40
    assert samples[("adaptergate_engine_adapter_slot_misses_total", replica)] == 5
    assert samples[("adaptergate_engine_adapter_evictions_total", replica)] == 2
    assert samples[("adaptergate_engine_adapter_loads_total", replica)] == 6
    assert samples[("adaptergate_engine_adapter_fills_ahead_total", replica)] == 4
    figures["engine-0"] = {**figures["engine-0"], "slot_hits": 41}
    assert _samples(metrics)[("adaptergate_engine_adapter_slot_hits_total", replica)] == 41


def test_two_instances_do_not_share_registries() -> None:
    first, second = GatewayMetrics(), GatewayMetrics()
    first.request_done("a", "ok", "rest", 0.1)
    assert b'tenant="a"' in first.render()
    assert b'tenant="a"' not in second.render()


def test_latency_buckets_resolve_requests_up_to_the_default_deadline() -> None:
    # A request may run until its deadline (600 s by default): one of 5 minutes must not read as "over 120 s".
    metrics = GatewayMetrics()
    metrics.request_done("alice", "ok", "rest", 119.0)
    metrics.request_done("alice", "deadline_exceeded", "rest", ServerConfig().request_timeout_s)
    metrics.first_token("alice", 0.003)
    samples = _samples(metrics)
    ok = (("protocol", "rest"), ("status", "ok"), ("tenant", "alice"))
    late = (("protocol", "rest"), ("status", "deadline_exceeded"), ("tenant", "alice"))
    bounds = sorted(
        float(dict(labels)["le"]) for name, labels in samples if name.endswith("_bucket") and ok[0] in labels
    )
    finite = [b for b in bounds if b != float("inf")]
    assert finite[-1] >= ServerConfig().request_timeout_s
    assert samples[("adaptergate_request_duration_seconds_bucket", (("le", "120.0"), *ok))] == 1
    assert samples[("adaptergate_request_duration_seconds_bucket", (("le", "120.0"), *late))] == 0
    assert samples[("adaptergate_request_duration_seconds_bucket", (("le", f"{finite[-1]}"), *late))] == 1
    # Time to first token resolves single milliseconds.
    assert samples[("adaptergate_first_token_duration_seconds_bucket", (("le", "0.0025"), ("tenant", "alice")))] == 0
    assert samples[("adaptergate_first_token_duration_seconds_bucket", (("le", "0.005"), ("tenant", "alice")))] == 1


# -- what a real gateway core records, read back from /metrics' text ---------------------------------------

_TENANTS: list[dict[str, Any]] = [
    {"name": "alice", "plain_api_keys": ["key-a"]},
    {"name": "bob", "plain_api_keys": ["key-b"], "limits": {"max_queue_depth": 1}},
]


@asynccontextmanager
async def _gateway(engine: FastEngineFixture, capacity: int = 8) -> AsyncIterator[Gateway]:
    registry = Registry.open(":memory:")
    registry.apply(
        AdapterInstance(name="pirate", base_model="smollm2", versions=(AdapterVersion("v1", "/adapters/pirate", 100),))
    )
    async with AsyncExitStack() as stack:
        pool = await stack.enter_async_context(
            EnginePool([f"127.0.0.1:{engine.port}"], max_concurrency=capacity, poll_interval_s=0.05, rpc_timeout_s=0.5)
        )
        gateway = Gateway(
            tenants=TenantDirectory.from_config(_TENANTS),
            policy=StaticPolicy(max_tokens=1000, max_prompt_chars=50),
            registry=registry,
            pool=pool,
            limits=QueueLimits(),
            default_max_tokens=16,
            access_log_enabled=False,
        )
        yield await stack.enter_async_context(gateway)
    registry.close()


def _req(rid: str, tenant: str = "alice", adapter: str | None = None, prompt: str = "hello") -> GatewayRequest:
    return GatewayRequest(request_id=rid, tenant=tenant, adapter=adapter, prompt=prompt)


async def _first(stream: AsyncIterator[Event]) -> Event:
    return await anext(stream)


def _requests(metrics: GatewayMetrics) -> dict[tuple[str, str, str], float]:
    """adaptergate_requests_total by (tenant, status, protocol)."""
    return {
        (dict(labels)["tenant"], dict(labels)["status"], dict(labels)["protocol"]): value
        for (name, labels), value in _samples(metrics).items()
        if name == "adaptergate_requests_total"
    }


async def test_bogus_api_keys_share_one_label_set() -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=2)) as engine, _gateway(engine) as gateway:
        for key in ("sk-one", "sk-two", 'quote" and\nnewline', ""):
            with pytest.raises(Unauthenticated):
                gateway.authenticate(key)
            gateway.refused(None, Status.UNAUTHENTICATED, Origin.REST)  # what the protocol then counts
        text = gateway.metrics.render().decode()
        assert _requests(gateway.metrics) == {("-", "unauthenticated", "rest"): 4}
        assert "adaptergate_request_duration_seconds_count" not in text  # a refusal has no duration to record
        assert "sk-one" not in text and "quote" not in text


async def test_each_request_is_counted_once_whatever_its_end() -> None:
    async with FastEngineFixture(FastEngineOptions(chunks=4)) as engine, _gateway(engine) as gateway:
        await until(lambda: "pirate@v1" in engine.adapters)
        engine.adapters.clear()  # forgotten, as by a restart: the request is retried after registering it again
        retried = [e async for e in gateway.submit(_req("retried", adapter="pirate"))]
        assert isinstance(retried[-1], Done) and len(engine.load_calls) == 2
        stream = gateway.submit(_req("cut"))
        assert type(await anext(stream)) is TokenChunk
        await stream.aclose()  # type: ignore[attr-defined]  # the client went away
        refused = [e async for e in gateway.submit(_req("long", prompt="x" * 100))]  # policy, before the queue
        unknown = [e async for e in gateway.submit(_req("nowhere", adapter="missing"))]
        assert len(refused) == len(unknown) == 1
        assert _requests(gateway.metrics) == {
            ("alice", "ok", "rest"): 1,
            ("alice", "cancelled", "rest"): 1,
            ("alice", "permission_denied", "rest"): 1,
            ("alice", "not_found", "rest"): 1,
        }
        samples = _samples(gateway.metrics)
        alice = (("tenant", "alice"),)
        # Queue wait and first token once per request that got that far, the retry included once.
        assert samples[("adaptergate_queue_wait_duration_seconds_count", alice)] == 2
        assert samples[("adaptergate_first_token_duration_seconds_count", alice)] == 2
        usage = retried[-1].usage
        assert samples[("adaptergate_served_tokens_total", alice)] == usage.total_tokens + 1


async def test_throttled_requests_are_counted_and_gauges_follow_the_queue() -> None:
    slow = FastEngineFixture(FastEngineOptions(chunks=1000, delay_s=0.01))
    await slow.start()
    try:
        async with _gateway(slow, capacity=1) as gateway:
            first = gateway.submit(_req("b1", tenant="bob"))
            running = asyncio.create_task(_first(first))
            queued = gateway.submit(_req("b2", tenant="bob"))
            waiting = asyncio.create_task(_first(queued))
            await until(lambda: gateway.queue_stats()["bob"].depth == 1 and running.done())
            samples = _samples(gateway.metrics)
            bob = (("tenant", "bob"),)
            assert samples[("adaptergate_queue_depth", bob)] == 1
            assert samples[("adaptergate_in_flight_requests", bob)] == 1
            assert samples[("adaptergate_engine_healthy", (("replica", "engine-0"),))] == 1
            refused = [e async for e in gateway.submit(_req("b3", tenant="bob"))]
            assert len(refused) == 1
            samples = _samples(gateway.metrics)
            assert samples[("adaptergate_queue_rejected_total", bob)] == 1
            assert _requests(gateway.metrics)[("bob", "resource_exhausted", "rest")] == 1
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await queued.aclose()  # type: ignore[attr-defined]
            await until(lambda: gateway.queue_stats()["bob"].depth == 0)
            assert _samples(gateway.metrics)[("adaptergate_queue_depth", bob)] == 0
            await slow.stop(0)
            # A replica that stopped answering: unhealthy, and no stale load or cache figures under its name.
            await until(lambda: not gateway.pool.replicas[0].healthy)
            samples = _samples(gateway.metrics)
            assert samples[("adaptergate_engine_healthy", (("replica", "engine-0"),))] == 0
            assert not [name for name, labels in samples if name.startswith("adaptergate_engine_adapter")]
            await first.aclose()  # type: ignore[attr-defined]
    finally:
        await slow.stop(0)


class _SlowPolicy:
    """Allows everything after `seconds` (a policy server that takes its time)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def check(self, item: PolicyInput) -> PolicyDecision:
        await asyncio.sleep(self.seconds)
        return PolicyDecision(True, "")


async def test_queue_wait_is_the_time_in_the_queue_only() -> None:
    # It was measured from the start of submit: a slow policy check read as time in the fair queue.
    async with FastEngineFixture(FastEngineOptions(chunks=2)) as engine, _gateway(engine) as gateway:
        gateway._policy = _SlowPolicy(0.3)
        events = [e async for e in gateway.submit(_req("slow-policy"))]
        assert isinstance(events[-1], Done)
        samples = _samples(gateway.metrics)
        alice = (("tenant", "alice"),)
        assert samples[("adaptergate_queue_wait_duration_seconds_count", alice)] == 1
        assert (
            samples[("adaptergate_queue_wait_duration_seconds_sum", alice)] < 0.1
        )  # an idle queue, whatever the policy
