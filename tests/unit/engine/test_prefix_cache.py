"""Prefix caching on the slot KV cache: which row a prompt starts from, how much of it is cached, what the rows
keep after their requests end, and the copy of a running row's prefix."""

from __future__ import annotations

from typing import cast

import pytest
import torch

from engine.kv_cache import KVCache
from engine.pool import AdapterVersion
from engine.prefix_cache import BLOCK, PrefixCache, PrefixHit
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence
from engine.tokenizer import IncrementalDecoder
from tests.unit.engine.tiny import TINY

CPU = torch.device("cpu")
SYSTEM = list(range(100, 100 + 2 * BLOCK + 5))  # a shared 37-token start


def _seq(prompt: list[int], adapter_id: int = 0, salt: str = "") -> Sequence:
    adapter = cast(AdapterVersion, type("Version", (), {"id": adapter_id})()) if adapter_id else None
    return Sequence(
        cache_salt=salt,
        request_id=f"r{id(prompt)}",
        prompt_ids=list(prompt),
        params=SamplingParams(max_tokens=8),
        adapter=adapter,
        sink=lambda _: None,
        decoder=cast(IncrementalDecoder, None),
        generator=None,
    )


def _kv(slots: int = 4) -> KVCache:
    return KVCache(TINY, slots, TINY.max_position, torch.float32, CPU)


def _admit(cache: PrefixCache, seq: Sequence) -> PrefixHit:
    """Admit `seq` as the scheduler does: its whole prompt written by the step that admits it."""
    hit = cache.lookup(seq)
    seq.kv_slot = cache.take(seq, hit)
    seq.prefilled = len(seq.prompt_ids)
    seq.status = SeqStatus.RUNNING
    return hit


def _finish(cache: PrefixCache, seq: Sequence, outputs: list[int], keep: bool = True) -> None:
    seq.output_ids = list(outputs)
    cache.release(seq, keep)


def test_a_prompt_starts_after_the_tokens_a_finished_request_left_in_its_row() -> None:
    cache = PrefixCache(_kv(), enabled=True)
    first = _seq([*SYSTEM, 1, 2, 3])
    assert _admit(cache, first) == PrefixHit(None, 0)
    _finish(cache, first, [7, 8, 9])  # 9 was never fed back: its keys are not in the row
    # The match runs past the last whole block, token by token, up to where the prompts part.
    second = _seq([*SYSTEM, 1, 2, 4, 5])
    assert _admit(cache, second) == PrefixHit(first.kv_slot, len(SYSTEM) + 2)
    assert second.kv_slot == first.kv_slot
    # An earlier turn of a chat: its prompt and reply, all but the reply's last token.
    _finish(cache, second, [])
    third = _seq([*SYSTEM, 1, 2, 4, 5, 6])
    assert _admit(cache, third).tokens == len(SYSTEM) + 4


def test_the_same_prompt_again_prefills_its_last_token_for_the_first_logits() -> None:
    cache = PrefixCache(_kv(), enabled=True)
    first = _seq(SYSTEM)
    _admit(cache, first)
    _finish(cache, first, [5, 6])
    assert _admit(cache, _seq(SYSTEM)).tokens == len(SYSTEM) - 1


def test_keys_computed_under_another_adapter_are_not_reused() -> None:
    cache = PrefixCache(_kv(), enabled=True)
    base = _seq([*SYSTEM, 1])
    _admit(cache, base)
    _finish(cache, base, [2])
    assert cache.lookup(_seq([*SYSTEM, 1], adapter_id=7)).tokens == 0
    tuned = _seq([*SYSTEM, 1], adapter_id=7)
    _admit(cache, tuned)
    _finish(cache, tuned, [2])
    assert cache.lookup(_seq([*SYSTEM, 3], adapter_id=7)) == PrefixHit(tuned.kv_slot, len(SYSTEM), (7, ""))
    assert cache.lookup(_seq([*SYSTEM, 3])) == PrefixHit(base.kv_slot, len(SYSTEM), (0, ""))


def test_prompts_share_cached_tokens_only_under_the_same_salt() -> None:
    # A tenant must not learn, from a faster first token, that another tenant sent the same prompt.
    cache = PrefixCache(_kv(), enabled=True)
    alice = _seq([*SYSTEM, 1], salt="alice")
    _admit(cache, alice)
    _finish(cache, alice, [2])
    assert cache.lookup(_seq([*SYSTEM, 3], salt="bob")).tokens == 0
    assert cache.lookup(_seq([*SYSTEM, 3])).tokens == 0
    assert cache.lookup(_seq([*SYSTEM, 3], salt="alice")) == PrefixHit(alice.kv_slot, len(SYSTEM), (0, "alice"))


def test_a_prefix_shorter_than_a_block_is_not_looked_up() -> None:
    cache = PrefixCache(_kv(), enabled=True)
    first = _seq([*SYSTEM[: BLOCK - 1], 1])
    _admit(cache, first)
    _finish(cache, first, [2])
    assert cache.lookup(_seq([*SYSTEM[: BLOCK - 1], 3])).tokens == 0


def test_a_running_requests_prefix_is_copied_into_a_free_row() -> None:
    kv = _kv()
    cache = PrefixCache(kv, enabled=True)
    running = _seq([*SYSTEM, 1, 2])
    _admit(cache, running)
    for layer in range(TINY.num_layers):  # what its prefill wrote
        kv.k[layer][running.kv_slot].normal_()
        kv.v[layer][running.kv_slot].normal_()
    # Seen only once the step that writes them was launched: the scheduler records at its next schedule.
    assert cache.lookup(_seq([*SYSTEM, 3])).tokens == 0
    cache.record_running([running])
    joining = _seq([*SYSTEM, 3])
    hit = _admit(cache, joining)
    assert hit == PrefixHit(running.kv_slot, len(SYSTEM))
    assert joining.kv_slot != running.kv_slot
    for cache_layers in (kv.k, kv.v):
        for layer in cache_layers:
            assert torch.equal(layer[joining.kv_slot, :, : len(SYSTEM)], layer[running.kv_slot, :, : len(SYSTEM)])
    # The copy is cached as its own row's prefix too.
    _finish(cache, running, [], keep=False)
    _finish(cache, joining, [4])
    assert cache.lookup(_seq([*SYSTEM, 3, 4, 5])) == PrefixHit(joining.kv_slot, len(SYSTEM) + 1)


def test_a_failed_requests_row_keeps_nothing() -> None:
    cache = PrefixCache(_kv(), enabled=True)
    failed = _seq([*SYSTEM, 1])
    _admit(cache, failed)
    _finish(cache, failed, [2, 3], keep=False)
    assert cache.lookup(_seq([*SYSTEM, 1, 2])).tokens == 0
    assert cache.cached_rows() == 0


def test_rows_are_handed_out_empty_first_then_least_recently_used() -> None:
    kv = _kv(slots=3)
    cache = PrefixCache(kv, enabled=True)
    older, newer = _seq([*SYSTEM, 1]), _seq([5] * 40)
    _admit(cache, older)
    _admit(cache, newer)
    _finish(cache, older, [2])
    _finish(cache, newer, [2])
    assert cache.cached_rows() == 2
    unrelated = [_seq([9] * 20) for _ in range(2)]
    assert _admit(cache, unrelated[0]).row is None
    assert unrelated[0].kv_slot not in (older.kv_slot, newer.kv_slot)  # the empty row first
    _admit(cache, unrelated[1])
    assert unrelated[1].kv_slot == older.kv_slot  # then the least recently used
    assert cache.lookup(_seq([*SYSTEM, 1])).tokens == 0
    assert cache.lookup(_seq([5] * 41)).tokens == 40


def test_counters_add_up_the_prompt_tokens_looked_up_and_read_from_the_cache() -> None:
    cache = PrefixCache(_kv(), enabled=True)
    first = _seq([*SYSTEM, 1])
    _admit(cache, first)
    _finish(cache, first, [])
    _admit(cache, _seq([*SYSTEM, 2, 3]))
    assert (cache.queried_tokens, cache.hit_tokens) == (2 * len(SYSTEM) + 3, len(SYSTEM))


def test_disabled_it_keeps_nothing_and_hands_rows_out_as_the_kv_cache_does() -> None:
    cache = PrefixCache(_kv(), enabled=False)
    first = _seq([*SYSTEM, 1])
    _admit(cache, first)
    _finish(cache, first, [2])
    assert cache.lookup(_seq([*SYSTEM, 1, 2])) == PrefixHit()
    assert cache.cached_rows() == 0


@pytest.mark.parametrize("budget", [64, 8])
def test_the_scheduler_prefills_only_the_uncached_rest_of_a_prompt(budget: int) -> None:
    # With a budget smaller than the prompt but not its rest, the rest is prefilled whole in one step.
    kv = _kv()
    cache = PrefixCache(kv, enabled=True)
    scheduler = Scheduler(kv, cast(object, None), budget, cache)  # type: ignore[arg-type]  # base requests only
    first = _seq([*SYSTEM, 1])
    scheduler.add(first)
    while not first.prefill_done:
        scheduler.schedule()
    first.output_ids = [2, 3]
    scheduler.finish(first)
    second = _seq([*SYSTEM, 1, 2, 4, 5])
    scheduler.add(second)
    prefills = scheduler.schedule()
    assert prefills == {second: 2}  # 4 and 5: 1 (prompt) and 2 (fed back) are in the row
    assert second.prefilled == len(second.prompt_ids) and second.kv_slot == first.kv_slot
