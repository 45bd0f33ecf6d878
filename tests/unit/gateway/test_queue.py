from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from gateway.errors import InvalidRequest, NotFound, Throttled
from gateway.queue import FairQueue, QueueEntry, QueueLimits, TenantStats
from gateway.tenancy import TenantDirectory


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


_ids = itertools.count()


def _entry(
    tenant: str, cost: int = 100, priority: int = 0, deadline: float | None = None, at: float = 0.0
) -> QueueEntry:
    return QueueEntry(
        request_id=f"r{next(_ids)}",
        tenant=tenant,
        priority=priority,
        cost_tokens=cost,
        enqueued_at=at,
        deadline=deadline,
        payload=None,
    )


def _queue(*tenants: dict[str, Any], limits: QueueLimits | None = None) -> tuple[FairQueue, FakeClock]:
    clock = FakeClock()
    directory = TenantDirectory.from_config(list(tenants))
    unlimited = QueueLimits(max_total_depth=100_000, max_total_tokens_in_flight=10**12)
    return FairQueue(directory, limits or unlimited, clock=clock), clock


def _big(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "limits": {"max_queue_depth": 10_000, "max_tokens_in_flight": 10**9}, **extra}


def _serve(queue: FairQueue, clock: FakeClock, pops: int) -> list[QueueEntry]:
    """Pop, run and finish requests one at a time, charging each one's whole cost."""
    served = []
    for _ in range(pops):
        entry = queue.pop()
        assert entry is not None
        queue.started(entry)
        clock.now += entry.cost_tokens / 1000
        queue.charge(entry.tenant, entry.cost_tokens)
        queue.finished(entry, entry.cost_tokens)
        served.append(entry)
    return served


def test_empty_queue_pops_none() -> None:
    queue, _ = _queue({"name": "a"})
    assert queue.pop() is None
    assert len(queue) == 0


def test_fifo_within_a_tenant() -> None:
    queue, _ = _queue(_big("a"))
    entries = [_entry("a", cost=10 + i) for i in range(5)]
    for e in entries:
        queue.push(e)
    assert [queue.pop() for _ in entries] == entries


@pytest.mark.parametrize("weights", [(1, 1), (3, 1), (1, 4)])
def test_weighted_fairness_backlogged(weights: tuple[int, int]) -> None:
    queue, clock = _queue(_big("a", weight=weights[0]), _big("b", weight=weights[1]))
    rng = random.Random(7)
    # Different request sizes per tenant: fairness is about tokens, not request counts.
    for _ in range(2000):
        queue.push(_entry("a", cost=rng.randint(50, 150)))
        queue.push(_entry("b", cost=rng.randint(200, 600)))
    _serve(queue, clock, 1500)
    stats = queue.stats()
    ratio = stats["a"].served_tokens / stats["b"].served_tokens
    target = weights[0] / weights[1]
    assert abs(ratio / target - 1) < 0.10, (ratio, target)


def test_weighted_fairness_with_concurrent_streaming() -> None:
    """Several requests in flight at once, tokens charged as they stream, prompt charged at finish."""
    queue, clock = _queue(_big("a", weight=3), _big("b", weight=1))
    for _ in range(3000):
        queue.push(_entry("a", cost=300))
        queue.push(_entry("b", cost=300))
    running: dict[str, list[Any]] = {}
    for _ in range(20_000):
        while len(running) < 8:
            entry = queue.pop()
            assert entry is not None
            queue.started(entry)
            running[entry.request_id] = [entry, 200]  # 100 prompt tokens, 200 to generate
        for rid, slot in list(running.items()):
            entry, left = slot
            queue.charge(entry.tenant, 1)
            slot[1] = left - 1
            if slot[1] == 0:
                queue.finished(entry, 300)
                del running[rid]
        clock.now += 0.001
    stats = queue.stats()
    ratio = stats["a"].served_tokens / stats["b"].served_tokens
    assert abs(ratio / 3 - 1) < 0.10, ratio


def test_pops_in_a_row_alternate_before_any_charge() -> None:
    """A dispatched request counts with its reserved cost, so a burst of pops is shared fairly."""
    queue, _ = _queue(_big("a"), _big("b"))
    for _ in range(4):
        queue.push(_entry("a"))
        queue.push(_entry("b"))
    tenants = [e.tenant for e in (queue.pop() for _ in range(8)) if e is not None]
    assert len(tenants) == 8 and tenants.count("a") == 4
    assert all(x != y for x, y in itertools.pairwise(tenants))


def test_priority_bands_are_strict() -> None:
    queue, clock = _queue(_big("low"), _big("high", priority=5))
    for _ in range(3):
        queue.push(_entry("low", priority=0))
        queue.push(_entry("high", priority=5))
    # "high" has by far the largest counter afterwards, yet keeps winning while its band has work.
    served = _serve(queue, clock, 3)
    assert [e.tenant for e in served] == ["high"] * 3
    queue.push(_entry("high", priority=5))
    assert [e.tenant for e in _serve(queue, clock, 4)] == ["high", "low", "low", "low"]


def test_idle_tenant_earns_no_credit() -> None:
    queue, clock = _queue(_big("a"), _big("b"))
    for _ in range(200):
        queue.push(_entry("a"))
    _serve(queue, clock, 100)  # "a" alone: 10_000 tokens served while "b" was idle
    for _ in range(100):
        queue.push(_entry("b"))
    order = [e.tenant for e in _serve(queue, clock, 20)]
    # Without the lift "b" would get the next 100 requests in a row.
    assert order.count("a") == 10 and order.count("b") == 10


def test_returning_tenant_is_lifted_to_the_band_floor() -> None:
    queue, clock = _queue(_big("a"), _big("b"))
    queue.push(_entry("b"))
    _serve(queue, clock, 1)
    for _ in range(50):
        queue.push(_entry("a"))
    _serve(queue, clock, 50)  # queue empty again: "b" comes back to an empty band
    for _ in range(10):
        queue.push(_entry("b"))
    for _ in range(10):
        queue.push(_entry("a"))
    order = [e.tenant for e in _serve(queue, clock, 10)]
    assert order.count("b") <= 6, order


def test_tenant_depth_limit_with_retry_after() -> None:
    queue, clock = _queue({"name": "a", "limits": {"max_queue_depth": 2}}, {"name": "b"})
    queue.push(_entry("a"))
    queue.push(_entry("a"))
    with pytest.raises(Throttled, match="tenant 'a' has 2 requests queued") as caught:
        queue.push(_entry("a"))
    assert caught.value.retry_after_s == 1.0  # nothing served yet: no rate to estimate from
    queue.push(_entry("b"))  # other tenants are unaffected
    assert queue.stats()["a"].rejected == 1
    _serve(queue, clock, 1)  # 100 tokens over 0.1 s
    queue.push(_entry("a"))
    with pytest.raises(Throttled) as caught:
        queue.push(_entry("a"))
    # ~1000 tokens/s so far and 100-token requests queued: one slot frees in about 0.1 s.
    assert caught.value.retry_after_s == pytest.approx(0.1, rel=0.05)


def test_tenant_token_limit_counts_queued_and_in_flight() -> None:
    queue, _ = _queue({"name": "a", "limits": {"max_tokens_in_flight": 1000}})
    queue.push(_entry("a", cost=600))
    running = queue.pop()
    assert running is not None
    queue.push(_entry("a", cost=300))
    with pytest.raises(Throttled, match="would hold 1200 tokens"):
        queue.push(_entry("a", cost=300))
    queue.finished(running, 600)
    queue.push(_entry("a", cost=300))
    assert queue.stats()["a"].queued_tokens == 600


def test_cost_above_any_limit_is_invalid_not_throttled() -> None:
    queue, _ = _queue({"name": "a", "limits": {"max_tokens_in_flight": 1000}})
    with pytest.raises(InvalidRequest, match="needs 1001 tokens"):
        queue.push(_entry("a", cost=1001))


def test_global_limits() -> None:
    limits = QueueLimits(max_total_depth=3, max_total_tokens_in_flight=1000)
    queue, _ = _queue(_big("a"), _big("b"), limits=limits)
    queue.push(_entry("a"))
    queue.push(_entry("a"))
    queue.push(_entry("b"))
    with pytest.raises(Throttled, match="gateway queue is full"):
        queue.push(_entry("b"))
    assert queue.pop() is not None  # depth 2; its 100 tokens stay reserved while in flight
    queue.push(_entry("b", cost=600))
    assert queue.pop() is not None  # depth 2, 900 tokens held
    with pytest.raises(Throttled, match="gateway would hold 1001 tokens") as caught:
        queue.push(_entry("a", cost=101))
    assert caught.value.retry_after_s is not None
    queue.push(_entry("a", cost=100))
    assert queue.stats()["a"].rejected + queue.stats()["b"].rejected == 2


def test_unknown_tenant_and_duplicate_id() -> None:
    queue, _ = _queue({"name": "a"})
    with pytest.raises(NotFound, match="unknown tenant 'ghost'"):
        queue.push(_entry("ghost"))
    entry = _entry("a")
    queue.push(entry)
    with pytest.raises(InvalidRequest, match="already queued"):
        queue.push(entry)


def test_expire_returns_late_entries_only() -> None:
    queue, clock = _queue(_big("a"), _big("b"))
    late = _entry("a", deadline=105.0)
    keep = _entry("a", deadline=None)
    later = _entry("b", deadline=200.0)
    for e in (late, keep, later):
        queue.push(e)
    assert queue.expire() == []
    clock.now = 105.0
    assert queue.expire() == [late]
    assert queue.expire(now=300.0) == [later]
    assert len(queue) == 1
    assert queue.pop() is keep


def test_remove_queued_entry() -> None:
    queue, _ = _queue(_big("a"))
    entries = [_entry("a") for _ in range(3)]
    for e in entries:
        queue.push(e)
    assert queue.remove(entries[1].request_id) is entries[1]
    assert queue.remove(entries[1].request_id) is None
    assert queue.remove("never") is None
    assert queue.stats()["a"].depth == 2
    assert [queue.pop(), queue.pop(), queue.pop()] == [entries[0], entries[2], None]


def test_token_accounting_and_stats() -> None:
    queue, _ = _queue(_big("a"), _big("b"))
    first, second = _entry("a", cost=500, at=90.0), _entry("a", cost=200, at=95.0)
    queue.push(first)
    queue.push(second)
    assert queue.stats()["a"] == TenantStats(
        depth=2,
        oldest_wait_s=10.0,
        served_tokens=0,
        in_flight_requests=0,
        in_flight_tokens=0,
        rejected=0,
        queued_tokens=700,
    )
    popped = queue.pop()
    assert popped is first
    assert queue.stats()["a"].in_flight_tokens == 500
    assert queue.stats()["a"].in_flight_requests == 0
    queue.started(popped)
    queue.started(popped)  # idempotent
    queue.charge("a", 30)  # streamed completion tokens
    stats = queue.stats()["a"]
    assert (stats.in_flight_requests, stats.served_tokens, stats.oldest_wait_s) == (1, 30, 5.0)
    queue.finished(popped, 130)  # 100 prompt tokens that never streamed are charged now
    queue.finished(popped, 130)  # idempotent
    stats = queue.stats()["a"]
    assert (stats.in_flight_requests, stats.in_flight_tokens, stats.served_tokens) == (0, 0, 130)
    assert queue.stats()["b"] == TenantStats(0, 0.0, 0, 0, 0, 0, 0)


def test_finish_totals_exact_with_interleaved_requests() -> None:
    queue, _ = _queue(_big("a"))
    one, two = _entry("a"), _entry("a")
    queue.push(one)
    queue.push(two)
    for e in (queue.pop(), queue.pop()):
        assert e is not None
        queue.started(e)
    queue.charge("a", 10)
    queue.charge("a", 25)
    queue.finished(two, 40)  # really: two streamed 25 of 40
    queue.finished(one, 15)  # one streamed 10 of 15
    assert queue.stats()["a"].served_tokens == 55


def test_randomized_invariants() -> None:
    """Random pushes/pops/removals/expiries never break the bookkeeping or the limits."""
    rng = random.Random(1234)
    tenants: list[dict[str, Any]] = [
        {
            "name": f"t{i}",
            "weight": rng.choice([1, 2, 5]),
            "priority": rng.choice([0, 0, 1]),
            "limits": {"max_queue_depth": 20, "max_tokens_in_flight": 5000},
        }
        for i in range(4)
    ]
    queue, clock = _queue(*tenants, limits=QueueLimits(max_total_depth=50, max_total_tokens_in_flight=12_000))
    live: dict[str, QueueEntry] = {}
    running: list[QueueEntry] = []
    for _ in range(5000):
        clock.now += rng.random() * 0.01
        action = rng.random()
        if action < 0.5:
            t = rng.choice(tenants)
            entry = _entry(
                str(t["name"]),
                cost=rng.randint(1, 800),
                priority=int(t["priority"]),
                deadline=clock.now + rng.random() if rng.random() < 0.2 else None,
                at=clock.now,
            )
            try:
                queue.push(entry)
                live[entry.request_id] = entry
            except Throttled as exc:
                assert exc.retry_after_s is not None and exc.retry_after_s > 0
        elif action < 0.75:
            popped = queue.pop()
            if popped is not None:
                waiting = [e for e in live.values() if e is not popped]
                if waiting:
                    assert max(e.priority for e in waiting) <= popped.priority
                del live[popped.request_id]
                queue.started(popped)
                running.append(popped)
        elif action < 0.9 and running:
            done = running.pop(rng.randrange(len(running)))
            queue.charge(done.tenant, done.cost_tokens // 2)
            queue.finished(done, done.cost_tokens)
        elif action < 0.95 and live:
            rid = rng.choice(list(live))
            assert queue.remove(rid) is live.pop(rid)
        else:
            for gone in queue.expire():
                assert gone.deadline is not None and gone.deadline <= clock.now
                del live[gone.request_id]
        stats = queue.stats()
        assert len(queue) == len(live) == sum(s.depth for s in stats.values()) <= 50
        assert sum(s.in_flight_requests for s in stats.values()) == len(running)
        for t in tenants:
            name = str(t["name"])
            s = stats[name]
            assert s.depth <= 20
            assert s.in_flight_tokens + s.queued_tokens <= 5000
            assert s.queued_tokens == sum(e.cost_tokens for e in live.values() if e.tenant == name)
        held = sum(s.in_flight_tokens + s.queued_tokens for s in stats.values())
        assert held <= 12_000


def test_finishing_a_stale_entry_leaves_a_newer_one_with_its_id_alone() -> None:
    """A late cleanup of a request must not settle a newer request that reuses its id."""
    queue, _ = _queue(_big("a"))
    old = QueueEntry("x", "a", 0, 100, 0.0, None, None)
    queue.push(old)
    assert queue.pop() is old
    queue.finished(old, 0)
    new = QueueEntry("x", "a", 0, 300, 0.0, None, None)
    queue.push(new)
    assert queue.remove("x", old) is None
    assert queue.pop() is new
    queue.started(new)
    queue.finished(old, 0)  # the old request's cleanup, late
    stats = queue.stats()["a"]
    assert (stats.in_flight_requests, stats.in_flight_tokens) == (1, 300)
    queue.finished(new, 40)
    stats = queue.stats()["a"]
    assert (stats.in_flight_requests, stats.in_flight_tokens, stats.served_tokens) == (0, 0, 40)


def _retry_hint(queue: FairQueue, tenant: str, pushes: int) -> float | None:
    """Push `pushes` requests, the last one refused; return its Retry-After and empty the queue again."""
    for _ in range(pushes - 1):
        queue.push(_entry(tenant))
    with pytest.raises(Throttled) as caught:
        queue.push(_entry(tenant))
    while (entry := queue.pop()) is not None:
        queue.finished(entry, 0)
    return caught.value.retry_after_s


@pytest.mark.parametrize("idle_s", [10.0, 300.0])
def test_retry_after_does_not_count_idle_time_as_slow_service(idle_s: float) -> None:
    """A tenant (or the whole gateway) back from idling is told the recent serving rate, not the cap."""
    limits = QueueLimits(max_total_depth=3)
    queue, clock = _queue({"name": "a", "limits": {"max_queue_depth": 2}}, _big("b"), limits=limits)
    queue.push(_entry("a"))
    _serve(queue, clock, 1)  # 100 tokens in 0.1 s: about 1000 tokens/s
    assert _retry_hint(queue, "a", 3) == pytest.approx(0.1, rel=0.05)
    assert _retry_hint(queue, "b", 4) == pytest.approx(0.1, rel=0.05)
    clock.now += idle_s  # nothing queued or running meanwhile
    assert _retry_hint(queue, "a", 3) == pytest.approx(0.1, rel=0.05)
    clock.now += idle_s
    assert _retry_hint(queue, "b", 4) == pytest.approx(0.1, rel=0.05)
