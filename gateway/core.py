"""The gateway core: one request's way from policy through the fair queue to an engine and back.

    submit(request) -> policy check -> registry.resolve -> fair queue (wait for a slot)
                    -> engine stream -> TokenChunk... then Done, or a single Error

Failures become an `Error` event, never an exception, so every protocol has one place to map them.
Closing the event iterator early (client gone) removes the request from the queue or cancels it on
its engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context

from gateway.affinity import affinity_key
from gateway.api import (
    DetokenizeRequest,
    Done,
    Error,
    Event,
    GatewayRequest,
    Origin,
    PolicyChecker,
    PolicyDecision,
    PolicyInput,
    TokenChunk,
    TokenizeRequest,
    Tokens,
)
from gateway.asyncqueue import AsyncFairQueue, Ticket
from gateway.engine_client import EnginePool
from gateway.errors import GatewayError, PermissionDenied, Status
from gateway.metrics import GatewayMetrics
from gateway.queue import FairQueue, QueueLimits, TenantStats
from gateway.registry import Registry, ResolvedAdapter
from gateway.replica import Replica, ReplicaFailed, no_engine
from gateway.tenancy import TenantDirectory
from gateway.tokenize import detokenize, tokenize

log = logging.getLogger("adaptergate.core")
access_log = logging.getLogger("adaptergate.access")
_tracer = trace.get_tracer("adaptergate.gateway")
# Rough characters per token, for the admission estimate before the engine has tokenized anything.
_CHARS_PER_TOKEN = 4


class Gateway:
    """Implements `gateway.api.Submitter`; an async context manager that keeps engines in step
    with the registry while open."""

    def __init__(
        self,
        *,
        tenants: TenantDirectory,
        policy: PolicyChecker,
        registry: Registry,
        pool: EnginePool,
        limits: QueueLimits,
        default_max_tokens: int = 256,
        anonymous_tenant: str | None = None,
        metrics: GatewayMetrics | None = None,
        access_log_enabled: bool = True,
    ) -> None:
        self.tenants = tenants
        self.registry = registry
        self.pool = pool
        self.fair_queue = FairQueue(tenants, limits)
        self.queue: AsyncFairQueue[Replica] = AsyncFairQueue(self.fair_queue, pool)
        self.metrics = metrics or GatewayMetrics()
        self._policy = policy
        self._default_max_tokens = default_max_tokens
        self._anonymous = anonymous_tenant
        self._access_log = access_log_enabled
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine_calls = itertools.count()
        # Engine ids are unique per gateway process too: several gateways may share an engine, and a client may
        # send the same id through two of them (the engine refuses an id in use; an Abort must hit one call only).
        self._process_token = secrets.token_hex(4)
        self.metrics.observe_queue(self.fair_queue.stats)
        self.metrics.observe_engines(lambda: {r.name: r.healthy for r in pool.replicas})
        self.metrics.observe_engine_stats(pool.polled_figures)

    async def __aenter__(self) -> Gateway:
        self._loop = asyncio.get_running_loop()
        self.pool.add_capacity_listener(self.queue.pump)
        self.pool.add_health_listener(self._on_replica_health)
        self.registry.add_listener(self._on_registry_change)
        await self.pool.adapters.register_everywhere(self.registry.versions_in_use())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- Submitter -----------------------------------------------------------------------------

    def authenticate(self, api_key: str | None) -> str:
        """The tenant owning `api_key`; without a key, the anonymous tenant if one is configured."""
        if not api_key and self._anonymous is not None:
            return self._anonymous
        return self.tenants.authenticate(api_key).name

    def refused(self, tenant: str | None, status: Status, origin: Origin) -> None:
        # "-" for every unauthenticated request: label sets stay bounded whatever keys clients send.
        self.metrics.request_refused(tenant or "-", status.value, origin.value)

    def models_for(self, tenant: str) -> list[str]:
        """`base` plus every adapter both the tenant and the adapter's spec allow."""
        allowed = self.tenants.get(tenant)
        names = ["base"]
        for instance in self.registry.list():
            if not allowed.may_use(instance.name):
                continue
            if "*" in instance.allowed_tenants or tenant in instance.allowed_tenants:
                names.append(instance.name)
        return names

    def queue_stats(self) -> dict[str, TenantStats]:
        return self.fair_queue.stats()

    def health(self) -> tuple[bool, str]:
        """Ready when at least one engine replica takes requests (answers, and does not drain)."""
        healthy = self.pool.healthy_count()
        detail = f"{healthy}/{len(self.pool.replicas)} engine replicas healthy"
        draining = sum(1 for r in self.pool.replicas if r.healthy and r.draining)
        if draining:  # they answer but take no new requests: not counted above
            detail += f" ({draining} more draining)"
        return healthy > 0, detail

    async def submit(self, request: GatewayRequest) -> AsyncIterator[Event]:
        """Admit `request` and stream its events (see `gateway.api.Submitter`)."""
        started = time.perf_counter()
        status = Status.CANCELLED
        ticket: Ticket[Replica] | None = None
        used_tokens = 0
        usage_note: Done | None = None
        first_token_at = 0.0
        parent = propagate.extract(request.trace_context) if request.trace_context else None
        tenant = request.tenant
        # Request ids are the clients' own: the queue knows them per tenant, so two tenants may pick the same
        # one (and neither learns the other's ids from a refusal).
        queued_id = f"{tenant}/{request.request_id}"
        try:
            try:
                # Engines are checked after admission: a request that can never succeed (unknown adapter, policy
                # denial) gets its own refusal, not a 503 whose Retry-After invites the client to send it again.
                resolved = await self._admit(request)
                if not self.pool.healthy_count():
                    raise no_engine()
                engine_name = resolved.engine_name if resolved is not None else None
                affinity = affinity_key(request, engine_name)
                cost = self._cost(request)
                queue_span = _tracer.start_span("gateway.queue", context=parent)
                queued_at = time.perf_counter()
                try:
                    ticket = await self.queue.acquire(
                        queued_id, tenant, self._priority(tenant), cost, request.deadline, engine_name, affinity
                    )
                finally:
                    queue_span.end()
                self.metrics.queue_wait(tenant, time.perf_counter() - queued_at)
                # One more than the replicas: a replica that forgot an adapter gets a second try.
                attempts = len(self.pool.replicas) + 1
                while True:
                    engine_span = _tracer.start_span("gateway.engine", context=parent)
                    assert ticket.slot is not None
                    engine_span.set_attribute("engine.replica", ticket.slot.name)
                    try:
                        # One engine id per call: the Abort of a cut stream goes out in the background and must
                        # not reach a later call of the same client id (a retry, or the client's next request).
                        engine_id = f"{queued_id}#{self._process_token}.{next(self._engine_calls)}"
                        call = dataclasses.replace(request, request_id=engine_id)
                        stream = self.pool.generate(ticket.slot, call, resolved, _trace_metadata(engine_span))
                        async with contextlib.aclosing(stream):
                            async for event in stream:
                                if type(event) is TokenChunk:
                                    if not first_token_at:
                                        first_token_at = time.perf_counter()
                                    self.queue.charge(tenant, event.token_count)
                                    used_tokens += event.token_count
                                else:
                                    assert isinstance(event, Done)
                                    usage_note = event
                                    used_tokens = event.usage.total_tokens
                                    status = Status.OK
                                yield event
                        break
                    except ReplicaFailed as e:
                        attempts -= 1
                        if not e.before_admission or attempts <= 0:
                            raise
                        # Nothing reached the client yet: run it on another replica.
                        log.info("retrying on another replica: %s", e.message, extra=_ids(request))
                        self.queue.release(ticket, 0)
                        ticket = None
                        if not self.pool.healthy_count():
                            raise no_engine() from None
                        ticket = await self.queue.acquire(
                            queued_id,
                            tenant,
                            self._priority(tenant),
                            cost,
                            request.deadline,
                            engine_name,
                            affinity,
                        )
                    finally:
                        engine_span.end()
            except GatewayError as e:
                status = e.status
                yield Error(e.status, e.message, e.retry_after_s)
        finally:
            if ticket is not None:
                self.queue.release(ticket, used_tokens)
            elapsed = time.perf_counter() - started
            self.metrics.request_done(tenant, status.value, request.protocol.value, elapsed)
            if first_token_at:
                self.metrics.first_token(tenant, first_token_at - started)
            if self._access_log:
                self._log_access(request, status, elapsed, usage_note, parent)

    # -- TokenService ----------------------------------------------------------------------------

    async def tokenize(self, request: TokenizeRequest) -> Tokens:
        """`request` tokenized by an engine, once the tenant may use its model as for a completion (or a chat)."""
        await self._admit(
            GatewayRequest(
                "tokenize", request.tenant, request.adapter, request.prompt, request.messages, protocol=request.protocol
            )
        )
        return await tokenize(self.pool, request)

    async def detokenize(self, request: DetokenizeRequest) -> str:
        """The text of `request.ids`, once the tenant may use its model as for a completion."""
        await self._admit(GatewayRequest("detokenize", request.tenant, request.adapter, protocol=request.protocol))
        return await detokenize(self.pool, request)

    # -- steps ---------------------------------------------------------------------------------

    async def _admit(self, request: GatewayRequest) -> ResolvedAdapter | None:
        tenant = self.tenants.get(request.tenant)
        prompt_chars = _prompt_chars(request)
        decision: PolicyDecision = await self._policy.check(
            PolicyInput(request.tenant, request.adapter, request.protocol, request.sampling.max_tokens, prompt_chars)
        )
        if not decision.allow:
            raise PermissionDenied(decision.reason or "denied by policy")
        if request.adapter is None:
            return None
        if not tenant.may_use(request.adapter):
            raise PermissionDenied(f"tenant {tenant.name!r} may not use adapter {request.adapter!r}")
        scope = "chat" if request.messages is not None else "completions"
        return self.registry.resolve(request.adapter, request.tenant, request.routing_key, scope=scope)

    def _cost(self, request: GatewayRequest) -> int:
        max_tokens = request.sampling.max_tokens
        max_tokens = self._default_max_tokens if max_tokens is None else max_tokens  # 0: the prompt alone
        return _prompt_chars(request) // _CHARS_PER_TOKEN + max_tokens

    def _priority(self, tenant: str) -> int:
        return self.tenants.get(tenant).priority

    def _log_access(
        self, request: GatewayRequest, status: Status, elapsed: float, done: Done | None, parent: Context | None
    ) -> None:
        extra: dict[str, Any] = {
            **_ids(request),
            "adapter": request.adapter,
            "protocol": request.protocol.value,
            "status": status.value,
            "latency_ms": round(elapsed * 1000, 3),
        }
        # The request's trace (its protocol span's), so a log line leads to the spans; no span is made current.
        span_context = trace.get_current_span(parent).get_span_context() if parent is not None else None
        if span_context is not None and span_context.is_valid:
            extra["trace_id"] = f"{span_context.trace_id:032x}"
        if done is not None:
            extra.update(
                adapter_version=done.adapter_version,
                finish_reason=done.finish_reason,
                prompt_tokens=done.usage.prompt_tokens,
                completion_tokens=done.usage.completion_tokens,
            )
        access_log.info("request finished", extra=extra)

    # -- keeping engines in step with the registry ---------------------------------------------

    def _on_registry_change(self, name: str) -> None:
        # The registry may call from a worker thread; engine calls belong to the event loop.
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._spawn, lambda: self._sync_adapter(name))

    def _on_replica_health(self, replica: Replica) -> None:
        if replica.healthy and not replica.draining:
            # Refreshed there: `pin` or a source may have changed while it was out of reach, adapters kept.
            adapters = self.pool.adapters
            self._spawn(lambda: adapters.register_everywhere(self.registry.versions_in_use(), refresh=(replica,)))
        elif self.pool.healthy_count() == 0:
            failed = self.queue.fail_waiting(no_engine())
            if failed:
                log.warning("no engine replica takes requests: failed %d queued requests", failed)

    async def _sync_adapter(self, name: str) -> None:
        """Load the versions of `name` that now take traffic; retire the rest once idle."""
        in_use = [r for r in self.registry.versions_in_use() if r.name == name]
        # Registered again where known too: an apply that changes only `pin` (or a version's source) must
        # reach the engines.
        await self.pool.adapters.register_everywhere(in_use, refresh=self.pool.replicas)
        # Read again: an apply of the same name may have come, and had its sync, while this one waited.
        keep = {r.engine_name for r in self.registry.versions_in_use() if r.name == name}
        prefix = f"{name}@"
        known = {n for r in self.pool.replicas for n in r.adapters} | self.pool.adapters.wanted_names()
        stale = {n for n in known if n.startswith(prefix) and n not in keep}
        if stale:
            log.info("retiring adapter versions %s", sorted(stale))
            self.pool.adapters.retire(stale)

    def _spawn(self, factory: Callable[[], Any]) -> None:
        task = asyncio.ensure_future(factory())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _prompt_chars(request: GatewayRequest) -> int:
    if request.messages is not None:
        return sum(len(m.content) for m in request.messages)
    return len(request.prompt or "")


def _ids(request: GatewayRequest) -> dict[str, str]:
    return {"request_id": request.request_id, "tenant": request.tenant}


def _trace_metadata(span: trace.Span) -> tuple[tuple[str, str], ...] | None:
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span, Context()))
    return tuple(carrier.items())
