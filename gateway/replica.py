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
