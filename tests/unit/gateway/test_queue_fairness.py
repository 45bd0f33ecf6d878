"""The fair queue under churn: the asyncio layer's cleanup, counters and property-style fairness."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from typing import Any

import pytest

from gateway.asyncqueue import AsyncFairQueue, Ticket
from gateway.errors import GatewayError, Unavailable
from gateway.queue import FairQueue, QueueEntry, QueueLimits
from gateway.tenancy import TenantDirectory


class Slots:
    """A `SlotSource` with a fixed number of slots that pumps its listener when one frees."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.used = 0
        self.listener: Any = None
        self.affinities: list[str | None] = []

    def has_capacity(self) -> bool:
        return self.used < self.count

    def acquire(self, engine_name: str | None, *, affinity: str | None = None) -> object | None:
        if self.used >= self.count:
            return None
        self.used += 1
        self.affinities.append(affinity)
        return object()

    def release(self, slot: object) -> None:
        self.used -= 1
        if self.listener is not None:
            self.listener()


def _async_queue(slots: int) -> tuple[AsyncFairQueue[object], Slots]:
    directory = TenantDirectory.from_config([{"name": "a"}, {"name": "b"}])
    source = Slots(slots)
    queue: AsyncFairQueue[object] = AsyncFairQueue(FairQueue(directory, QueueLimits()), source)
    source.listener = queue.pump
    return queue, source


async def test_a_waiter_failed_by_fail_waiting_does_not_remove_a_new_request_with_its_id() -> None:
    queue, slots = _async_queue(0)
    old = asyncio.create_task(queue.acquire("a/x", "a", 0, 100, None, None))
    await asyncio.sleep(0)
    assert queue.queue.stats()["a"].depth == 1
    # The client sends the id again; its task is scheduled before the old one's cleanup runs.
    new = asyncio.create_task(queue.acquire("a/x", "a", 0, 100, None, None))
    assert queue.fail_waiting(Unavailable("no engine")) == 1
    with pytest.raises(Unavailable):
        await old
    assert queue.queue.stats()["a"].depth == 1  # the new request still waits for its turn
    slots.count = 1
    queue.pump()
    ticket = await asyncio.wait_for(new, 1.0)
    queue.release(ticket, 10)
    assert slots.used == 0


async def test_a_cancelled_waiter_does_not_settle_a_new_request_with_its_id() -> None:
    queue, slots = _async_queue(0)
    old = asyncio.create_task(queue.acquire("a/x", "a", 0, 100, None, None))
    await asyncio.sleep(0)
    new = asyncio.create_task(queue.acquire("a/x", "a", 0, 300, None, None))
    old.cancel()
    # A slot frees in the same instant: the pump drops the cancelled entry, so its id is free again.
    slots.count = 1
    queue.pump()
    with pytest.raises(asyncio.CancelledError):
        await old
    ticket: Ticket[object] = await asyncio.wait_for(new, 1.0)
    stats = queue.queue.stats()["a"]
    assert (stats.in_flight_requests, stats.in_flight_tokens) == (1, 300)
    queue.release(ticket, 40)
    stats = queue.queue.stats()["a"]
    assert (stats.in_flight_requests, stats.in_flight_tokens, stats.served_tokens) == (0, 0, 40)
    assert slots.used == 0


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_served_tokens_follow_the_weights_under_random_arrivals(seed: int) -> None:
    """Backlogged tenants with random weights, request sizes, early stops and bursty arrivals."""
    rng = random.Random(seed)
    weights = {f"t{i}": rng.choice([0.5, 1, 2, 3, 5]) for i in range(4)}
    directory = TenantDirectory.from_config(
        [
            {"name": n, "weight": w, "limits": {"max_queue_depth": 10**6, "max_tokens_in_flight": 10**12}}
            for n, w in weights.items()
        ]
    )
    clock = _Clock()
    queue = FairQueue(directory, QueueLimits(max_total_depth=10**7, max_total_tokens_in_flight=10**13), clock=clock)
    ids = itertools.count()

    def arrive(tenant: str) -> None:
        prompt, max_tokens = rng.randint(5, 300), rng.randint(5, 300)
        used = rng.randint(1, max_tokens)  # stops early: reservations overestimate
        queue.push(QueueEntry(f"r{next(ids)}", tenant, 0, prompt + max_tokens, clock.now, None, (prompt, used)))

    running: dict[str, list[Any]] = {}
    for _ in range(6000):
        for name in weights:
            # Bursts of random size whenever a queue runs low: nobody ever runs dry.
            if queue.stats()[name].depth < 3:
                for _ in range(rng.randint(3, 30)):
                    arrive(name)
        while len(running) < 8:
            entry = queue.pop()
            assert entry is not None
            queue.started(entry)
            running[entry.request_id] = [entry, 0]
        for rid, slot in list(running.items()):
            entry, streamed = slot
            prompt, used = entry.payload
            step_tokens = min(rng.randint(1, 4), used - streamed)
            queue.charge(entry.tenant, step_tokens)
            slot[1] = streamed + step_tokens
            if slot[1] >= used:
                queue.finished(entry, prompt + used)
                del running[rid]
        clock.now += 0.001
    stats = queue.stats()
    normalized = {n: stats[n].served_tokens / w for n, w in weights.items()}
    mean = sum(normalized.values()) / len(normalized)
    assert all(abs(v / mean - 1) < 0.05 for v in normalized.values()), (weights, normalized)


async def test_churn_of_cancels_deadlines_retries_and_engine_loss_leaves_no_count_behind() -> None:
    queue, slots = _async_queue(3)
    rng = random.Random(5)
    loop = asyncio.get_running_loop()

    async def one(n: int) -> None:
        tenant = rng.choice(["a", "b"])
        rid = f"{tenant}/{rng.randrange(40)}"  # ids reused while older requests still clean up
        deadline = time.monotonic() + rng.random() * 0.01 if rng.random() < 0.3 else None
        try:
            ticket = await queue.acquire(rid, tenant, 0, rng.randint(1, 300), deadline, None)
        except GatewayError:
            return
        used = 0
        try:
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
                queue.charge(tenant, 5)
                used += 5
            if used == 0 and rng.random() < 0.3:  # retried elsewhere: release, then queue again
                queue.release(ticket, 0)
                ticket = await queue.acquire(rid, tenant, 0, 50, None, None)
        finally:
            queue.release(ticket, used)

    tasks: list[asyncio.Task[None]] = []
    for n in range(3000):
        tasks.append(loop.create_task(one(n)))
        if rng.random() < 0.3:
            await asyncio.sleep(0)
        if rng.random() < 0.05:
            rng.choice(tasks).cancel()
        if rng.random() < 0.003:
            queue.fail_waiting(Unavailable("no engine"))
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    assert slots.used == 0 and len(queue.queue) == 0
    for stats in queue.queue.stats().values():
        assert (stats.depth, stats.queued_tokens, stats.in_flight_requests, stats.in_flight_tokens) == (0, 0, 0, 0)
