"""Which resident adapter to evict when a request needs a slot: least recently used, or our default,
decayed frequency per unit of size.

A policy only ranks keys; the cache that owns the slots decides when to evict and which keys may go.
Pinned adapters and adapters serving a request are never offered as candidates, so a policy never has
to know about pinning or activity: the pool filters them out before calling `victim`.

Call order for a cache of adapters (the engine's `AdapterPool`):
  * every request that uses an adapter -> `on_access` (hit or miss, before or after `on_insert`);
  * an adapter enters the cache -> `on_insert`; it leaves it (evicted, unloaded, replaced) -> `on_remove`;
  * the cache is full -> `victim(idle unpinned resident keys)`, then `on_remove(victim)` once it is gone.

`size` is what the adapter occupies in the cache's unit of capacity: bytes for a byte budget (host memory,
paged adapter memory), 1 for fixed slots of `max_rank` (today's `LoRAStacks`), where evicting a large
adapter frees no more room than evicting a small one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class EvictionPolicy(Protocol):
    """Ranks cached adapters for eviction; not thread-safe (the pool calls it under its lock)."""

    def on_access(self, key: str, size: int, now: float) -> None:
        """A request used adapter `key` (`size` in capacity units) at monotonic time `now`."""
        ...

    def on_insert(self, key: str, size: int, now: float) -> None:
        """Adapter `key` entered the cache; its request is reported with `on_access` too."""
        ...

    def on_remove(self, key: str) -> None:
        """Adapter `key` left the cache (evicted, unloaded or replaced by a new version)."""
        ...

    def victim(self, candidates: Iterable[str], now: float) -> str | None:
        """The candidate to evict, or None if there is none; the caller removes it and calls `on_remove`.

        Candidates are the idle, unpinned resident keys; a key the policy has never seen counts as the
        coldest, so it goes first.
        """
        ...


class LRUPolicy:
    """Evicts the candidate whose last access (or insertion) is oldest: the pool's original behaviour."""

    def __init__(self) -> None:
        self._stamp: dict[str, tuple[float, int]] = {}
        self._seq = 0  # orders events that share a clock reading

    def on_access(self, key: str, size: int, now: float) -> None:
        self._touch(key, now)

    def on_insert(self, key: str, size: int, now: float) -> None:
        self._touch(key, now)

    def on_remove(self, key: str) -> None:
        self._stamp.pop(key, None)

    def victim(self, candidates: Iterable[str], now: float) -> str | None:
        unseen = (-math.inf, -1)
        return min(candidates, key=lambda k: self._stamp.get(k, unseen), default=None)

    def _touch(self, key: str, now: float) -> None:
        self._seq += 1
        self._stamp[key] = (now, self._seq)


@dataclass(slots=True)
class _History:
    freq: float  # decayed access count as of `tick`
    tick: int  # access counter at the last access
    size: int
    seq: int  # tie-break: older first
    priority: float = -math.inf  # log2(freq / size) + tick / half_life; see DecayedFrequencyPolicy


class DecayedFrequencyPolicy:
    """Our default: evicts the candidate with the lowest decayed access count per unit of size.

    Each access adds 1 to a key's count, and every count halves over `half_life` accesses (to any key):
    recent use counts more than old use (LRFU), so an adapter that was hot long ago and idle since decays
    below the current working set and leaves, while a scan of one-off adapters (count 1) cannot push out
    a hot one (count >> 1). Dividing by size makes a large cold adapter go before a small one of equal
    count, since freeing it makes room for more (GDSF with unit miss cost).

    Time is counted in accesses, not seconds, so the policy behaves the same at 1 and at 1000 requests/s.
    Half-life: longer is closer to LFU (better for stable popularity), shorter closer to LRU (follows a
    shifting popular set faster). The default, 16x the 64 slots of bench/adapter_cache.py, gives up ~1% of
    hit rate to LFU on static Zipf traffic; it falls behind LRU only when the whole popular set turns
    over faster than about every 2 half-lives (every 1: -4 points of hit rate).

    Counts survive eviction ("ghost" history, at most `max_history` non-resident keys, the coldest
    forgotten first), so a popular adapter evicted during a burst comes back with its count, not as new.

    Ranking is cheap because the decayed count compares in the log domain without recomputing it:
    log2(freq * 2^-((t - tick)/h) / size) = log2(freq) + tick/h - log2(size) - t/h, and the last term is
    the same for every key. So each key keeps a static priority updated on access, and `victim` is one
    pass over the candidates.
    """

    def __init__(self, half_life: float = 1024.0, max_history: int = 4096) -> None:
        if half_life <= 0:
            raise ValueError("half_life must be positive")
        if max_history < 0:
            raise ValueError("max_history must be >= 0")
        self._half_life = half_life
        self._max_history = max_history
        self._hist: dict[str, _History] = {}
        self._resident: set[str] = set()
        self._tick = 0
        self._seq = 0

    def on_access(self, key: str, size: int, now: float) -> None:
        self._tick += 1
        self._seq += 1
        h = self._hist.get(key)
        if h is None:
            self._forget_cold()  # before adding, so the key just used is never the one forgotten
            h = self._hist[key] = _History(0.0, self._tick, 1, self._seq)
        h.freq = h.freq * 2.0 ** ((h.tick - self._tick) / self._half_life) + 1.0
        h.tick, h.size, h.seq = self._tick, max(size, 1), self._seq
        h.priority = self._priority(h)

    def on_insert(self, key: str, size: int, now: float) -> None:
        self._resident.add(key)
        h = self._hist.get(key)
        if h is None:
            # Inserted ahead of its first access: no count yet, but ordered by arrival among equals.
            self._seq += 1
            self._hist[key] = _History(0.0, self._tick, max(size, 1), self._seq)
        else:
            h.size = max(size, 1)
            h.priority = self._priority(h)

    def on_remove(self, key: str) -> None:
        self._resident.discard(key)
        self._forget_cold()

    def victim(self, candidates: Iterable[str], now: float) -> str | None:
        return min(candidates, key=self._rank, default=None)

    def frequency(self, key: str) -> float:
        """The decayed access count of `key` now (0 if unknown): for metrics and tests."""
        h = self._hist.get(key)
        if h is None:
            return 0.0
        return h.freq * 2.0 ** ((h.tick - self._tick) / self._half_life)

    def _priority(self, h: _History) -> float:
        if h.freq <= 0.0:
            return -math.inf
        return math.log2(h.freq / h.size) + h.tick / self._half_life

    def _rank(self, key: str) -> tuple[float, int]:
        h = self._hist.get(key)
        if h is None:
            return (-math.inf, -1)
        return (h.priority, h.seq)

    def _forget_cold(self) -> None:
        # Prune in batches (down to half the bound) so the sort is paid once per max_history/2 new keys.
        ghosts = len(self._hist) - len(self._resident)
        if ghosts < self._max_history:
            return
        keep = self._max_history // 2
        cold = sorted((k for k in self._hist if k not in self._resident), key=self._rank)
        for key in cold[: len(cold) - keep]:
            del self._hist[key]
