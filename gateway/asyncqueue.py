"""The asyncio layer over `FairQueue`: a request waits here until an engine slot is free for it.

Dispatch is event driven rather than a polling task: every push, every freed slot and every replica
that turns healthy pumps the queue synchronously, popping entries by the fair pick while a slot exists
and handing each its slot through a future. A request that finds a free slot therefore never leaves
the running task, and one that waits is woken exactly when its turn comes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from gateway.errors import DeadlineExceeded, Unavailable
from gateway.queue import FairQueue, QueueEntry

SlotT = TypeVar("SlotT")


class SlotSource(Protocol[SlotT]):
    """Where dispatched requests run (the engine pool)."""

    def has_capacity(self) -> bool:
        """Whether `acquire` would succeed for some request now."""
        ...

    def acquire(self, engine_name: str | None, *, affinity: str | None = None) -> SlotT | None:
        """Take a slot suited to `engine_name` (and the prompt start `affinity`), or None when every slot is
        busy."""
        ...

    def release(self, slot: SlotT) -> None:
        """Give back a slot from `acquire`."""
        ...


@dataclass(eq=False, slots=True)
class Ticket(Generic[SlotT]):
    """A request's place: its queue entry and, once dispatched, its engine slot."""

    entry: QueueEntry
    engine_name: str | None
    waiter: asyncio.Future[SlotT]
    slot: SlotT | None = None
    affinity: str | None = None  # the prompt's start (`gateway/affinity.py`)


class AsyncFairQueue(Generic[SlotT]):
    """Waits for the fair queue's verdict and an engine slot; cancel-safe at every await."""

    def __init__(self, queue: FairQueue, slots: SlotSource[SlotT]) -> None:
        self.queue = queue
        self._slots = slots
        self._pumping = False

    async def acquire(
        self,
        request_id: str,
        tenant: str,
        priority: int,
        cost_tokens: int,
        deadline: float | None,
        engine_name: str | None,
        affinity: str | None = None,
    ) -> Ticket[SlotT]:
        """Queue a request and return once it holds a slot.

        Raises `Throttled` when admission limits refuse it and `DeadlineExceeded` when `deadline`
        (a `time.monotonic()` value) passes while it waits. Cancelling the caller removes it from the
        queue (or returns its slot if it was dispatched at that very moment).
        """
        now = time.monotonic()
        if deadline is not None and deadline <= now:
            raise DeadlineExceeded("deadline passed before the request was queued")
        loop = asyncio.get_running_loop()
        entry = QueueEntry(request_id, tenant, priority, cost_tokens, now, deadline, None)
        ticket: Ticket[SlotT] = Ticket(entry, engine_name, loop.create_future(), affinity=affinity)
        entry.payload = ticket
        self.queue.push(entry)
        self.pump()
        if not ticket.waiter.done():
            try:
                if deadline is None:
                    await ticket.waiter
                else:
                    async with asyncio.timeout_at(loop.time() + (deadline - time.monotonic())):
                        await ticket.waiter
            except TimeoutError:
                self._abandon(ticket)
                raise DeadlineExceeded(
                    f"deadline passed after {time.monotonic() - now:.3f}s waiting in the queue"
                ) from None
            except BaseException:
                self._abandon(ticket)
                raise
        ticket.slot = ticket.waiter.result()
        return ticket

    def release(self, ticket: Ticket[SlotT], used_tokens: int) -> None:
        """The request is over: return its slot and settle its token accounting."""
        self.queue.finished(ticket.entry, used_tokens)
        if ticket.slot is not None:
            slot, ticket.slot = ticket.slot, None
            self._slots.release(slot)  # pumps through the capacity listener

    def charge(self, tenant: str, tokens: int) -> None:
        self.queue.charge(tenant, tokens)

    def pump(self) -> None:
        """Dispatch waiting requests while slots are free (called on push and whenever a slot frees)."""
        if self._pumping:
            return  # a release inside a pump (abandoned waiter) must not recurse
        self._pumping = True
        try:
            queue, slots = self.queue, self._slots
            while len(queue) and slots.has_capacity():
                entry = queue.pop()
                if entry is None:
                    break
                ticket: Ticket[SlotT] = entry.payload  # type: ignore[assignment]
                if ticket.waiter.done():
                    # Its task was cancelled after the future but before its cleanup ran.
                    queue.finished(entry, 0)
                    continue
                slot = slots.acquire(ticket.engine_name, affinity=ticket.affinity)
                if slot is None:
                    # Not expected after has_capacity() said yes; fail this one rather than spin.
                    queue.finished(entry, 0)
                    ticket.waiter.set_exception(Unavailable("no engine slot is free"))
                    continue
                queue.started(entry)
                ticket.waiter.set_result(slot)
        finally:
            self._pumping = False

    def fail_waiting(self, error: BaseException) -> int:
        """Fail every queued request with `error` (e.g. no engine is left to run them); returns how many."""
        entries = []
        while len(self.queue):
            entry = self.queue.pop()
            if entry is None:
                break
            entries.append(entry)
        for entry in entries:
            self.queue.finished(entry, 0)
            ticket: Ticket[SlotT] = entry.payload  # type: ignore[assignment]
            if not ticket.waiter.done():
                ticket.waiter.set_exception(error)
        return len(entries)

    def _abandon(self, ticket: Ticket[SlotT]) -> None:
        # By identity: once the pump or `fail_waiting` let go of this entry, a new request may already
        # be queued under the same id before this cleanup runs.
        if self.queue.remove(ticket.entry.request_id, ticket.entry) is not None:
            return
        waiter = ticket.waiter
        if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
            # Dispatched in the same instant it gave up: hand the slot straight back.
            ticket.slot = waiter.result()
            self.release(ticket, 0)
        else:
            self.queue.finished(ticket.entry, 0)
