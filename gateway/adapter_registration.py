"""Which adapter versions the engine replicas hold: registration, retirement, and convergence on each poll.

A version is registered on a replica once however many requests ask for it at the same time, and a version
being retired is unloaded from a replica once no request there uses it. What `register_everywhere` last asked
for stays wanted: each poll of a healthy replica registers what it lacks (a registration that failed, an
engine that restarted and forgot) unless the engine refused that version on its merits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Coroutine, Iterable
from typing import Any

import grpc

from engine import engine_pb2 as pb
from gateway.engine_wire import absolute_path
from gateway.errors import GatewayError, InvalidRequest, NotFound
from gateway.registry import ResolvedAdapter
from gateway.replica import Replica, ReplicaFailed, channel_closed_under

log = logging.getLogger("adaptergate.engine_client")

# The gateway's error for an RPC a replica failed (marking the replica down where the failure says it is).
ErrorOf = Callable[[Replica, grpc.aio.AioRpcError], GatewayError]


class AdapterRegistrations:
    """The adapter versions on every replica of an `EnginePool` (`pool.adapters`)."""

    def __init__(
        self,
        replicas: list[Replica],
        *,
        rpc_timeout_s: float,
        error_of: ErrorOf,
        spawn: Callable[[Coroutine[Any, Any, object]], None],
    ) -> None:
        self._replicas = replicas  # the pool's own list: replicas added later are seen
        self._rpc_timeout_s = rpc_timeout_s
        self._error_of = error_of
        self._spawn = spawn
        self._retiring: set[str] = set()
        # Versions in use (what `register_everywhere` was last asked for and not retired since).
        self._wanted: dict[str, ResolvedAdapter] = {}
        # (replica, version) registrations the engine refused on their merits (a missing file, a pin it has no
        # room for): polls do not ask again every second; the next `register_everywhere` of the version does.
        self._refused: set[tuple[str, str]] = set()

    async def register(self, replica: Replica, adapter: ResolvedAdapter) -> None:
        """Register `adapter` on `replica` (once, however many requests ask at the same time)."""
        name = adapter.engine_name
        # An unload still on its way could be served after this registration (separate RPCs keep no order).
        while (unloading := replica.unloading.get(name)) is not None:
            await asyncio.shield(unloading)
        pending = replica.loading.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self._load(replica, adapter))
            replica.loading[name] = pending
            pending.add_done_callback(lambda _: replica.loading.pop(name, None))
        await asyncio.shield(pending)

    async def _load(self, replica: Replica, adapter: ResolvedAdapter) -> None:
        request = pb.LoadAdapterRequest(
            name=adapter.engine_name, path=absolute_path(adapter.source), pin=adapter.pin, wait=False
        )
        stub = replica.stub
        try:
            response = await stub.LoadAdapter(request, timeout=self._rpc_timeout_s)
        except asyncio.CancelledError:
            if channel_closed_under(replica, stub):
                raise ReplicaFailed(f"engine replica {replica.name} restarted", before_admission=True) from None
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                # Our RPC timeout, or the engine's check queued behind loads: a slow replica, not the request's
                # deadline (DeadlineExceeded would tell a client without one "504 Deadline Exceeded").
                raise ReplicaFailed(
                    f"engine replica {replica.name} did not register {adapter.engine_name} in time: {e.details()}",
                    before_admission=True,
                ) from None
            error = self._error_of(replica, e)
            if isinstance(error, InvalidRequest | NotFound):  # the engine's verdict on the adapter, not a hiccup
                self._refused.add((replica.name, adapter.engine_name))
            raise error from None
        self._refused.discard((replica.name, adapter.engine_name))
        replica.adapters[adapter.engine_name] = response.adapter.state or "registered"
        log.info(
            "adapter registered",
            extra={"replica": replica.name, "adapter": adapter.engine_name, "state": response.adapter.state},
        )

    async def validate(self, adapters: Iterable[ResolvedAdapter]) -> None:
        """Register `adapters` on one healthy replica, raising its refusal (e.g. `InvalidRequest` naming a
        missing or malformed adapter) so a bad manifest is rejected before it is stored.

        Without a healthy replica nothing can be checked; the versions load when replicas come up.
        """
        replica = next((r for r in self._replicas if r.takes_requests), None)
        if replica is None:
            return
        for adapter in adapters:
            await self.register(replica, adapter)

    async def register_everywhere(
        self, adapters: Iterable[ResolvedAdapter], *, refresh: Collection[Replica] = ()
    ) -> None:
        """Register each adapter version on every healthy replica; failures are logged, not raised (the next
        polls try again). On the replicas in `refresh`, versions they know already are registered again too, so
        that a changed `pin` or source reaches them (the engine takes a registration again in place)."""
        wanted = list(adapters)
        self._retiring.difference_update(a.engine_name for a in wanted)
        self._wanted.update((a.engine_name, a) for a in wanted)
        self._refused.difference_update((r.name, a.engine_name) for r in self._replicas for a in wanted)
        jobs = [
            self.register(r, a)
            for r in self._replicas
            if r.healthy
            for a in wanted
            if r in refresh or a.engine_name not in r.adapters
        ]
        for result in await asyncio.gather(*jobs, return_exceptions=True):
            if isinstance(result, Exception):
                log.warning("adapter registration failed: %s", result)

    def wanted_names(self) -> set[str]:
        """The adapter versions `register_everywhere` keeps registered on every healthy replica."""
        return set(self._wanted)

    def retire(self, engine_names: Iterable[str]) -> None:
        """Unload these adapter versions from every replica once no request uses them there."""
        for name in engine_names:
            self._retiring.add(name)
            self._wanted.pop(name, None)
            for replica in self._replicas:
                if name in replica.adapters and not replica.active.get(name):
                    self._spawn(self._unload(replica, name))

    def start_using(self, replica: Replica, engine_name: str) -> None:
        """A request runs on `engine_name` at `replica` (it is not unloaded there until `stop_using`)."""
        replica.active[engine_name] = replica.active.get(engine_name, 0) + 1

    def stop_using(self, replica: Replica, engine_name: str) -> None:
        """A request that `start_using` counted has ended."""
        left = replica.active[engine_name] - 1
        if left:
            replica.active[engine_name] = left
            return
        del replica.active[engine_name]
        if engine_name in self._retiring:
            self._spawn(self._unload(replica, engine_name))

    def converge(self, replica: Replica) -> None:
        """After a good poll of `replica`: register the wanted versions it lacks and unload the retired ones it
        holds unused, so a failed registration or unload (the replica unreachable, the engine busy) or an engine
        that forgot its adapters is not left as it is until some request trips on it."""
        for name, adapter in list(self._wanted.items()):
            if (
                name not in replica.adapters
                and name not in replica.loading
                and (replica.name, name) not in self._refused
            ):
                self._spawn(self._register_logged(replica, adapter))
        for name in list(replica.adapters):
            if name in self._retiring and not replica.active.get(name) and name not in replica.loading:
                self._spawn(self._unload(replica, name))

    async def _unload(self, replica: Replica, engine_name: str) -> None:
        if replica.active.get(engine_name) or engine_name not in self._retiring:
            return
        if engine_name in replica.loading or engine_name in replica.unloading:
            return  # a request registers it again to run on it (and unloads it when done), or it is on its way out
        replica.adapters.pop(engine_name, None)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        replica.unloading[engine_name] = done
        try:
            await replica.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=engine_name), timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.warning("unload of %s on %s failed: %s", engine_name, replica.name, e.details())
        finally:
            del replica.unloading[engine_name]
            done.set_result(None)

    async def _register_logged(self, replica: Replica, adapter: ResolvedAdapter) -> None:
        try:
            await self.register(replica, adapter)
        except GatewayError as e:
            log.warning("adapter registration failed: %s", e)
