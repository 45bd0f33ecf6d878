"""Eviction policies: exact LRU order; ours keeps hot adapters through scans, weighs size, ages, beats LRU."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from engine.eviction import DecayedFrequencyPolicy, EvictionPolicy, LRUPolicy


def _replay(policy: EvictionPolicy, trace: Sequence[str], capacity: int, sizes: dict[str, int] | None = None) -> int:
    """Runs `trace` through a slot cache as the pool does (victim before insert); returns the hits."""
    resident: set[str] = set()
    hits = 0
    for now, key in enumerate(trace):
        size = (sizes or {}).get(key, 1)
        if key in resident:
            hits += 1
        else:
            if len(resident) >= capacity:
                out = policy.victim(resident, float(now))
                assert out is not None
                resident.remove(out)
                policy.on_remove(out)
            resident.add(key)
            policy.on_insert(key, size, float(now))
        policy.on_access(key, size, float(now))
    return hits


# -- LRU ----------------------------------------------------------------------------------------------


def test_lru_evicts_in_order_of_last_use() -> None:
    lru = LRUPolicy()
    for t, key in enumerate("abcd"):
        lru.on_insert(key, 1, float(t))
    lru.on_access("a", 1, 10.0)
    lru.on_access("c", 1, 11.0)
    assert lru.victim("abcd", 12.0) == "b"
    assert lru.victim("acd", 12.0) == "d"
    assert lru.victim("ac", 12.0) == "a"
    assert lru.victim("c", 12.0) == "c"
    assert lru.victim([], 12.0) is None


def test_lru_breaks_clock_ties_by_call_order_and_forgets_removed_keys() -> None:
    lru = LRUPolicy()
    for key in "xyz":
        lru.on_insert(key, 1, 5.0)
    lru.on_access("x", 1, 5.0)
    assert lru.victim("xyz", 5.0) == "y"
    lru.on_remove("y")
    lru.on_insert("y", 1, 5.0)  # back in, now the most recent
    assert lru.victim("xyz", 5.0) == "z"
    lru.on_access("new", 1, 6.0)
    assert lru.victim(["new", "never-seen"], 6.0) == "never-seen"


def test_lru_replay_matches_a_reference_lru() -> None:
    rng = random.Random(7)
    trace = [f"k{rng.randrange(12)}" for _ in range(2000)]
    lru = LRUPolicy()
    reference: list[str] = []  # least recent first
    capacity, hits = 4, 0
    for key in trace:
        if key in reference:
            hits += 1
            reference.remove(key)
        elif len(reference) >= capacity:
            reference.pop(0)
        reference.append(key)
    assert _replay(lru, trace, capacity) == hits


# -- ours ---------------------------------------------------------------------------------------------


def test_hot_key_survives_a_scan_of_cold_keys() -> None:
    trace = ["hot"] * 20 + [f"cold{i}" for i in range(200)] + ["hot"]
    ours, lru = DecayedFrequencyPolicy(half_life=1024), LRUPolicy()
    assert _replay(ours, trace, capacity=4) == 20  # 19 repeats + the return after the scan
    assert _replay(lru, trace, capacity=4) == 19  # LRU lets the scan flush it


def test_hot_keys_interleaved_with_a_scan_stay_resident() -> None:
    hot = ["h0", "h1", "h2"]
    trace = hot * 10 + list(itertools.chain.from_iterable([f"c{i}", hot[i % 3]] for i in range(300)))
    ours = DecayedFrequencyPolicy(half_life=1024)
    _replay(ours, trace, capacity=4)
    # After 300 one-off keys through one spare slot, every hot key is still ranked above any cold one.
    assert all(ours.frequency(h) > 1.0 for h in hot)
    assert ours.victim([*hot, "c299"], 0.0) == "c299"


def test_large_cold_adapter_goes_before_a_small_one_of_equal_use() -> None:
    ours = DecayedFrequencyPolicy()
    ours.on_insert("small", 8, 0.0)
    ours.on_access("small", 8, 0.0)
    ours.on_insert("large", 64, 1.0)
    ours.on_access("large", 64, 1.0)  # the more recent one, still evicted first
    assert ours.victim(["small", "large"], 2.0) == "large"
    # ... but not when it is used much more per byte: 16 uses of 64 beat 1 use of 8.
    for t in range(15):
        ours.on_access("large", 64, 2.0 + t)
    assert ours.victim(["small", "large"], 20.0) == "small"


def test_key_hot_long_ago_ages_out() -> None:
    half_life = 256
    ours = DecayedFrequencyPolicy(half_life=half_life)
    for t in range(100):
        ours.on_access("stale", 1, float(t))
    working_set = [f"w{i}" for i in range(4)]
    evicted_after: int | None = None
    for n, key in enumerate(itertools.islice(itertools.cycle(working_set), 20 * half_life)):
        ours.on_access(key, 1, 100.0 + n)
        if ours.victim(["stale", *working_set], 100.0 + n) == "stale":
            evicted_after = n + 1
            break
    assert evicted_after is not None
    # Gradual: 100 past uses outweigh the working set's fresh ones for a while, not forever.
    assert half_life // 2 < evicted_after < 10 * half_life
    assert ours.frequency("stale") < min(ours.frequency(w) for w in working_set)


def test_evicted_key_keeps_its_count_and_unknown_keys_go_first() -> None:
    ours = DecayedFrequencyPolicy()
    for t in range(10):
        ours.on_access("a", 1, float(t))
    ours.on_insert("a", 1, 10.0)
    ours.on_remove("a")
    assert ours.frequency("a") > 9.0
    ours.on_insert("a", 1, 11.0)
    ours.on_access("b", 1, 12.0)
    ours.on_insert("b", 1, 12.0)
    assert ours.victim(["a", "b"], 13.0) == "b"
    assert ours.victim(["a", "b", "ghost"], 13.0) == "ghost"
    assert ours.victim([], 13.0) is None


def test_history_of_evicted_keys_is_bounded() -> None:
    ours = DecayedFrequencyPolicy(max_history=64)
    ours.on_insert("resident", 1, 0.0)
    for i in range(1000):
        ours.on_access(f"k{i}", 1, float(i))
    assert ours.frequency("k999") > 0.0  # the newest is kept
    assert sum(ours.frequency(f"k{i}") > 0.0 for i in range(1000)) <= 64
    assert ours.victim(["resident"], 0.0) == "resident"


def test_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="half_life"):
        DecayedFrequencyPolicy(half_life=0)
    with pytest.raises(ValueError, match="max_history"):
        DecayedFrequencyPolicy(max_history=-1)


def test_beats_lru_on_zipf_traffic() -> None:
    rng = random.Random(2024)
    keys = [f"a{i}" for i in range(500)]
    rng.shuffle(keys)  # popularity unrelated to name order
    weights = [1.0 / (r + 1) for r in range(500)]  # Zipf, s = 1.0
    trace = rng.choices(keys, weights=weights, k=20_000)
    ours = _replay(DecayedFrequencyPolicy(), trace, capacity=64) / len(trace)
    lru = _replay(LRUPolicy(), trace, capacity=64) / len(trace)
    assert ours > lru + 0.05, (ours, lru)
