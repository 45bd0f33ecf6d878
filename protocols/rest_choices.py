"""OpenAI's `n`: the choices of one request as n gateway requests, whose events merge into one stream.

Each choice is a request of its own to the core (its own place in the tenant's queue, engine call and seed),
so nothing below the protocol knows of `n`. The replies (`rest_replies`) answer all or nothing: the first
`Error` of any choice is the reply, and closing the merged stream cancels every choice still running.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence

from gateway.api import Event, GatewayRequest

# An event of one choice: (choice index, event).
ChoiceEvent = tuple[int, Event]


def choice_requests(request: GatewayRequest, n: int) -> list[GatewayRequest]:
    """The gateway requests of `n` choices of `request`: one is `request` itself; several get distinct ids
    (`<id>-<i>`: the queue and engines refuse an id in use), seeds `seed + i` and one routing key."""
    if n == 1:
        return [request]
    seed = request.sampling.seed
    # Without a routing key each request picks its adapter version at random: one key keeps every choice on one.
    routing_key = request.routing_key or request.request_id
    return [
        dataclasses.replace(
            request,
            request_id=f"{request.request_id}-{i}",
            routing_key=routing_key,
            # As vLLM V1 seeds the children of a parallel sampling request (ParentRequest in
            # vllm/v1/engine/parallel_sampling.py): seeded choices differ, and each is the single request seed + i.
            sampling=request.sampling if seed is None else dataclasses.replace(request.sampling, seed=seed + i),
        )
        for i in range(n)
    ]


async def merged_events(
    submit: Callable[[GatewayRequest], AsyncIterator[Event]], requests: Sequence[GatewayRequest]
) -> AsyncIterator[ChoiceEvent]:
    """The events of every request as they come, each tagged with its index in `requests`; they end when every
    request's events have. Closing this early (or cancelling its reader) closes every request's events, so each
    leaves the queue or its engine."""
    if len(requests) == 1:
        events = submit(requests[0])
        try:
            async for event in events:
                yield 0, event
        finally:
            await close_events(events)
        return
    inbox: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

    async def pump(index: int, request: GatewayRequest) -> None:
        # Read at once, whatever the reader does: a choice that holds an engine slot must not wait for one
        # that waits for that slot.
        events = submit(request)
        try:
            async for event in events:
                inbox.put_nowait((index, event))
        finally:
            await close_events(events)
            inbox.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, r), name=f"choice {i} of {r.request_id}") for i, r in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            index, got = await inbox.get()
            if got is not None:
                yield index, got
                continue
            running -= 1
            task = tasks[index]
            failure = task.exception() if task.done() and not task.cancelled() else None
            if failure is not None:  # a bug: `submit` reports failures as events
                raise failure
    finally:
        for task in tasks:
            task.cancel()
        # Each choice's cleanup (queue release, engine abort) has run when the reply is over.
        await asyncio.gather(*tasks, return_exceptions=True)


async def close_events(events: AsyncIterator[object]) -> None:
    """Close an event stream that is an async generator (how the core learns its client is gone)."""
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()
