"""Fairness of `gateway.queue.FairQueue` against a single FIFO queue, side by side, in virtual time.

Two tenants, "heavy" and "light", offer token load 10:1 and both offer more than their fair share,
so both stay backlogged. A simulated engine serves a fixed number of tokens per second across a fixed
number of concurrent slots. Each scheduler sees the same arrivals (same seed). Per 10 s window we
print the served-token ratio heavy:light next to the weight ratio, and Jain's index over the
weight-normalised shares; the figures come last.

Schedulers compared:
  fair        FairQueue (VTC pick, per-tenant and global admission limits)
  fifo        one FIFO queue with only the global depth limit: what a plain gateway does
  fifo+caps   one FIFO queue that also applies the per-tenant depth limit, to show how much of the
              result the admission caps alone explain

Run: .venv/bin/python bench/fairness.py [--seconds 130] [--seed 1]
Virtual time: the result does not depend on this machine's speed or load.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.errors import Throttled
from gateway.queue import FairQueue, QueueEntry, QueueLimits
from gateway.tenancy import TenantDirectory

TENANTS = ("heavy", "light")


@dataclass(frozen=True, slots=True)
class SimConfig:
    throughput_tok_s: int = 2000
    step_s: float = 0.01
    slots: int = 8
    request_tokens: int = 300  # prompt + completion, all counted as served work
    light_offered_tok_s: float = 1200.0  # above light's fair share in both scenarios
    load_ratio: float = 10.0
    window_s: float = 10.0
    warmup_s: float = 10.0
    seconds: float = 130.0
    tenant_depth: int = 64
    total_depth: int = 1024


class Scheduler(Protocol):
    def push(self, entry: QueueEntry) -> None: ...
    def pop(self) -> QueueEntry | None: ...
    def started(self, entry: QueueEntry) -> None: ...
    def charge(self, tenant: str, tokens: int) -> None: ...
    def finished(self, entry: QueueEntry, used_tokens: int) -> None: ...


class FifoQueue:
    """Baseline: one queue for everyone, oldest first, with the same depth limits when asked."""

    def __init__(self, total_depth: int, tenant_depth: int | None) -> None:
        self._queue: deque[QueueEntry] = deque()
        self._total_depth = total_depth
        self._tenant_depth = tenant_depth
        self._depth: dict[str, int] = dict.fromkeys(TENANTS, 0)

    def push(self, entry: QueueEntry) -> None:
        if len(self._queue) >= self._total_depth:
            raise Throttled("queue full")
        if self._tenant_depth is not None and self._depth[entry.tenant] >= self._tenant_depth:
            raise Throttled("tenant queue full")
        self._queue.append(entry)
        self._depth[entry.tenant] += 1

    def pop(self) -> QueueEntry | None:
        if not self._queue:
            return None
        entry = self._queue.popleft()
        self._depth[entry.tenant] -= 1
        return entry

    def started(self, entry: QueueEntry) -> None:
        pass

    def charge(self, tenant: str, tokens: int) -> None:
        pass

    def finished(self, entry: QueueEntry, used_tokens: int) -> None:
        pass


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class _Slot:
    entry: QueueEntry
    left: int


@dataclass(slots=True)
class SimResult:
    windows: list[dict[str, int]]
    waits: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in TENANTS})
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENANTS, 0))


def simulate(make: Callable[[VirtualClock], Scheduler], cfg: SimConfig, seed: int) -> SimResult:
    """Run one scheduler for `cfg.seconds` of virtual time; served tokens are counted per window."""
    clock = VirtualClock()
    queue = make(clock)
    rng = random.Random(seed)
    light_rps = cfg.light_offered_tok_s / cfg.request_tokens
    rates = {"heavy": light_rps * cfg.load_ratio, "light": light_rps}
    next_arrival = {t: rng.expovariate(rates[t]) for t in TENANTS}
    ids = itertools.count()
    per_step = round(cfg.throughput_tok_s * cfg.step_s)
    result = SimResult(windows=[dict.fromkeys(TENANTS, 0) for _ in range(int(cfg.seconds / cfg.window_s))])
    running: list[_Slot] = []
    rotate = 0
    for step in range(round(cfg.seconds / cfg.step_s)):
        clock.now = now = step * cfg.step_s
        for tenant in TENANTS:
            while next_arrival[tenant] <= now:
                entry = QueueEntry(f"r{next(ids)}", tenant, 0, cfg.request_tokens, next_arrival[tenant], None, None)
                try:
                    queue.push(entry)
                except Throttled:
                    result.rejected[tenant] += 1
                next_arrival[tenant] += rng.expovariate(rates[tenant])
        while len(running) < cfg.slots and (popped := queue.pop()) is not None:
            queue.started(popped)
            if now >= cfg.warmup_s:  # like the served tokens, waits count after the warm-up only
                result.waits[popped.tenant].append(now - popped.enqueued_at)
            running.append(_Slot(popped, cfg.request_tokens))
        if not running:
            continue
        # The engine's fixed budget per step, shared evenly; the remainder rotates between slots.
        share, extra = divmod(per_step, len(running))
        window = result.windows[min(int(now / cfg.window_s), len(result.windows) - 1)]
        for index, slot in enumerate(running):
            tokens = min(slot.left, share + (1 if (index - rotate) % len(running) < extra else 0))
            queue.charge(slot.entry.tenant, tokens)
            window[slot.entry.tenant] += tokens
            slot.left -= tokens
        rotate += 1
        for slot in [s for s in running if s.left == 0]:
            queue.finished(slot.entry, cfg.request_tokens)
            running.remove(slot)
    return result


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when all values are equal, 1/n when one takes everything."""
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 1.0


@dataclass(frozen=True, slots=True)
class Summary:
    ratios: list[float]
    jains: list[float]
    light_wait_p50_s: float
    rejected: dict[str, int]

    @property
    def mean_ratio(self) -> float:
        return statistics.fmean(self.ratios)

    def error(self, target: float) -> float:
        """Mean relative distance of the per-window ratio from the weight ratio."""
        return statistics.fmean(abs(r / target - 1) for r in self.ratios)


def summarize(result: SimResult, weights: dict[str, float], cfg: SimConfig) -> Summary:
    skip = int(cfg.warmup_s / cfg.window_s)
    measured = result.windows[skip:]
    ratios = [w["heavy"] / max(w["light"], 1) for w in measured]
    jains = [jain([w[t] / weights[t] for t in TENANTS]) for w in measured]
    waits = result.waits["light"]
    return Summary(ratios, jains, statistics.median(waits) if waits else 0.0, result.rejected)


def run_scenario(weights: dict[str, float], cfg: SimConfig, seed: int) -> dict[str, Summary]:
    directory = TenantDirectory.from_config(
        [{"name": t, "weight": weights[t], "limits": {"max_queue_depth": cfg.tenant_depth}} for t in TENANTS]
    )
    limits = QueueLimits(max_total_depth=cfg.total_depth)
    makers: dict[str, Callable[[VirtualClock], Scheduler]] = {
        "fair": lambda clock: FairQueue(directory, limits, clock=clock),
        "fifo": lambda clock: FifoQueue(cfg.total_depth, None),
        "fifo+caps": lambda clock: FifoQueue(cfg.total_depth, cfg.tenant_depth),
    }
    return {name: summarize(simulate(make, cfg, seed), weights, cfg) for name, make in makers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=130.0, help="virtual seconds per run")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    cfg = SimConfig(seconds=args.seconds)
    shortest = cfg.warmup_s + cfg.window_s  # the warm-up, then at least one measured window
    if not args.seconds >= shortest:
        parser.error(
            f"--seconds must be at least {shortest:g} (a {cfg.warmup_s:g} s warm-up, then {cfg.window_s:g} s windows)"
        )
    print(
        f"engine: {cfg.throughput_tok_s} tok/s, {cfg.slots} slots, {cfg.request_tokens} tokens/request; "
        f"offered heavy:light = {cfg.load_ratio:g}:1 ({cfg.light_offered_tok_s * cfg.load_ratio:g} vs "
        f"{cfg.light_offered_tok_s:g} tok/s); {cfg.seconds:g} s virtual, first {cfg.warmup_s:g} s not counted"
    )
    figures: list[str] = []
    for heavy_weight in (1.0, 3.0):
        weights = {"heavy": heavy_weight, "light": 1.0}
        target = heavy_weight
        results = run_scenario(weights, cfg, args.seed)
        names = list(results)
        print(f"\nscenario weights heavy:light = {heavy_weight:g}:1 — served-token ratio heavy:light per window")
        print("window    " + "".join(f"{n:>12}" for n in names) + f"{'target':>10}")
        for index in range(len(results["fair"].ratios)):
            start = cfg.warmup_s + index * cfg.window_s
            row = "".join(f"{results[n].ratios[index]:12.2f}" for n in names)
            print(f"{start:4.0f}-{start + cfg.window_s:<4.0f} {row}{target:10.2f}")
        for n in names:
            s = results[n]
            print(
                f"  {n:<10} mean ratio {s.mean_ratio:6.2f}  error vs weights {s.error(target):6.1%}  "
                f"Jain mean {statistics.fmean(s.jains):.3f} min {min(s.jains):.3f}  "
                f"light p50 wait {s.light_wait_p50_s:6.2f}s  rejected {s.rejected}"
            )
        fair, fifo = results["fair"], results["fifo"]
        figures.append(
            f"weights {heavy_weight:g}:1  ratio ours {fair.mean_ratio:.2f} / FIFO {fifo.mean_ratio:.2f} "
            f"(target {target:.2f}); Jain ours {statistics.fmean(fair.jains):.3f} vs FIFO "
            f"{statistics.fmean(fifo.jains):.3f} = {statistics.fmean(fair.jains) / statistics.fmean(fifo.jains):.2f}x; "
            f"light p50 wait ours/FIFO = {fair.light_wait_p50_s / max(fifo.light_wait_p50_s, 1e-9):.3f}"
        )
    print("\nFigures (ours vs FIFO, same arrivals, virtual time):")
    for line in figures:
        print("  " + line)


if __name__ == "__main__":
    main()
