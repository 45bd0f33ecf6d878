"""Keeping the engines' adapter registrations in step with the registry, through restarts, failures and races."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import grpc

from bench.fast_engine import FastEngineFixture, FastEngineOptions
from engine import engine_pb2 as pb
from gateway.admin import AdminApi
from gateway.api import Done, Event, GatewayRequest
from gateway.core import Gateway
from gateway.registry import AdapterInstance, AdapterVersion, Registry
from gateway.tenancy import hash_api_key
from protocols.rest import RestServer
from tests.support.gateways import serving_gateway
from tests.support.waiting import until


def _instance(name: str, *versions: tuple[str, float], pin: bool = False, root: str = "/adapters") -> AdapterInstance:
    return AdapterInstance(
        name=name,
        base_model="smollm2",
        versions=tuple(AdapterVersion(v, f"{root}/{name}/{v}", w) for v, w in versions),
        pin=pin,
    )


def _settled(gateway: Gateway) -> bool:
    """No adapter sync of the gateway and no background registration or unload of the pool is left."""
    return not gateway._tasks and not gateway.pool._tasks and not any(r.loading for r in gateway.pool.replicas)


@asynccontextmanager
async def _gateway(engines: Sequence[FastEngineFixture], *, poll_s: float = 0.05) -> AsyncIterator[Gateway]:
    registry = Registry.open(":memory:")
    registry.apply(_instance("pirate", ("v1", 100)))
    addresses = [f"127.0.0.1:{e.port}" for e in engines]
    tenants = [{"name": "alice", "plain_api_keys": ["key-a"]}]
    async with serving_gateway(addresses, registry, tenants, poll_s=poll_s) as g:
        yield g
    registry.close()


@asynccontextmanager
async def _engines(cls: type[FastEngineFixture] = FastEngineFixture, n: int = 1) -> AsyncIterator[list[Any]]:
    fixtures = [cls(FastEngineOptions(chunks=4)) for _ in range(n)]
    for fixture in fixtures:
        await fixture.start()
    try:
        yield fixtures
    finally:
        for fixture in fixtures:
            await fixture.stop(0)


class GatedLoads(FastEngineFixture):
    """Holds the LoadAdapter of the names in `gates` until their event is set (a slow adapter check)."""

    def __init__(self, options: FastEngineOptions | None = None) -> None:
        super().__init__(options)
        self.gates: dict[str, asyncio.Event] = {}

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext) -> Any:
        gate = self.gates.get(request.name)
        if gate is not None:
            await gate.wait()
        return await super().LoadAdapter(request, context)


async def test_a_rollback_applied_while_the_rollout_loads_keeps_the_rolled_back_version() -> None:
    # Each apply's sync read the versions to keep before it awaited their registration: the roll-out's sync,
    # finishing after the rollback's, retired the version the rollback had put back (all traffic went to an
    # unloaded version, loaded and unloaded again around every request) and kept the one rolled back.
    async with _engines(GatedLoads) as (engine,):
        async with _gateway([engine]) as gateway:
            replica = gateway.pool.replicas[0]
            engine.gates["pirate@v2"] = asyncio.Event()
            gateway.registry.apply(_instance("pirate", ("v1", 0), ("v2", 100)))  # roll out v2 ...
            await until(lambda: "pirate@v2" in replica.loading)
            gateway.registry.apply(_instance("pirate", ("v1", 100), ("v2", 0)))  # ... and back, while v2 loads
            await until(lambda: len(gateway._tasks) == 1)  # the rollback's sync is over; the roll-out's waits
            engine.gates["pirate@v2"].set()
            await until(lambda: _settled(gateway))
            assert "pirate@v1" in engine.adapters and "pirate@v2" not in engine.adapters
            assert "pirate@v1" in replica.adapters and "pirate@v2" not in replica.adapters


async def test_a_pin_change_reaches_every_replica() -> None:
    # A version already registered was skipped: `pin` reached at most the replica the admin API validated the
    # manifest on, never the others.
    async with _engines(n=2) as engines:
        async with _gateway(engines) as gateway:
            assert all(not e.adapters["pirate@v1"].pinned for e in engines)
            await asyncio.to_thread(gateway.registry.apply, _instance("pirate", ("v1", 100), pin=True))
            await until(lambda: all(e.adapters["pirate@v1"].pinned for e in engines))


async def test_a_new_source_under_the_same_version_name_reaches_every_replica() -> None:
    async with _engines(n=2) as engines:
        async with _gateway(engines) as gateway:
            await asyncio.to_thread(gateway.registry.apply, _instance("pirate", ("v1", 100), root="/retrained"))
            await until(lambda: all(e.adapters["pirate@v1"].path == "/retrained/pirate/v1" for e in engines))


class Partitioned(FastEngineFixture):
    """An engine that keeps running (and keeps its adapters) but cannot be reached while `down`."""

    def __init__(self, options: FastEngineOptions | None = None) -> None:
        super().__init__(options)
        self.down = False
        self.refused: list[str] = []

    async def _refuse(self, what: str, context: grpc.aio.ServicerContext) -> None:
        if self.down:
            self.refused.append(what)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "unreachable")

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        await self._refuse("Stats", context)
        return await super().Stats(request, context)

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext) -> Any:
        await self._refuse(f"LoadAdapter {request.name}", context)
        return await super().LoadAdapter(request, context)

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext) -> Any:
        await self._refuse(f"UnloadAdapter {request.name}", context)
        return await super().UnloadAdapter(request, context)


async def test_a_version_retired_while_a_replica_was_unreachable_is_unloaded_when_it_is_back() -> None:
    # The unload failed while the replica was unreachable and was never tried again: the retired version stayed
    # registered there for good (pinned, it held a LoRA slot and counted against the engine's pin room).
    async with _engines(Partitioned, n=2) as (a, b):
        async with _gateway([a, b]) as gateway:
            replica_b = gateway.pool.replicas[1]
            b.down = True
            await until(lambda: not replica_b.healthy)
            await asyncio.to_thread(gateway.registry.apply, _instance("pirate", ("v1", 0), ("v2", 100)))
            await until(lambda: "UnloadAdapter pirate@v1" in b.refused and "pirate@v1" not in a.adapters)
            b.down = False
            await until(lambda: set(b.adapters) == {"pirate@v2"})
            await until(lambda: set(replica_b.adapters) == {"pirate@v2"})


async def test_an_engine_that_forgot_its_adapters_between_polls_gets_them_back_without_a_request() -> None:
    async with _engines() as (engine,):
        async with _gateway([engine]) as gateway:
            engine.adapters.clear()  # restarted at the same address between two polls
            await until(lambda: "pirate@v1" in engine.adapters)
            await until(lambda: "pirate@v1" in gateway.pool.replicas[0].adapters)


class FailsLoadOnce(FastEngineFixture):
    """Refuses the first LoadAdapter of each name in `flaky` the way a busy engine does (DEADLINE_EXCEEDED)."""

    def __init__(self, options: FastEngineOptions | None = None) -> None:
        super().__init__(options)
        self.flaky: set[str] = set()

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext) -> Any:
        if request.name in self.flaky:
            self.flaky.discard(request.name)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"adapter {request.name!r}: its check timed out")
        return await super().LoadAdapter(request, context)


async def test_a_registration_that_failed_transiently_is_tried_again() -> None:
    # register_everywhere logged the failure and nothing tried again: the new version stayed unregistered on
    # the replica (never kept resident, a cold load on some request's path) until a request needed it there.
    async with _engines(FailsLoadOnce) as (engine,):
        async with _gateway([engine]) as gateway:
            engine.flaky.add("pirate@v2")
            await asyncio.to_thread(gateway.registry.apply, _instance("pirate", ("v1", 50), ("v2", 50)))
            await until(lambda: "pirate@v2" in engine.adapters)
            assert "pirate@v2" not in engine.flaky  # it did fail once
            assert [c.name for c in engine.load_calls].count("pirate@v2") == 1


async def test_a_version_whose_registration_failed_is_not_tried_again_once_deleted() -> None:
    async with _engines(FailsLoadOnce) as (engine,):
        async with _gateway([engine], poll_s=60) as gateway:
            engine.flaky.add("pirate@v2")
            await asyncio.to_thread(gateway.registry.apply, _instance("pirate", ("v1", 50), ("v2", 50)))
            await until(lambda: "pirate@v2" not in engine.flaky and _settled(gateway))
            await asyncio.to_thread(gateway.registry.delete, "pirate")
            await until(lambda: _settled(gateway) and not engine.adapters)
            await gateway.pool.poll_once()
            await until(lambda: _settled(gateway))
            assert engine.adapters == {}
            assert "pirate@v2" not in [c.name for c in engine.load_calls]


async def test_a_pin_change_made_while_a_replica_was_unreachable_reaches_it_when_it_is_back() -> None:
    # The replica kept its registrations meanwhile, and versions it knew were skipped when it came back.
    async with _engines(Partitioned, n=2) as (a, b):
        async with _gateway([a, b]) as gateway:
            replica_b = gateway.pool.replicas[1]
            b.down = True
            await until(lambda: not replica_b.healthy)
            await asyncio.to_thread(gateway.registry.apply, _instance("pirate", ("v1", 100), pin=True))
            await until(lambda: a.adapters["pirate@v1"].pinned)
            b.down = False
            await until(lambda: replica_b.healthy)
            await until(lambda: b.adapters["pirate@v1"].pinned)


class RefusesSources(FastEngineFixture):
    """Refuses adapters whose path names a folder in `missing`, as the engine does for absent files."""

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext) -> Any:
        if "/missing/" in request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"adapter {request.name!r}: no adapter_config.json")
        return await super().LoadAdapter(request, context)


async def test_a_refused_manifest_leaves_no_registration_behind() -> None:
    # The admin API registers every version on one replica to check it before storing anything; a manifest
    # refused by its second version left the first registered (pinned here) there for good.
    admin_key = "admin-secret"
    async with _engines(RefusesSources) as (engine,):
        async with _gateway([engine]) as gateway:
            api = AdminApi(gateway, [hash_api_key(admin_key)])
            async with RestServer(gateway, port=0, extra_routes=api.routes()) as server:
                manifest = _instance("pirate", ("v1", 100), ("v2", 0), pin=True).to_dict()
                manifest["spec"]["versions"].append({"name": "v3", "source": "/missing/v3", "weight": 0})
                async with aiohttp.ClientSession() as session:
                    async with session.post(
                        f"http://127.0.0.1:{server.port}/admin/adapters",
                        json={"manifests": [manifest]},
                        headers={"Authorization": f"Bearer {admin_key}"},
                    ) as response:
                        assert response.status == 400
                        assert "no adapter_config.json" in (await response.json())["error"]["message"]
            assert "pirate@v2" in [c.name for c in engine.load_calls]  # the check did register it
            await until(lambda: _settled(gateway) and set(engine.adapters) == {"pirate@v1"})
            assert gateway.registry.get("pirate").versions == _instance("pirate", ("v1", 100)).versions


class LateUnloads(FastEngineFixture):
    """Serves an UnloadAdapter right after the next LoadAdapter (or after 0.1 s): separate RPCs in flight
    together may be served in either order."""

    def __init__(self, options: FastEngineOptions | None = None) -> None:
        super().__init__(options)
        self.held: list[asyncio.Future[None]] = []

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext) -> Any:
        response = await super().LoadAdapter(request, context)
        for held in self.held:
            if not held.done():
                held.set_result(None)
        self.held.clear()
        return response

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext) -> Any:
        held = asyncio.get_running_loop().create_future()
        self.held.append(held)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(held, 0.1)
        return await super().UnloadAdapter(request, context)


async def test_requests_queued_on_a_retired_version_all_finish() -> None:
    # Each request ending on a retired version unloaded it while the next one queued on it registered it again:
    # the unload could land after that registration, the request met NOT_FOUND, its failed attempt unloaded the
    # version once more under its retry, and the client got UNAVAILABLE.
    async with _engines(LateUnloads) as (engine,):
        engine.options = dataclasses.replace(engine.options, chunks=2)
        async with _gateway([engine]) as gateway:
            gateway.pool.replicas[0].capacity = 1
            stream = gateway.submit(_request("q0"))
            first = await anext(stream)  # running on v1; the others wait in the queue behind it
            queued = [asyncio.create_task(_collect(gateway.submit(_request(f"q{i}")))) for i in range(1, 8)]
            await until(lambda: gateway.queue_stats()["alice"].depth == 7)
            await asyncio.to_thread(gateway.registry.apply, _instance("pirate", ("v1", 0), ("v2", 100)))
            results = [[first, *await _collect(stream)], *await asyncio.gather(*queued)]
            assert all(isinstance(r[-1], Done) and r[-1].adapter_version == "v1" for r in results), results
            await until(lambda: _settled(gateway) and "pirate@v1" not in engine.adapters)


def _request(rid: str) -> GatewayRequest:
    return GatewayRequest(request_id=rid, tenant="alice", adapter="pirate", prompt="hello")


async def _collect(stream: AsyncIterator[Event]) -> list[Event]:
    return [event async for event in stream]


class RefusesLoads(FastEngineFixture):
    """Refuses the LoadAdapter of each name in `refused` as an engine refuses a missing file (INVALID_ARGUMENT)."""

    def __init__(self, options: FastEngineOptions | None = None) -> None:
        super().__init__(options)
        self.refused: set[str] = set()
        self.asked: list[str] = []  # every LoadAdapter, refused or not
        self.stats_calls = 0

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> Any:
        self.stats_calls += 1
        return await super().Stats(request, context)

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext) -> Any:
        self.asked.append(request.name)
        if request.name in self.refused:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{request.path}: no adapter_config.json")
        return await super().LoadAdapter(request, context)


async def test_a_version_the_engine_refuses_is_not_asked_again_by_every_poll() -> None:
    # Polls register the wanted versions a replica lacks; one refused on its merits (a missing file) was asked
    # for again at every poll, each a file check on the engine and a warning in the log, forever.
    async with _engines(RefusesLoads) as (engine,):
        async with _gateway([engine], poll_s=0.02) as gateway:
            engine.refused.add("pirate@v2")
            await asyncio.to_thread(gateway.registry.apply, _instance("pirate", ("v1", 50), ("v2", 50)))
            await until(lambda: _settled(gateway) and "pirate@v2" in engine.asked)
            polls = engine.stats_calls
            await until(lambda: engine.stats_calls >= polls + 10)  # ten polls later
            assert engine.asked.count("pirate@v2") == 1
            engine.refused.clear()  # the file is fixed, and the manifest applied again
            await asyncio.to_thread(gateway.registry.apply, _instance("pirate", ("v1", 50), ("v2", 50)))
            await until(lambda: "pirate@v2" in engine.adapters)
