"""Adapter cache eviction policies side by side on synthetic request traces: no model, no GPU.

500 adapters of ranks {8, 16, 32, 64} (drawn uniformly, independent of popularity), requests drawn from a
Zipf popularity (s = 0.8, 1.0, 1.2), and shifting traces (s = 1.0) whose popular set is reshuffled every
`--shift-every` requests, and 10x as often: an adversarial turnover that favours LRU. Every policy sees the
same trace. Two capacity models:

  slots   64 fixed slots of max rank, today's `LoRAStacks`: any adapter takes one slot, so the policy is
          told size 1 (a bigger adapter frees no more room); a miss still moves the adapter's bytes.
  bytes   a byte budget of 64 average adapters (paged adapter memory, or the host tier): an adapter takes
          its bytes, and the policy is told them.

Bytes: a rank-r LoRA on q/k/v/o of a Llama-7B shape (hidden 4096, 32 layers) in bf16 is
r * (4096 + 4096) * 2 B * 4 projections * 32 layers = 2 MiB * r; "MiB/req" is host -> GPU traffic per request.

Policies: ours (`DecayedFrequencyPolicy`), LRU (`LRUPolicy`, the pool's original behaviour), and LFU with
counts kept forever and no aging, a strong baseline for static popularity that cannot follow a shift.

Run: .venv/bin/python bench/adapter_cache.py [--requests 50000] [--half-life 1024] [--seed 1]
A simulation in request counts: the figures do not depend on this machine's speed or load.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.eviction import DecayedFrequencyPolicy, EvictionPolicy, LRUPolicy

RANKS = (8, 16, 32, 64)
MIB_PER_RANK = 2  # see the module docstring


class LFUPolicy:
    """Evicts the candidate with the fewest accesses ever (ties: least recent); no aging."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._seq: dict[str, int] = {}
        self._clock = itertools.count()

    def on_access(self, key: str, size: int, now: float) -> None:
        self._count[key] = self._count.get(key, 0) + 1
        self._seq[key] = next(self._clock)

    def on_insert(self, key: str, size: int, now: float) -> None:
        self._seq.setdefault(key, next(self._clock))

    def on_remove(self, key: str) -> None:
        pass  # counts persist: perfect LFU

    def victim(self, candidates: Iterable[str], now: float) -> str | None:
        return min(candidates, key=lambda k: (self._count.get(k, 0), self._seq.get(k, -1)), default=None)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "ours": DecayedFrequencyPolicy,  # main() binds --half-life
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
}


@dataclass(frozen=True, slots=True)
class Result:
    hit_rate: float
    mib_per_request: float


def zipf_trace(n_keys: int, s: float, requests: int, rng: random.Random, shift_every: int = 0) -> list[int]:
    """Adapter indices; popularity rank r has weight 1/r^s; with `shift_every`, ranks are reshuffled."""
    cum = list(itertools.accumulate(1.0 / (r + 1) ** s for r in range(n_keys)))
    order = list(range(n_keys))
    rng.shuffle(order)
    trace: list[int] = []
    for start in range(0, requests, shift_every or requests):
        if start:
            rng.shuffle(order)
        ranks = rng.choices(range(n_keys), cum_weights=cum, k=min(shift_every or requests, requests - start))
        trace.extend(order[r] for r in ranks)
    return trace


def simulate(policy: EvictionPolicy, trace: list[int], sizes: list[int], capacity: int, by_bytes: bool) -> Result:
    """Replays `trace` through a cache of `capacity` (slots, or MiB when `by_bytes`); every request needs its
    adapter resident, so a miss always loads it, evicting the policy's victims until it fits."""
    keys = [f"a{i}" for i in range(len(sizes))]
    resident: dict[str, int] = {}  # key -> occupied capacity
    used = hits = loaded_mib = 0
    for now, index in enumerate(trace):
        key, mib = keys[index], sizes[index]
        told = mib if by_bytes else 1
        if key in resident:
            hits += 1
        else:
            while used + told > capacity:
                out = policy.victim(resident, float(now))
                assert out is not None
                used -= resident.pop(out)
                policy.on_remove(out)
            resident[key] = told
            used += told
            loaded_mib += mib
            policy.on_insert(key, told, float(now))
        policy.on_access(key, told, float(now))
    return Result(hits / len(trace), loaded_mib / len(trace))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=500)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--shift-every", type=int, default=10_000)
    parser.add_argument("--half-life", type=float, default=1024.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    policies = dict(POLICIES, ours=lambda: DecayedFrequencyPolicy(half_life=args.half_life))

    rng = random.Random(args.seed)
    sizes = [MIB_PER_RANK * rng.choice(RANKS) for _ in range(args.adapters)]
    mean_mib = sum(sizes) / len(sizes)
    traces = {f"zipf s={s}": zipf_trace(args.adapters, s, args.requests, rng) for s in (0.8, 1.0, 1.2)}
    for every in (args.shift_every, args.shift_every // 10):
        traces[f"shift s=1.0 /{every}"] = zipf_trace(args.adapters, 1.0, args.requests, rng, every)

    started = time.perf_counter()
    rows: list[str] = []
    for mode, capacity in (("slots", args.slots), ("bytes", round(args.slots * mean_mib))):
        for name, trace in traces.items():
            res = {p: simulate(make(), trace, sizes, capacity, mode == "bytes") for p, make in policies.items()}
            o, lru, lfu = res["ours"], res["lru"], res["lfu"]
            rows.append(
                f"{mode:<6} {name:<22} {o.hit_rate:6.3f} {lru.hit_rate:6.3f} {lfu.hit_rate:6.3f} "
                f"{o.hit_rate / lru.hit_rate:6.3f}   {o.mib_per_request:6.2f} {lru.mib_per_request:6.2f} "
                f"{lfu.mib_per_request:6.2f} {o.mib_per_request / lru.mib_per_request:6.3f}"
            )
    elapsed = time.perf_counter() - started

    print(
        f"{args.adapters} adapters, ranks {RANKS} ({mean_mib:.1f} MiB mean), {args.slots} slots or "
        f"{args.slots * mean_mib:.0f} MiB, {args.requests} requests per trace, half-life {args.half_life:g}, "
        f"seed {args.seed}, {elapsed:.1f} s"
    )
    print("ratio = ours / LRU (hit rate: higher is better; MiB/req: lower is better)")
    print(f"{'':<6} {'trace':<22} {'--- hit rate -------------------':<32}   {'--- MiB loaded per request ---'}")
    print(
        f"{'mode':<6} {'':<22} {'ours':>6} {'lru':>6} {'lfu':>6} {'ratio':>6}   "
        f"{'ours':>6} {'lru':>6} {'lfu':>6} {'ratio':>6}"
    )
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
