"""Gateway metrics: OpenTelemetry instruments read out in Prometheus text format at /metrics.

Each `GatewayMetrics` owns its MeterProvider and Prometheus registry (not the process globals), so
several gateways can live in one process, as they do in tests. Queue and engine state are observed
at scrape time through callbacks; only per-request counts and latencies are recorded on the request
path, with attribute dicts cached so a request allocates nothing new for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,  # the default request deadline (server.request_timeout_s): long generations stay resolvable
)


_QUEUE_INSTRUMENTS: tuple[tuple[str, str, str, str, str], ...] = (
    ("adaptergate.queue.depth", "depth", "gauge", "1", "Requests waiting"),
    ("adaptergate.queue.oldest_wait", "oldest_wait_s", "gauge", "s", "Wait of the oldest queued request"),
    ("adaptergate.served_tokens", "served_tokens", "counter", "1", "Tokens served (prompt and completion) per tenant"),
    ("adaptergate.in_flight.requests", "in_flight_requests", "gauge", "1", "Requests running on engines"),
    ("adaptergate.in_flight.tokens", "in_flight_tokens", "gauge", "1", "Tokens reserved by running requests"),
    ("adaptergate.queue.rejected", "rejected", "counter", "1", "Requests refused by admission limits"),
)


# Per-replica engine figures, read from each replica's last Stats poll at each scrape: (name, key, kind, unit, what).
_ENGINE_INSTRUMENTS: tuple[tuple[str, str, str, str, str], ...] = (
    ("adaptergate.engine.running_requests", "running_requests", "gauge", "1", "Requests decoding on the replica"),
    ("adaptergate.engine.waiting_requests", "waiting_requests", "gauge", "1", "Requests waiting on the replica"),
    ("adaptergate.engine.kv_slots_used", "kv_slots_used", "gauge", "1", "KV-cache slots in use"),
    ("adaptergate.engine.draining", "draining", "gauge", "1", "1 while the replica drains: it takes no new requests"),
    ("adaptergate.engine.adapter_slot_hits", "slot_hits", "counter", "1", "Requests whose adapter was in a slot"),
    (
        "adaptergate.engine.adapter_slot_misses",
        "slot_misses",
        "counter",
        "1",
        "Requests whose adapter was copied into a slot",
    ),
    ("adaptergate.engine.adapter_evictions", "evictions", "counter", "1", "Idle adapters moved out of a slot"),
    ("adaptergate.engine.adapter_loads", "loads", "counter", "1", "Adapter reads from disk into host memory"),
    (
        "adaptergate.engine.adapter_fills_ahead",
        "fills_ahead",
        "counter",
        "1",
        "Slot fills done while the step before the request ran",
    ),
    (
        "adaptergate.engine.prefix_cache_queries",
        "prefix_cache_queries",
        "counter",
        "{token}",
        "Prompt tokens of the requests the replica admitted",
    ),
    (
        "adaptergate.engine.prefix_cache_hits",
        "prefix_cache_hits",
        "counter",
        "{token}",
        "Prompt tokens read from the replica's prefix cache instead of prefilled",
    ),
)
EngineStatsFn = Callable[[], Mapping[str, Mapping[str, int]]]


class QueueSnapshot(Protocol):
    """Per-tenant queue numbers (gateway.queue.TenantStats has these)."""

    @property
    def depth(self) -> int: ...
    @property
    def oldest_wait_s(self) -> float: ...
    @property
    def served_tokens(self) -> int: ...
    @property
    def in_flight_requests(self) -> int: ...
    @property
    def in_flight_tokens(self) -> int: ...
    @property
    def rejected(self) -> int: ...


QueueStatsFn = Callable[[], Mapping[str, QueueSnapshot]]


class GatewayMetrics:
    """Request, queue and engine metrics of one gateway."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._reader = PrometheusMetricReader(
            registry=self.registry, disable_target_info=True, scope_info_enabled=False
        )
        latency_view = View(
            instrument_name="adaptergate.*.duration",
            aggregation=ExplicitBucketHistogramAggregation(_LATENCY_BUCKETS),
        )
        self._provider = MeterProvider(
            metric_readers=[self._reader],
            resource=Resource.create({"service.name": "adaptergate"}),
            views=[latency_view],
        )
        meter = self._provider.get_meter("adaptergate.gateway")
        self._requests = meter.create_counter(
            "adaptergate.requests", unit="1", description="Finished requests by tenant, status and protocol"
        )
        self._latency = meter.create_histogram(
            "adaptergate.request.duration", unit="s", description="Request latency, start to last byte"
        )
        self._first_token = meter.create_histogram(
            "adaptergate.first_token.duration", unit="s", description="Time to the first generated text"
        )
        self._queue_wait = meter.create_histogram(
            "adaptergate.queue.wait.duration", unit="s", description="Time spent in the fair queue"
        )
        self._queue_stats: QueueStatsFn | None = None
        self._engine_health: Callable[[], Mapping[str, bool]] | None = None
        # Per-tenant queue figures, read from the queue's stats at each scrape: (name, stats field, kind, unit, what).
        for name, stat, kind, unit, description in _QUEUE_INSTRUMENTS:
            create = meter.create_observable_counter if kind == "counter" else meter.create_observable_gauge
            create(name, [self._observe(stat)], unit=unit, description=description)
        self._engine_stats: EngineStatsFn | None = None
        for name, key, kind, unit, description in _ENGINE_INSTRUMENTS:
            create = meter.create_observable_counter if kind == "counter" else meter.create_observable_gauge
            create(name, [self._observe_engine(key)], unit=unit, description=description)
        meter.create_observable_gauge(
            "adaptergate.engine.healthy",
            [self._observe_engines],
            unit="1",
            description="1 when an engine replica answers its health polls",
        )
        self._attrs: dict[tuple[str, str, str], dict[str, str]] = {}
        self._tenant_attrs: dict[str, dict[str, str]] = {}

    def observe_queue(self, stats: QueueStatsFn) -> None:
        """Read per-tenant queue numbers from `stats` at every scrape."""
        self._queue_stats = stats

    def observe_engines(self, health: Callable[[], Mapping[str, bool]]) -> None:
        """Read replica name -> healthy from `health` at every scrape."""
        self._engine_health = health

    def observe_engine_stats(self, stats: EngineStatsFn) -> None:
        """Read replica name -> its last polled figures (the keys of `_ENGINE_INSTRUMENTS`) at every scrape."""
        self._engine_stats = stats

    def request_done(self, tenant: str, status: str, protocol: str, seconds: float) -> None:
        attrs = self._request_attrs(tenant, status, protocol)
        self._requests.add(1, attrs)
        self._latency.record(seconds, attrs)

    def request_refused(self, tenant: str, status: str, protocol: str) -> None:
        """A request refused before it was submitted: counted, with no duration (it had none to speak of)."""
        self._requests.add(1, self._request_attrs(tenant, status, protocol))

    def _request_attrs(self, tenant: str, status: str, protocol: str) -> dict[str, str]:
        key = (tenant, status, protocol)
        attrs = self._attrs.get(key)
        if attrs is None:
            attrs = self._attrs[key] = {"tenant": tenant, "status": status, "protocol": protocol}
        return attrs

    def first_token(self, tenant: str, seconds: float) -> None:
        self._first_token.record(seconds, self._tenant(tenant))

    def queue_wait(self, tenant: str, seconds: float) -> None:
        self._queue_wait.record(seconds, self._tenant(tenant))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        self._provider.shutdown()

    def _tenant(self, tenant: str) -> dict[str, str]:
        attrs = self._tenant_attrs.get(tenant)
        if attrs is None:
            attrs = self._tenant_attrs[tenant] = {"tenant": tenant}
        return attrs

    def _observe(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            if self._queue_stats is None:
                return []
            return [
                Observation(getattr(stats, name), self._tenant(tenant)) for tenant, stats in self._queue_stats().items()
            ]

        return callback

    def _observe_engine(self, key: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            if self._engine_stats is None:
                return []
            return [Observation(stats[key], {"replica": name}) for name, stats in self._engine_stats().items()]

        return callback

    def _observe_engines(self, options: CallbackOptions) -> Iterable[Observation]:
        if self._engine_health is None:
            return []
        return [Observation(int(ok), {"replica": name}) for name, ok in self._engine_health().items()]
