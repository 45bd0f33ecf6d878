"""Prefix affinity: which requests count as sharing a prompt's start, and that the start reaches the slot source
whether the request is dispatched at once or after waiting."""

from __future__ import annotations

import asyncio

from gateway.affinity import PROMPT_CHARS, AffinityTable, affinity_key
from gateway.api import ChatMessage, GatewayRequest
from tests.unit.gateway.test_queue_fairness import _async_queue

SYSTEM = ChatMessage("system", "You answer questions about tides.")


def _chat(*messages: ChatMessage, tenant: str = "a", salt: str | None = None) -> GatewayRequest:
    return GatewayRequest("r", tenant, "pirate", messages=messages, cache_salt=salt)


def test_the_turns_of_a_chat_and_prompts_sharing_a_system_prompt_share_a_key() -> None:
    first = affinity_key(_chat(SYSTEM, ChatMessage("user", "When is high tide?")), "pirate@v1")
    turns = [ChatMessage("user", "When is high tide?"), ChatMessage("assistant", "At 6."), ChatMessage("user", "Low?")]
    later = _chat(SYSTEM, *turns)
    assert affinity_key(later, "pirate@v1") == first
    assert affinity_key(_chat(SYSTEM, ChatMessage("user", "Who pilots?")), "pirate@v1") == first


def test_what_the_engines_would_not_share_gets_another_key() -> None:
    key = affinity_key(_chat(SYSTEM), "pirate@v1")
    assert affinity_key(_chat(SYSTEM, tenant="b"), "pirate@v1") != key  # engines salt each tenant's cache
    assert affinity_key(_chat(SYSTEM, salt="s"), "pirate@v1") != key
    assert affinity_key(_chat(SYSTEM), "pirate@v2") != key  # keys and values depend on the version
    assert affinity_key(_chat(ChatMessage("user", SYSTEM.content)), "pirate@v1") != key


def test_a_plain_prompt_is_keyed_by_its_first_characters() -> None:
    head = "x" * PROMPT_CHARS
    keys = {affinity_key(GatewayRequest("r", "a", None, prompt=head + tail), None) for tail in ("1", "2")}
    assert len(keys) == 1
    assert affinity_key(GatewayRequest("r", "a", None, prompt="y" + head), None) not in keys


def test_the_table_forgets_the_least_recently_used_start() -> None:
    table = AffinityTable(size=2)
    table.record("s1", "engine-0")
    table.record("s2", "engine-1")
    table.record("s1", "engine-1")  # used again: the most recent
    table.record("s3", "engine-0")
    assert (table.get("s1"), table.get("s2"), table.get("s3")) == ("engine-1", None, "engine-0")


async def test_the_start_reaches_the_slot_source_at_once_or_after_waiting() -> None:
    queue, slots = _async_queue(1)
    first = await queue.acquire("a/1", "a", 0, 10, None, None, "start-1")
    waiting = asyncio.create_task(queue.acquire("a/2", "a", 0, 10, None, None, "start-2"))
    await asyncio.sleep(0)
    queue.release(first, 0)
    await waiting
    assert slots.affinities == ["start-1", "start-2"]
