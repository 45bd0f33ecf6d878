"""Scheduler: admission by KV slots, LoRA slots and the prefill budget, long prompts in chunks; no request
waits forever."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import cast

import pytest
import torch

from engine.kv_cache import KVCache
from engine.lora import LoRAStacks
from engine.pool import AdapterPool, AdapterVersion
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence
from engine.tokenizer import IncrementalDecoder
from tests.unit.engine.tiny import TINY, write_adapter

CPU = torch.device("cpu")


@pytest.fixture
def pool() -> Iterator[AdapterPool]:
    stacks = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.float32, device=CPU)
    p = AdapterPool(TINY, stacks, torch.float32, host_capacity=8)
    yield p
    p.close()


def _loaded(pool: AdapterPool, name: str, folder: Path) -> AdapterVersion:
    version = pool.register(name, folder)
    pool.wait_loaded(version, timeout=10)
    return version


def _seq(name: str, adapter: AdapterVersion | None, prompt_len: int = 4, priority: int = 0) -> Sequence:
    return Sequence(
        request_id=name,
        prompt_ids=[1] * prompt_len,
        params=SamplingParams(max_tokens=8),
        adapter=adapter,
        sink=lambda _: None,
        decoder=cast(IncrementalDecoder, None),  # the scheduler never decodes
        generator=None,
        priority=priority,
    )


def _ids(seqs: Iterable[Sequence]) -> list[str]:
    return [s.request_id for s in seqs]


def _scheduler(pool: AdapterPool, kv_slots: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(KVCache(TINY, kv_slots, TINY.max_position, torch.float32, CPU), pool, budget)


def test_a_request_waiting_for_a_lora_slot_is_not_starved_by_later_ones(pool: AdapterPool, tmp_path: Path) -> None:
    """With every LoRA slot busy, later requests for the resident adapters were admitted past the one that
    needed a slot, keeping those adapters busy: under steady traffic for them it never started."""
    a, b, c = (_loaded(pool, n, write_adapter(tmp_path / n, seed=i)) for i, n in enumerate("abc"))
    scheduler = _scheduler(pool)
    first = [_seq("a1", a), _seq("b1", b)]
    for seq in first:
        scheduler.add(seq)
    assert _ids(scheduler.schedule()) == ["a1", "b1"]  # both LoRA slots now busy
    starved = _seq("c1", c)
    scheduler.add(starved)
    base = _seq("base", None)
    for seq in (_seq("a2", a), _seq("b2", b), base):
        scheduler.add(seq)
    assert _ids(scheduler.schedule()) == ["base"]  # a request without an adapter takes no LoRA slot: it goes ahead
    for seq in first:
        scheduler.finish(seq)
    assert _ids(scheduler.schedule())[0] == "c1" and starved.status is SeqStatus.RUNNING
    assert c.slot is not None


def test_kv_slots_bound_admission_and_return_when_requests_finish(pool: AdapterPool) -> None:
    scheduler = _scheduler(pool, kv_slots=2)
    seqs = [_seq(f"r{i}", None) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    assert _ids(scheduler.schedule()) == ["r0", "r1"]
    assert scheduler.kv.free_slots == 0 and scheduler.waiting == seqs[2:]
    scheduler.finish(seqs[0])
    assert _ids(scheduler.schedule()) == ["r2"]
    for seq in seqs[1:]:
        scheduler.finish(seq)
    assert scheduler.kv.free_slots == 2 and not scheduler.running and not scheduler.waiting


def test_priority_then_arrival_order_within_the_prefill_budget(pool: AdapterPool) -> None:
    scheduler = _scheduler(pool, budget=10)
    low, big, high, small = _seq("low", None), _seq("big", None, 8), _seq("high", None, priority=1), _seq("s", None)
    for seq in (low, big, high, small):
        scheduler.add(seq)
    assert _ids(scheduler.waiting) == ["high", "low", "big", "s"]
    assert _ids(scheduler.schedule()) == ["high", "low"]  # `big` no longer fits this step's budget; `s` neither
    assert _ids(scheduler.schedule()) == ["big"]
    assert _ids(scheduler.schedule()) == ["s"]


def test_a_version_replaced_between_lookup_and_acquire_starts_no_request(
    pool: AdapterPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hot swap ending on a loader thread between `_startable`'s lookup and `acquire` started the request on
    the retired version; and a refused acquire read as "every slot busy", holding back the requests behind."""
    old = _loaded(pool, "a", write_adapter(tmp_path / "a1", seed=1))
    b = _loaded(pool, "b", write_adapter(tmp_path / "b", seed=2))
    scheduler = _scheduler(pool)
    running = _seq("running", old)  # keeps the old version in its slot through the swap
    scheduler.add(running)
    assert _ids(scheduler.schedule()) == ["running"]
    raced, behind = _seq("raced", old), _seq("behind", b)
    scheduler.add(raced)
    scheduler.add(behind)
    acquire = pool.acquire
    swapped: list[AdapterVersion] = []

    def acquire_after_a_swap(version: AdapterVersion) -> int | None:
        if version is old and not swapped:  # the swap's load ends on its thread right now
            swapped.append(pool.register("a", write_adapter(tmp_path / "a2", seed=3)))
            pool.wait_loaded(swapped[0], timeout=10)
        return acquire(version)

    monkeypatch.setattr(pool, "acquire", acquire_after_a_swap)
    assert _ids(scheduler.schedule()) == ["behind"]
    assert old.retired and raced.status is SeqStatus.WAITING and old.active == 1  # the running request only
    scheduler.finish(running)  # the old version's last request: its slot goes to the new one
    assert _ids(scheduler.schedule()) == ["raced"] and raced.adapter is swapped[0]


def test_an_adapter_whose_waiting_requests_all_ended_is_no_longer_kept_for_them(
    pool: AdapterPool, tmp_path: Path
) -> None:
    """`wanted` (the host tier keeps such adapters longest) stayed set after the requests that waited for an
    adapter were aborted, so an adapter nobody asked for any more was kept over those in use."""
    a = _loaded(pool, "a", write_adapter(tmp_path / "a", seed=1))
    scheduler = _scheduler(pool, kv_slots=1)
    scheduler.add(running := _seq("running", None))
    assert _ids(scheduler.schedule()) == ["running"]  # the only KV slot: the others wait
    first, second = _seq("first", a), _seq("second", a)
    for seq in (first, second):
        scheduler.add(seq)
        assert pool.ready(a)  # as `LLMEngine.add_request` asks at once
    assert a.wanted
    scheduler.finish(first)
    assert a.wanted  # "second" still waits for it
    scheduler.finish(second)
    assert not a.wanted
    scheduler.finish(running)


def test_a_host_copy_dropped_between_lookup_and_acquire_holds_back_no_one(
    pool: AdapterPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused acquire read as "every LoRA slot busy" even when the adapter's host copy had just been dropped
    (on a loader thread, between `ready` and `acquire`): the adapter requests behind it waited a step."""
    a = _loaded(pool, "a", write_adapter(tmp_path / "a", seed=1))
    b = _loaded(pool, "b", write_adapter(tmp_path / "b", seed=2))
    scheduler = _scheduler(pool)
    dropped, behind = _seq("dropped", a), _seq("behind", b)
    scheduler.add(dropped)
    scheduler.add(behind)
    acquire = pool.acquire

    def acquire_after_a_drop(version: AdapterVersion) -> int | None:
        if version is a and a.weights is not None:
            pool._discard_weights(a)  # what `_trim_host` does on a loader thread
        return acquire(version)

    monkeypatch.setattr(pool, "acquire", acquire_after_a_drop)
    assert _ids(scheduler.schedule()) == ["behind"]
    assert dropped.status is SeqStatus.WAITING


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_before_new_requests(pool: AdapterPool) -> None:
    scheduler = _scheduler(pool, budget=10)
    running, long = _seq("running", None), _seq("long", None, prompt_len=23)
    scheduler.add(running)
    assert scheduler.schedule() == {running: 4}
    scheduler.add(long)
    scheduler.add(short := _seq("short", None, prompt_len=3))
    assert scheduler.schedule() == {long: 10}  # its first chunk takes the whole budget: `short` waits
    assert long.prefilled == 10 and not long.prefill_done and running.prefill_done
    assert scheduler.upcoming() == []  # the next step's budget goes to long's next chunk too
    assert scheduler.schedule() == {long: 10}
    assert scheduler.upcoming() == [short]  # 3 tokens of long's left, 7 of the budget
    assert scheduler.schedule() == {long: 3, short: 3}
    assert long.prefill_done and short.prefill_done
    assert scheduler.schedule() == {}


def test_a_prompt_that_fits_a_later_step_waits_for_it_rather_than_being_cut(pool: AdapterPool) -> None:
    """Cut, it would prefill eagerly over two steps instead of in one captured graph (CUDA)."""
    scheduler = _scheduler(pool, budget=10)
    first, second = _seq("first", None, prompt_len=6), _seq("second", None, prompt_len=6)
    for seq in (first, second):
        scheduler.add(seq)
    assert scheduler.schedule() == {first: 6}
    assert second.status is SeqStatus.WAITING and second.prefilled == 0
    assert scheduler.schedule() == {second: 6}


def test_a_prompt_waiting_for_room_is_not_passed_by_the_chunks_of_longer_ones(pool: AdapterPool) -> None:
    """A long prompt behind one that waits for a step with room for it whole started a chunk in the budget
    left over; then its chunks, running first, could take the budget ahead of the waiting one step after step."""
    scheduler = _scheduler(pool, budget=10)
    first, waits, long = _seq("first", None, 4), _seq("waits", None, 8), _seq("long", None, 30)
    for seq in (first, waits, long):
        scheduler.add(seq)
    assert scheduler.upcoming() == [first]
    assert scheduler.schedule() == {first: 4}  # 6 left: `waits` does not fit whole, `long` starts no chunk
    assert long.status is SeqStatus.WAITING
    assert scheduler.upcoming() == [waits, long]
    assert scheduler.schedule() == {waits: 8, long: 2}
    assert scheduler.schedule() == {long: 10}


def test_prompts_next_sees_a_prompts_next_chunk_and_a_request_that_could_start(pool: AdapterPool) -> None:
    """What the engine's pacer by kind asks before it holds a step back (engine/step_pacing.py)."""
    scheduler = _scheduler(pool, kv_slots=2, budget=10)
    assert not scheduler.prompts_next()
    scheduler.add(first := _seq("first", None))
    assert scheduler.prompts_next()  # a free KV slot: it would start
    scheduler.schedule()
    assert not scheduler.prompts_next()  # decoding only
    scheduler.add(_seq("long", None, prompt_len=23))
    scheduler.schedule()  # its first chunk
    assert scheduler.prompts_next()  # its next chunk
    scheduler.schedule()
    scheduler.schedule()
    assert not scheduler.prompts_next()
    scheduler.add(_seq("third", None))  # no KV slot left: it cannot start
    assert not scheduler.prompts_next()
    scheduler.finish(first)
    assert scheduler.prompts_next()


def test_prompts_next_starts_no_load_and_counts_an_adapter_out_of_memory_as_not_ready(
    pool: AdapterPool, tmp_path: Path
) -> None:
    version = _loaded(pool, "a", write_adapter(tmp_path / "a", seed=1))
    scheduler = _scheduler(pool)
    scheduler.add(_seq("a1", version))
    assert scheduler.prompts_next()
    version.weights = None  # its host copy dropped (evicted from host RAM)
    assert not scheduler.prompts_next()
    assert version.loading is None and not version.wanted  # `_startable` would have started its load
