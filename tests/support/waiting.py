"""Waiting in tests for a state to be reached, not for a guess of how long it takes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Return once `condition()` holds (polled on the running loop); TimeoutError after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 (a condition on plain state, which no event announces)
            await asyncio.sleep(0.005)
