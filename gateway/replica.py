"""One engine replica as the gateway's pool sees it, and the error of a replica that failed a request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from engine import engine_pb2 as pb
from engine import engine_pb2_grpc as pb_grpc
from gateway.errors import Unavailable


class ReplicaFailed(Unavailable):
    """A replica failed a request; `before_admission` means it produced nothing and may be retried."""

    def __init__(self, message: str, *, before_admission: bool) -> None:
        super().__init__(message)
        self.before_admission = before_admission


@dataclass(eq=False, slots=True)
class Replica:
    """One engine process as the pool sees it."""

    name: str
    address: str
    capacity: int
    channel: grpc.aio.Channel
    stub: pb_grpc.EngineStub
    healthy: bool = False
    # The engine reported that it drains (SIGTERM): no new requests go there, its open streams run to their end.
    draining: bool = False
    in_flight: int = 0
    last_error: str = ""
    # Adapter engine names the engine reported (or we registered), with their state.
    adapters: dict[str, str] = field(default_factory=dict)
    # Requests in flight per adapter engine name, so retired versions unload once idle.
    active: dict[str, int] = field(default_factory=dict)
    calls: set[grpc.aio.UnaryStreamCall] = field(default_factory=set)
    cut: set[grpc.aio.UnaryStreamCall] = field(default_factory=set)
    loading: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    unloading: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    stats: pb.StatsResponse | None = None

    @property
    def takes_requests(self) -> bool:
        """Healthy and not draining: new requests may go here."""
        return self.healthy and not self.draining

    @property
    def load(self) -> float:
        """The share of its request slots in use: what routing balances."""
        return self.in_flight / self.capacity

    def residency(self) -> dict[str, object]:
        """Address, health, load and the adapter versions it holds with their state (the admin API's view)."""
        return {
            "address": self.address,
            "healthy": self.healthy,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "capacity": self.capacity,
            "adapters": dict(self.adapters),
            "error": self.last_error,
        }

    def polled_figures(self) -> dict[str, int] | None:
        """Its load and adapter-cache counters as of its last Stats poll; None when it has none or stopped
        answering (rather than the load it had)."""
        if self.stats is None or not self.healthy:
            return None
        cache = self.stats.adapter_cache
        return {
            "running_requests": self.stats.running_requests,
            "waiting_requests": self.stats.waiting_requests,
            "kv_slots_used": self.stats.kv_blocks_used,
            "draining": int(self.draining),
            "slot_hits": cache.slot_hits,
            "slot_misses": cache.slot_misses,
            "evictions": cache.evictions,
            "loads": cache.loads,
            "fills_ahead": cache.fills_ahead,
            "prefix_cache_queries": self.stats.prefix_cache_queries,
            "prefix_cache_hits": self.stats.prefix_cache_hits,
        }


def channel_closed_under(replica: Replica, stub: pb_grpc.EngineStub) -> bool:
    """Whether a call on `stub` ended with CancelledError because the pool's `set_address` closed its channel
    (grpc.aio cancels the calls of a closed channel that way), not because the awaiting task was cancelled."""
    task = asyncio.current_task()
    return replica.stub is not stub and task is not None and task.cancelling() == 0


# Retry hint when no engine answers: long enough for a supervised restart to make progress.
_NO_ENGINE_RETRY_S = 2.0


def no_engine() -> Unavailable:
    """The error for a request no engine replica can take (none healthy and taking requests)."""
    return Unavailable("no engine replica is available", retry_after_s=_NO_ENGINE_RETRY_S)
