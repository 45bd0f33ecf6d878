"""The multi-tenant request queue: per-tenant FIFOs, a fair pick, admission limits and accounting.

Plain objects with an injectable clock and no asyncio, so the policy is tested in virtual time; the
async layer that waits on it lives in `gateway.core`.

Fairness is a virtual token counter per tenant (VTC): served tokens divided by the tenant's weight.
Within the highest priority band that has waiting work, the tenant with the smallest counter goes
next. A dispatched request counts with its whole estimated cost until it finishes (then with what it
really used), so several pops in a row already alternate between tenants. A tenant whose queue in a
band was empty is lifted to that band's current minimum when it pushes again: idle time earns no credit.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.errors import InvalidRequest, Throttled
from gateway.tenancy import Tenant, TenantDirectory

_RATE_WINDOW_S = 5.0
_RETRY_MIN_S = 0.05
_RETRY_MAX_S = 60.0
_RETRY_UNKNOWN_S = 1.0


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """Gateway-wide admission limits (each tenant also has its own)."""

    max_total_depth: int = 1024
    max_total_tokens_in_flight: int = 262144


@dataclass(slots=True)
class QueueEntry:
    """One waiting request.

    `priority` picks the band (higher first). `cost_tokens` (estimated prompt + max_tokens) is
    reserved against the limits from push until `finished`. `deadline` is on the queue's clock.
    """

    request_id: str
    tenant: str
    priority: int
    cost_tokens: int
    enqueued_at: float
    deadline: float | None
    payload: object


@dataclass(frozen=True, slots=True)
class TenantStats:
    """A tenant's queue state; `in_flight_tokens` is the reservation of dispatched requests."""

    depth: int
    oldest_wait_s: float
    served_tokens: int
    in_flight_requests: int
    in_flight_tokens: int
    rejected: int
    queued_tokens: int = 0


class _RateMeter:
    """Recent throughput as an exponentially weighted average, bias-corrected while it warms up.

    Time without work is skipped (`skip_idle`): an idle tenant's throughput is unknown, not zero.
    """

    __slots__ = ("_level", "_start", "_when")

    def __init__(self, now: float) -> None:
        self._level = 0.0
        self._start = now
        self._when = now

    def add(self, amount: float, now: float) -> None:
        self._decay(now)
        self._level += amount

    def per_second(self, now: float) -> float:
        self._decay(now)
        # Before a full window has passed the average would otherwise understate the rate.
        span = 1.0 - math.exp(-max(now - self._start, 1e-3) / _RATE_WINDOW_S)
        return self._level / (_RATE_WINDOW_S * span)

    def skip_idle(self, now: float) -> None:
        """Nothing was queued or running since the last update: let that time neither decay the
        average nor count as warm-up."""
        if now > self._when:
            self._start += now - self._when
            self._when = now

    def _decay(self, now: float) -> None:
        if now > self._when:
            self._level *= math.exp(-(now - self._when) / _RATE_WINDOW_S)
            self._when = now


@dataclass(slots=True)
class _TenantState:
    tenant: Tenant
    rate: _RateMeter
    bands: dict[int, deque[QueueEntry]] = field(default_factory=dict)
    depth: int = 0
    queued_tokens: int = 0
    virtual: float = 0.0
    served: int = 0
    reserved: int = 0
    running: int = 0
    charged_in_flight: int = 0
    rejected: int = 0

    def effective(self) -> float:
        """Virtual counter including what dispatched requests are expected to cost still."""
        pending = max(0, self.reserved - self.charged_in_flight)
        return self.virtual + pending / self.tenant.weight


class FairQueue:
    """Per-tenant FIFOs with a weighted-fair pick, strict priority bands and admission limits."""

    def __init__(
        self,
        tenants: TenantDirectory,
        limits: QueueLimits,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._directory = tenants
        self._limits = limits
        self._clock = clock
        self._states: dict[str, _TenantState] = {}
        self._waiting: dict[int, dict[str, None]] = {}  # band -> tenants with queued work (ordered set)
        self._floor: dict[int, float] = {}
        self._queued: dict[str, QueueEntry] = {}
        self._dispatched: dict[str, QueueEntry] = {}
        self._started: set[str] = set()
        self._queued_tokens = 0
        self._reserved = 0
        self._rate = _RateMeter(clock())

    def __len__(self) -> int:
        return len(self._queued)

    @property
    def total_depth(self) -> int:
        """Requests waiting, all tenants together."""
        return len(self._queued)

    def push(self, entry: QueueEntry) -> None:
        """Queue `entry` or raise `Throttled` (with a retry estimate) when a limit would be exceeded.

        Raises `InvalidRequest` for a duplicate request id or a cost no limit could ever admit, and
        `NotFound` for an unknown tenant.
        """
        state = self._state(entry.tenant)
        tenant = state.tenant
        if entry.request_id in self._queued or entry.request_id in self._dispatched:
            # The core queues ids per tenant ("<tenant>/<id>"): the message names the id the client sent.
            shown = entry.request_id.removeprefix(f"{entry.tenant}/")
            raise InvalidRequest(f"request id {shown!r} is already queued or running")
        cap = min(tenant.max_tokens_in_flight, self._limits.max_total_tokens_in_flight)
        if entry.cost_tokens < 0 or entry.cost_tokens > cap:
            raise InvalidRequest(f"request needs {entry.cost_tokens} tokens (prompt + max_tokens); the limit is {cap}")
        now = self._clock()
        # Without this, a tenant (or gateway) back from a few idle minutes would read its throughput as
        # about zero and be told to retry after the maximum, unlike one that was never served at all.
        if state.depth == 0 and state.reserved == 0:
            state.rate.skip_idle(now)
        if not self._queued and self._reserved == 0:
            self._rate.skip_idle(now)
        self._admit(state, entry.cost_tokens, now)

        queue = state.bands.get(entry.priority)
        if queue is None:
            self._lift(state, entry.priority)
            queue = state.bands[entry.priority] = deque()
            self._waiting.setdefault(entry.priority, {})[tenant.name] = None
        queue.append(entry)
        state.depth += 1
        state.queued_tokens += entry.cost_tokens
        self._queued_tokens += entry.cost_tokens
        self._queued[entry.request_id] = entry

    def pop(self) -> QueueEntry | None:
        """Take the next request by the fair pick, or None when nothing waits.

        The entry stays reserved against the limits until `finished`. Deadlines are not checked here:
        call `expire` first.
        """
        if not self._waiting:
            return None
        band = max(self._waiting)
        candidates = [self._states[name] for name in self._waiting[band]]
        state = min(
            candidates,
            key=lambda s: (s.effective(), s.bands[band][0].enqueued_at, s.tenant.name),
        )
        self._floor[band] = max(self._floor.get(band, 0.0), state.effective())
        entry = state.bands[band][0]
        self._unqueue(state, entry)
        self._dispatched[entry.request_id] = entry
        state.reserved += entry.cost_tokens
        self._reserved += entry.cost_tokens
        return entry

    def remove(self, request_id: str, entry: QueueEntry | None = None) -> QueueEntry | None:
        """Drop a still-queued request (its client went away); None if it is not queued.

        With `entry`, only that very entry is dropped, not a newer request that reuses its id.
        """
        queued = self._queued.get(request_id)
        if queued is None or (entry is not None and queued is not entry):
            return None
        entry = queued
        self._unqueue(self._states[entry.tenant], entry)
        return entry

    def expire(self, now: float | None = None) -> list[QueueEntry]:
        """Drop and return queued entries whose deadline has passed, oldest first."""
        when = self._clock() if now is None else now
        late = [e for e in self._queued.values() if e.deadline is not None and e.deadline <= when]
        for entry in late:
            self._unqueue(self._states[entry.tenant], entry)
        return late

    def started(self, entry: QueueEntry) -> None:
        """The engine accepted a popped entry: it now counts as an in-flight request."""
        if entry.request_id in self._dispatched and entry.request_id not in self._started:
            self._started.add(entry.request_id)
            self._states[entry.tenant].running += 1

    def charge(self, tenant: str, tokens: int) -> None:
        """Count `tokens` served to `tenant` (call as they stream); this drives the fair pick."""
        if tokens <= 0:
            return
        state = self._state(tenant)
        if state.reserved > 0:
            state.charged_in_flight += tokens
        self._account(state, tokens)

    def finished(self, entry: QueueEntry, used_tokens: int) -> None:
        """Release a popped entry's reservation; `used_tokens` is what it really consumed in all.

        Tokens of `used_tokens` not yet passed to `charge` (e.g. prompt tokens, which never stream)
        are charged now. Unknown or already finished entries are ignored, and so is an entry whose
        id a newer request has taken since (its cleanup may run after the id was queued again).
        """
        if self._dispatched.get(entry.request_id) is not entry:
            return
        del self._dispatched[entry.request_id]
        state = self._states[entry.tenant]
        state.reserved -= entry.cost_tokens
        self._reserved -= entry.cost_tokens
        if entry.request_id in self._started:
            self._started.discard(entry.request_id)
            state.running -= 1
        # Charges are per tenant, so attribute them to finishing entries first come first served;
        # the totals come out exact whichever entry finishes first.
        attributed = min(max(used_tokens, 0), state.charged_in_flight)
        state.charged_in_flight -= attributed
        if used_tokens > attributed:
            self._account(state, used_tokens - attributed)
        if state.reserved == 0:
            state.charged_in_flight = 0

    def stats(self) -> dict[str, TenantStats]:
        """Per-tenant snapshot for metrics and the admin API, every configured tenant included."""
        now = self._clock()
        out: dict[str, TenantStats] = {}
        for tenant in self._directory.tenants():
            state = self._states.get(tenant.name)
            if state is None:
                out[tenant.name] = TenantStats(0, 0.0, 0, 0, 0, 0, 0)
                continue
            heads = [q[0].enqueued_at for q in state.bands.values()]
            out[tenant.name] = TenantStats(
                depth=state.depth,
                oldest_wait_s=max(0.0, now - min(heads)) if heads else 0.0,
                served_tokens=state.served,
                in_flight_requests=state.running,
                in_flight_tokens=state.reserved,
                rejected=state.rejected,
                queued_tokens=state.queued_tokens,
            )
        return out

    def _state(self, name: str) -> _TenantState:
        state = self._states.get(name)
        if state is None:
            tenant = self._directory.get(name)
            state = self._states[name] = _TenantState(tenant, _RateMeter(self._clock()))
        return state

    def _admit(self, state: _TenantState, cost: int, now: float) -> None:
        tenant = state.tenant
        limits = self._limits
        tenant_rate = state.rate.per_second(now) or self._rate.per_second(now)
        if state.depth >= tenant.max_queue_depth:
            self._reject(
                state,
                f"tenant {tenant.name!r} has {state.depth} requests queued (limit {tenant.max_queue_depth})",
                _retry_after(state.queued_tokens / state.depth, tenant_rate),
            )
        held = state.reserved + state.queued_tokens + cost
        if held > tenant.max_tokens_in_flight:
            self._reject(
                state,
                f"tenant {tenant.name!r} would hold {held} tokens queued or in flight "
                f"(limit {tenant.max_tokens_in_flight})",
                _retry_after(held - tenant.max_tokens_in_flight, tenant_rate),
            )
        depth = len(self._queued)
        if depth >= limits.max_total_depth:
            self._reject(
                state,
                f"gateway queue is full ({depth} requests, limit {limits.max_total_depth})",
                _retry_after(self._queued_tokens / max(depth, 1), self._rate.per_second(now)),
            )
        held = self._reserved + self._queued_tokens + cost
        if held > limits.max_total_tokens_in_flight:
            self._reject(
                state,
                f"gateway would hold {held} tokens queued or in flight (limit {limits.max_total_tokens_in_flight})",
                _retry_after(held - limits.max_total_tokens_in_flight, self._rate.per_second(now)),
            )

    def _reject(self, state: _TenantState, message: str, retry_after_s: float) -> None:
        state.rejected += 1
        raise Throttled(message, retry_after_s=retry_after_s)

    def _lift(self, state: _TenantState, band: int) -> None:
        others = self._waiting.get(band)
        if others:
            target = min(self._states[name].effective() for name in others)
        else:
            target = self._floor.get(band, 0.0)
        gap = target - state.effective()
        if gap > 0:
            state.virtual += gap

    def _unqueue(self, state: _TenantState, entry: QueueEntry) -> None:
        queue = state.bands[entry.priority]
        # Identity, not ==: entries are mutable dataclasses whose payloads need not compare cheaply.
        index = next(i for i, queued in enumerate(queue) if queued is entry)
        del queue[index]
        if not queue:
            del state.bands[entry.priority]
            waiting = self._waiting[entry.priority]
            del waiting[state.tenant.name]
            if not waiting:
                del self._waiting[entry.priority]
        state.depth -= 1
        state.queued_tokens -= entry.cost_tokens
        self._queued_tokens -= entry.cost_tokens
        del self._queued[entry.request_id]

    def _account(self, state: _TenantState, tokens: int) -> None:
        now = self._clock()
        state.served += tokens
        state.virtual += tokens / state.tenant.weight
        state.rate.add(tokens, now)
        self._rate.add(tokens, now)


def _retry_after(tokens: float, tokens_per_second: float) -> float:
    """Seconds until `tokens` of work drain at the recent rate, clamped to a sane range."""
    if tokens_per_second <= 0:
        return _RETRY_UNKNOWN_S
    return min(_RETRY_MAX_S, max(_RETRY_MIN_S, tokens / tokens_per_second))
