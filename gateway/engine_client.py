"""Engine replicas behind one pool: replica choice, health, and the Generate stream (adapter versions on the
replicas: `gateway/adapter_registration.py`).

The pool knows each replica's health and which adapter versions it holds (polled with `Stats` and
updated by our own `LoadAdapter` calls). A request goes to a healthy replica with a free slot, preferring
one where its adapter version is already known, else the least loaded. A replica that stops answering
is marked unhealthy and its running streams are cut at once, so their clients hear UNAVAILABLE instead
of waiting on a dead socket. A replica that reports it drains (its process got SIGTERM) takes no new
requests but stays healthy: its running streams finish there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterable, Sequence
from typing import Any

import grpc

from engine import engine_pb2 as pb
from engine import engine_pb2_grpc as pb_grpc
from gateway.adapter_registration import AdapterRegistrations
from gateway.affinity import LOAD_SLACK, AffinityTable
from gateway.api import Done, GatewayRequest, TokenChunk
from gateway.engine_wire import ResponseEvents, generate_request
from gateway.errors import (
    DeadlineExceeded,
    GatewayError,
    InvalidRequest,
    NotFound,
    Throttled,
    Unavailable,
)
from gateway.registry import ResolvedAdapter
from gateway.replica import Replica, ReplicaFailed, channel_closed_under

log = logging.getLogger("adaptergate.engine_client")

_CHANNEL_OPTIONS = (
    # Notice a silently dead peer (host gone, process stopped) without waiting for TCP timeouts.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
)
_STATUS_ERRORS: dict[grpc.StatusCode, type[GatewayError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Throttled,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


class EnginePool:
    """All engine replicas this gateway drives; an async context manager that polls them while open."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        max_concurrency: int = 32,
        poll_interval_s: float = 1.0,
        rpc_timeout_s: float = 5.0,
    ) -> None:
        self._max_concurrency = max_concurrency
        self._poll_interval_s = poll_interval_s
        self.rpc_timeout_s = rpc_timeout_s  # the deadline of unary calls
        self._addresses = list(addresses)
        self.replicas: list[Replica] = []
        self._listeners: list[Callable[[], None]] = []
        self._health_listeners: list[Callable[[Replica], None]] = []
        self._tasks: set[asyncio.Task[object]] = set()
        self._poller: asyncio.Task[None] | None = None
        self._affinity = AffinityTable()
        self.adapters = AdapterRegistrations(
            self.replicas,
            rpc_timeout_s=rpc_timeout_s,
            error_of=lambda replica, e: self._error(replica, e, admitted=False),
            spawn=self._spawn,
        )

    async def __aenter__(self) -> EnginePool:
        for address in self._addresses:
            self.add_replica(address)
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever(), name="engine-poll")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(r.channel.close(None) for r in self.replicas), return_exceptions=True)

    def add_replica(self, address: str, name: str | None = None) -> Replica:
        """Start driving the engine at `address` (it becomes usable after its first good poll)."""
        channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        replica = Replica(
            name=name or f"engine-{len(self.replicas)}",
            address=address,
            capacity=self._max_concurrency,
            channel=channel,
            stub=pb_grpc.EngineStub(channel),
        )
        self.replicas.append(replica)
        return replica

    def set_address(self, replica: Replica, address: str) -> None:
        """Point `replica` at a new address (its process was restarted); usable after the next poll."""
        self._mark_unhealthy(replica, "moved to a new address")
        old = replica.channel
        self._spawn(old.close(None))
        replica.address = address
        replica.channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        replica.stub = pb_grpc.EngineStub(replica.channel)
        replica.adapters = {}
        replica.draining = False  # a new process
        self._spawn(self._poll(replica))

    def add_capacity_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever a slot frees up or a replica starts taking requests (it turns healthy, or
        a new process at a draining replica's address does not drain)."""
        self._listeners.append(callback)

    def add_health_listener(self, callback: Callable[[Replica], None]) -> None:
        """Call `callback(replica)` whenever a replica turns healthy or unhealthy, or starts draining (see
        `replica.healthy`, `replica.draining`)."""
        self._health_listeners.append(callback)

    # -- slots ---------------------------------------------------------------------------------

    def has_capacity(self) -> bool:
        """Whether some replica taking new requests has a free slot."""
        return any(r.takes_requests and r.in_flight < r.capacity for r in self.replicas)

    def healthy_count(self) -> int:
        """Replicas taking new requests: healthy and not draining."""
        return sum(1 for r in self.replicas if r.takes_requests)

    def acquire(
        self, engine_name: str | None, exclude: Iterable[Replica] = (), *, affinity: str | None = None
    ) -> Replica | None:
        """Take a slot on the best replica for `engine_name` (None = base model), or None if all are full.

        Replicas holding the version come first (no load on the request's path), then the replica that served
        the prompt's start last (`affinity`, `gateway/affinity.py`) unless it is loaded `LOAD_SLACK` above
        the least loaded, then the least loaded."""
        best: Replica | None = None
        best_key = (2, 0.0)
        ranked: dict[str, tuple[Replica, tuple[int, float]]] = {}
        for r in self.replicas:
            if not r.takes_requests or r.in_flight >= r.capacity or r in exclude:
                continue
            cold = 0 if engine_name is None or engine_name in r.adapters else 1
            key = (cold, r.load)
            ranked[r.name] = (r, key)
            if key < best_key:
                best, best_key = r, key
        if best is None:
            return None
        if affinity is not None:
            steer = self._affinity.get(affinity)
            steered = ranked.get(steer) if steer is not None else None
            if steered is not None and steered[1][0] == best_key[0] and steered[1][1] <= best_key[1] + LOAD_SLACK:
                best = steered[0]
            self._affinity.record(affinity, best.name)
        best.in_flight += 1
        return best

    def release(self, replica: Replica) -> None:
        """Give back a slot taken by `acquire`."""
        replica.in_flight -= 1
        self._notify()

    # -- streaming -----------------------------------------------------------------------------

    async def generate(
        self,
        replica: Replica,
        request: GatewayRequest,
        adapter: ResolvedAdapter | None,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> AsyncGenerator[TokenChunk | Done, None]:
        """Stream `request` on `replica`; raises `GatewayError` (`ReplicaFailed` when the replica fails).

        `metadata` travels as gRPC metadata (trace context). Closing the iterator early cancels the
        engine request.
        """
        engine_name = ""
        if adapter is not None:
            engine_name = adapter.engine_name
            if engine_name not in replica.adapters:
                await self.adapters.register(replica, adapter)
        try:
            message = generate_request(request, engine_name)
        except ValueError as e:
            # Out of the wire format's range (a seed beyond uint64, a top_k beyond uint32) or not encodable as
            # UTF-8 (lone surrogates): the request's fault, so a refusal rather than an exception.
            raise InvalidRequest(f"request cannot be sent to the engine: {e}") from None
        timeout = None if request.deadline is None else max(0.001, request.deadline - time.monotonic())
        call = replica.stub.Generate(message, timeout=timeout, metadata=metadata)
        replica.calls.add(call)
        if engine_name:
            self.adapters.start_using(replica, engine_name)
        admitted = finished = False
        events = ResponseEvents(adapter.version if adapter is not None else None)
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    break
                admitted = True
                for event in events.of(response):
                    finished = type(event) is Done
                    yield event
                if finished:
                    return
            raise ReplicaFailed(f"{replica.name} ended the stream without a result", before_admission=False)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND and engine_name and not admitted:
                # The engine forgot the adapter (it restarted since our last poll): register it again
                # on the retry instead of failing the request.
                replica.adapters.pop(engine_name, None)
                raise ReplicaFailed(f"{replica.name} did not know {engine_name}", before_admission=True) from None
            answered = await self._answered_unavailable(replica, e, admitted)
            if answered is not None:
                raise answered from None
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and request.deadline is not None:
                # Our own call deadline (the request's): gRPC's text for it is "Deadline Exceeded" or "Stream
                # removed", which tells a client nothing about which deadline or where.
                raise DeadlineExceeded(
                    f"the request's deadline passed while the engine was generating ({replica.name})"
                ) from None
            raise self._error(replica, e, admitted) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call in replica.cut and task is not None and task.cancelling() == 0:
                raise ReplicaFailed(
                    f"engine replica {replica.name} stopped responding", before_admission=not admitted
                ) from None
            raise
        finally:
            replica.calls.discard(call)
            replica.cut.discard(call)
            if engine_name:
                self.adapters.stop_using(replica, engine_name)
            if not finished:
                call.cancel()
                if admitted and replica.healthy:
                    # Cancelling the stream frees the engine's slot already; Abort makes sure of it
                    # for engines that notice cancellation only at their next step.
                    self._spawn(self._abort(replica, request.request_id))

    async def unary_error(self, replica: Replica, e: grpc.aio.AioRpcError) -> GatewayError:
        """The gateway's error for a unary call that `replica` failed (`ReplicaFailed` where another replica may
        answer it)."""
        return await self._answered_unavailable(replica, e, False) or self._error(replica, e, admitted=False)

    async def _answered_unavailable(
        self, replica: Replica, e: grpc.aio.AioRpcError, admitted: bool
    ) -> ReplicaFailed | None:
        """The failure of a call the engine itself answered UNAVAILABLE (an adapter that failed to load, a drain)
        while it still answers Stats; None otherwise. Only a failed poll marks the replica down and cuts its
        other streams."""
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            return None
        await self._poll(replica)
        if not replica.healthy:
            return None
        detail = e.details() or e.code().name
        return ReplicaFailed(f"engine replica {replica.name} unavailable: {detail}", before_admission=not admitted)

    def _error(self, replica: Replica, e: grpc.aio.AioRpcError, admitted: bool) -> GatewayError:
        code = e.code()
        detail = e.details() or code.name
        if code == grpc.StatusCode.UNAVAILABLE:
            self._mark_unhealthy(replica, detail)
            return ReplicaFailed(f"engine replica {replica.name} unavailable: {detail}", before_admission=not admitted)
        if code == grpc.StatusCode.CANCELLED:
            return ReplicaFailed(f"engine replica {replica.name} cancelled the request", before_admission=False)
        cls = _STATUS_ERRORS.get(code)
        if cls is None:
            return Unavailable(f"engine replica {replica.name} failed: {code.name}: {detail}")
        return cls(detail)

    async def _abort(self, replica: Replica, request_id: str) -> None:
        # UsageError: the pool closed the channel meanwhile (a stream cut while the gateway shut down); the
        # engine drops the streams of a closed channel itself.
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
            await replica.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.rpc_timeout_s)

    # -- adapters ------------------------------------------------------------------------------

    def residency(self) -> dict[str, dict[str, object]]:
        """Per replica: address, health, load and the adapter versions it holds with their state."""
        return {r.name: r.residency() for r in self.replicas}

    def polled_figures(self) -> dict[str, dict[str, int]]:
        """Per healthy replica: its load and adapter-cache counters, as of its last Stats poll."""
        return {r.name: figures for r in self.replicas if (figures := r.polled_figures()) is not None}

    # -- health --------------------------------------------------------------------------------

    async def poll_once(self) -> None:
        """Ask every replica for its stats now (also run periodically while the pool is open)."""
        await asyncio.gather(*(self._poll(r) for r in self.replicas))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self.poll_once()

    async def _poll(self, replica: Replica) -> None:
        before = dict(replica.adapters)
        stub = replica.stub
        try:
            stats = await stub.Stats(pb.StatsRequest(), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            if replica.stub is stub:
                self._mark_unhealthy(replica, f"{e.code().name}: {e.details()}")
            return
        except asyncio.CancelledError:
            if channel_closed_under(replica, stub):
                return  # `set_address` replaced the channel and polls the new one itself
            raise
        if replica.stub is not stub:  # the old process's answer, which says nothing about the new one
            return
        replica.stats = stats
        # What the engine reports is the truth (it may have restarted and forgotten registrations);
        # keep names we are registering right now, and what was registered or unloaded while the answer was on
        # its way (it may predate both).
        adapters = {a.name: a.state for a in stats.adapters}
        for name, state in replica.adapters.items():
            if name in replica.loading or name not in before:
                adapters.setdefault(name, state)
        for name in before.keys() - replica.adapters.keys():
            adapters.pop(name, None)
        replica.adapters = adapters
        replica.last_error = ""
        was_draining, replica.draining = replica.draining, stats.draining
        if replica.draining and not was_draining:
            log.info("engine replica draining: no new requests go there", extra={"replica": replica.name})
            for callback in self._health_listeners:  # the last replica taking requests may be gone
                callback(replica)
        if not replica.healthy:
            replica.healthy = True
            log.info("engine replica healthy", extra={"replica": replica.name, "address": replica.address})
            for callback in self._health_listeners:
                callback(replica)
            self._notify()
        elif was_draining and not replica.draining:  # a new process at the same address: it takes requests again
            self._notify()
        self.adapters.converge(replica)

    def _mark_unhealthy(self, replica: Replica, reason: str) -> None:
        replica.last_error = reason
        if not replica.healthy:
            return
        replica.healthy = False
        log.warning("engine replica unhealthy: %s", reason, extra={"replica": replica.name})
        for call in list(replica.calls):
            replica.cut.add(call)
            call.cancel()
        for callback in self._health_listeners:
            callback(replica)

    def _notify(self) -> None:
        for callback in self._listeners:
            callback()

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task: asyncio.Task[object] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
