"""Random interleavings of the adapter pool's operations, with its invariants checked after every one.

Registrations, hot swaps, unloads, pins, requests that start, finish or are aborted, loads that start, end
or fail, fills ahead and expiring failures come in the order a seeded generator picks; loads run only when
it says so (`ManualLoader`), so each seed is one reproducible interleaving. The requests go through the
engine's own `Scheduler`, and end the way `LLMEngine` ends them. The invariants (`PoolInvariants`): slot
bookkeeping, `active` counts, slot contents, pins, memory of retired versions, the host tier's capacity and
the pinned arena's extents.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.adapters import AdapterError, load_adapter, read_spec
from engine.eviction import DecayedFrequencyPolicy, LRUPolicy
from engine.kv_cache import KVCache
from engine.lora import LoRAStacks
from engine.pinned_arena import PinnedArena
from engine.pool import AdapterPool, AdapterVersion
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence
from tests.unit.engine.manual_loader import ManualLoader
from tests.unit.engine.pool_invariants import PoolInvariants
from tests.unit.engine.tiny import TINY, write_adapter

NAMES = ("a", "b", "c", "d", "e", "f", "g")
PAGE = 1024
# How often each operation comes (relative weights).
OPS = {
    "register": 3,
    "unregister": 1,
    "pin": 1,
    "request": 14,
    "schedule": 8,
    "finish": 5,
    "abort": 2,
    "ahead": 4,
    "start": 2,
    "load": 6,
    "expire": 1,
}


def adapter_files(root: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """Good adapters (distinct weights, ranks and projections), ones whose load fails (a NaN weight: the
    header check passes) and ones registration refuses (a truncated weights file)."""
    shapes = [(2, ("q_proj",)), (4, ("q_proj", "v_proj")), (8, ("k_proj", "down_proj")), (4, ("o_proj", "up_proj"))]
    good = [write_adapter(root / f"good{i}", rank=shapes[i % 4][0], modules=shapes[i % 4][1], seed=i) for i in range(7)]
    failing = []
    for i in range(2):
        folder = write_adapter(root / f"nan{i}", seed=100 + i)
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        tensors[next(iter(tensors))][0, 0] = float("nan")
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        failing.append(folder)
    refused = write_adapter(root / "truncated", seed=200)
    weights = refused / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    return good, failing, [refused]


@dataclass(eq=False)
class Request:
    seq: Sequence
    name: str
    admitted_on: AdapterVersion | None = None
    outcome: str | None = None


@dataclass
class Harness:
    """A pool on `ManualLoader`, the engine's scheduler over it, and the requests made so far."""

    pool: AdapterPool
    loader: ManualLoader
    arena: PinnedArena | None
    scheduler: Scheduler
    invariants: PoolInvariants
    requests: list[Request] = field(default_factory=list)

    # -- what the engine does ------------------------------------------------------------------------

    def add_request(self, name: str) -> None:
        version = self.pool.lookup(name)
        if version is None or self.pool.failure(version) is not None:
            return  # NOT_FOUND / UNAVAILABLE: refused before it is counted
        seq = Sequence(
            request_id=f"r{len(self.requests)}",
            prompt_ids=[1, 2],
            params=SamplingParams(max_tokens=4),
            adapter=version,
            sink=lambda _: None,
            decoder=None,  # type: ignore[arg-type]
            generator=None,
        )
        self.requests.append(Request(seq, name))
        self.pool.ready(version)
        self.scheduler.add(seq)

    def reap(self) -> None:
        """`LLMEngine._reap` for adapters: waiting requests whose adapter failed or was unloaded end."""
        for request in self.live():
            seq = request.seq
            if seq.status is not SeqStatus.WAITING or seq.adapter is None:
                continue
            if self.pool.failure(seq.adapter) or self.pool.current(seq.adapter) is None:
                self.end(request, "error")

    def schedule(self) -> None:
        self.reap()
        for seq in self.scheduler.schedule():
            request = next(r for r in self.requests if r.seq is seq)
            assert seq.adapter is not None
            assert not seq.adapter.retired, "admitted on a version a hot swap or unload had retired"
            assert self.pool.lookup(request.name) is seq.adapter, "admitted on a version its name no longer maps to"
            request.admitted_on = seq.adapter

    def end(self, request: Request, outcome: str) -> None:
        assert request.outcome is None, f"{request.seq.request_id} ended twice"
        self.scheduler.finish(request.seq)
        request.outcome = outcome

    def fill_ahead(self, most: int) -> None:
        upcoming = [s.adapter for s in self.scheduler.upcoming() if s.adapter is not None]
        if upcoming:
            self.pool.fill_ahead(upcoming, most)

    def live(self) -> list[Request]:
        return [r for r in self.requests if r.outcome is None]

    def check(self) -> None:
        running = [r for r in self.live() if r.seq.status is SeqStatus.RUNNING]
        for r in running:
            assert r.seq.adapter is r.admitted_on, f"{r.seq.request_id} changed version while running"
        self.invariants.check([r.seq for r in running])


@pytest.fixture
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[Path], list[Path]]:
    return adapter_files(tmp_path_factory.mktemp("adapters"))


@dataclass(frozen=True)
class Setup:
    slots: int
    host_capacity: int
    kv_slots: int
    fused: bool  # fused stacks, images in a pinned arena (pageable here)
    lru: bool  # LRU eviction, else decayed frequency


SETUPS = {
    "loose-lru": Setup(3, 2, 4, fused=False, lru=True),
    "fused-arena-frequency": Setup(3, 2, 4, fused=True, lru=False),
    "tight-loose-frequency": Setup(2, 1, 4, fused=False, lru=False),  # host copies only in slots and beside
    "wide-fused-lru": Setup(4, 1, 6, fused=True, lru=True),
}


def make_harness(files: tuple[list[Path], list[Path], list[Path]], setup: Setup) -> Harness:
    good = files[0]
    cpu = torch.device("cpu")
    stacks = LoRAStacks(TINY, slots=setup.slots, max_rank=8, dtype=torch.float32, device=cpu, fused=setup.fused)
    # Too small for every image: some loads fall back to images of their own.
    arena = PinnedArena(24 * PAGE, pin=False, page_bytes=PAGE) if setup.fused else None
    loader = ManualLoader(torch.float32, stacks.layout, arena)
    eviction = LRUPolicy() if setup.lru else DecayedFrequencyPolicy()
    pool = AdapterPool(TINY, stacks, torch.float32, setup.host_capacity, eviction, loader, arena)
    pool.negative_ttl_s = 1e9  # expired only on purpose
    kv = KVCache(TINY, setup.kv_slots, 8, torch.float32, cpu)
    refs = {p: load_adapter(read_spec(p, TINY, 8), torch.float32, pin=False).tensors for p in good}
    return Harness(pool, loader, arena, Scheduler(kv, pool, 64), PoolInvariants(pool, refs, arena))


@pytest.fixture(params=list(SETUPS.values()), ids=list(SETUPS))
def harness(request: pytest.FixtureRequest, files: tuple[list[Path], list[Path], list[Path]]) -> Iterator[Harness]:
    h = make_harness(files, request.param)
    yield h
    h.pool.close()
    if h.arena is not None:
        h.arena.close()


def run_ops(h: Harness, files: tuple[list[Path], list[Path], list[Path]], rng: random.Random, ops: int) -> None:
    good, failing, refused = files
    every = good + failing + refused
    for _ in range(ops):
        op = rng.choices(list(OPS), weights=list(OPS.values()))[0]
        name = rng.choice(NAMES)
        if op == "register":
            path, pin = rng.choice(every), rng.random() < 0.2
            try:
                h.invariants.saw([h.pool.register(name, path, pinned=pin)])
            except AdapterError:
                assert path in refused or pin  # a file the check refuses, or a pin without room
        elif op == "unregister":
            h.pool.unregister(name)
        elif op == "pin":  # the same file again, pinned or not: only the pin changes
            version = h.pool.lookup(name)
            if version is not None:
                try:
                    h.invariants.saw([h.pool.register(name, version.spec.path, pinned=not version.pinned)])
                except AdapterError:
                    assert not version.pinned  # no room for another pin
        elif op == "request":
            h.add_request(name)
        elif op == "schedule":
            h.schedule()
        elif op == "finish":
            running = [r for r in h.live() if r.seq.status is SeqStatus.RUNNING]
            if running:
                h.end(rng.choice(running), "length")
        elif op == "abort":
            live = h.live()
            if live:
                h.end(rng.choice(live), "abort")
        elif op == "ahead":
            h.fill_ahead(rng.choice([1, 2]))
        elif op == "start":
            h.loader.start(rng)
        elif op == "load":
            h.loader.finish(rng)
        elif op == "expire":  # failures leave the negative cache: the next request reads the file again
            h.pool.negative_ttl_s = 0.0
            h.add_request(name)
            h.pool.negative_ttl_s = 1e9
        h.check()


def drain(h: Harness, rng: random.Random) -> None:
    """Every load ends and every request is served, within a bounded number of steps (nothing hangs)."""
    for _ in range(200):
        h.loader.finish_all(rng)
        h.schedule()
        h.check()
        running = [r for r in h.live() if r.seq.status is SeqStatus.RUNNING]
        for r in running:
            h.end(r, "length")
        h.check()
        if not h.live() and not h.loader.pending:
            break
    stuck = [(r.seq.request_id, r.name, r.seq.status) for r in h.live()]
    assert not stuck, f"requests that never ended: {stuck}"


@pytest.mark.parametrize("seed", range(8))
def test_random_interleavings_keep_the_pool_consistent(
    harness: Harness, files: tuple[list[Path], list[Path], list[Path]], seed: int
) -> None:
    rng = random.Random(seed)
    harness.loader.start_during_check = (rng, 0.25)  # a worker may take a load started ahead of a check
    run_ops(harness, files, rng, ops=400)
    drain(harness, rng)
    pool, invariants = harness.pool, harness.invariants
    assert all(v.active == 0 for v in invariants.versions)
    assert {v for v in pool._slots if v is not None} <= set(pool._by_name.values()), "a retired version kept a slot"
    admitted = [r for r in harness.requests if r.admitted_on is not None]
    assert len(admitted) > 20 and any(r.outcome == "error" for r in harness.requests), "the run exercised too little"
    # Once nothing runs, the host tier is back within its capacity.
    assert len(invariants.host_only()) <= pool._host_capacity, [v.key for v in invariants.host_only()]
    for name in NAMES:
        pool.unregister(name)
    harness.check()
    assert all(v is None for v in pool._slots) and all(r == 0 for r in pool._stacks.slot_ranks)
    assert all(v.weights is None for v in invariants.versions), "an unloaded version kept its host weights"
    if harness.arena is not None:
        assert harness.arena.free_pages == invariants.arena_empty
