"""The whole engine on the CPU with a tiny random model, through random interleavings of adapter
registrations, hot swaps, unloads, pins, failing loads, requests and aborts, stepped by hand.

Loads start and end only when the generator says so (`ManualLoader` stands in for the thread loader), so a
seed is one reproducible interleaving. After every operation the pool's invariants hold; at the end every
request has ended exactly once, none hangs, and each one's tokens are those of its adapter version alone:
a hot swap never mixes two versions' weights in one request. Prefix caching is on: prompts that share a
start read it from the cache (a finished request's row, or a copy of a running one's) under the same version
only, and the tokens are those of an engine without the cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import engine.engine as engine_module
from engine.adapters import load_adapter, read_spec
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import EngineError
from engine.lora import SlotLayout
from engine.pinned_arena import PinnedArena
from engine.pool import AdapterVersion
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput
from tests.support.random_model import write_tiny_llama
from tests.unit.engine.manual_loader import ManualLoader
from tests.unit.engine.pool_invariants import PoolInvariants
from tests.unit.engine.tiny import write_adapter

NAMES = ("a", "b", "c", "d")
SHARED = [40 + i for i in range(18)]  # a start longer than a prefix-cache block, shared by three prompts
PROMPTS = ([5, 17, 33, 2], [90, 4, 61, 61, 7, 12], [100, 3], [*SHARED, 5, 9], [*SHARED, 7], [*SHARED, 5, 9, 11])
MAX_TOKENS = 6
OPS = {
    "register": 4,
    "unregister": 1,
    "pin": 1,
    "request": 10,
    "abort": 1,
    "start": 2,
    "load": 5,
    "step": 10,
    "expire": 1,
}


@dataclass(eq=False)
class Tracked:
    """One accepted request: its outputs, and the adapter version it ran on (None: the base model)."""

    name: str | None
    prompt: list[int]
    max_tokens: int
    outputs: list[RequestOutput] = field(default_factory=list)
    ran_on: AdapterVersion | None = None
    ran: bool = False
    swapped_under: bool = False  # its version was replaced or unloaded while it ran

    def __call__(self, out: RequestOutput) -> None:
        assert not (self.outputs and self.outputs[-1].finish_reason), "an output after the request ended"
        self.outputs.append(out)

    @property
    def ended(self) -> bool:
        return bool(self.outputs) and self.outputs[-1].finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, model: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """Good adapters with strong weights (each changes the greedy tokens), failing and refused ones."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("engine-adapters")
    shapes = [(4, ("q_proj", "v_proj")), (8, ("o_proj", "down_proj")), (2, ("gate_proj", "up_proj"))]
    good = [
        write_adapter(root / f"good{i}", rank=shapes[i % 3][0], modules=shapes[i % 3][1], alpha=64.0, seed=i)
        for i in range(6)
    ]
    nan = write_adapter(root / "nan", seed=50, alpha=64.0)
    tensors = load_file(str(nan / "adapter_model.safetensors"))
    tensors[next(iter(tensors))][0, 0] = float("nan")
    save_file(tensors, str(nan / "adapter_model.safetensors"))
    truncated = write_adapter(root / "truncated", seed=51)
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    return good, [nan], [truncated]


@pytest.fixture
def loaders(monkeypatch: pytest.MonkeyPatch) -> list[ManualLoader]:
    """Engines made in the test load adapters with a `ManualLoader` (the last one made: the list's last)."""
    made: list[ManualLoader] = []

    def manual(
        config: EngineConfig, device: torch.device, dtype: torch.dtype, layout: SlotLayout | None
    ) -> tuple[ManualLoader, PinnedArena | None]:
        made.append(ManualLoader(dtype, layout))
        return made[-1], None

    monkeypatch.setattr(engine_module, "make_loader", manual)
    return made


def new_engine(model: Path, async_steps: str, fills_ahead: int, prefix_caching: str = "on") -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model),
            device="cpu",
            dtype="float32",
            max_num_seqs=3,
            max_model_len=32,
            max_num_batched_tokens=32,
            max_waiting=6,
            lora_slots=3,
            max_lora_rank=8,
            host_adapter_cache=2,
            adapter_loader="thread",
            adapter_fills_ahead=fills_ahead,
            async_steps=async_steps,
            prefix_caching=prefix_caching,
        )
    )


def references(
    engine: LLMEngine, loader: ManualLoader, good: list[Path], rng: random.Random
) -> dict[tuple[Path | None, int], list[int]]:
    """Each prompt's greedy tokens on the base model and on each good adapter alone (one request at a time)."""
    refs: dict[tuple[Path | None, int], list[int]] = {}
    for path in [None, *good]:
        if path is not None:
            engine.unload_adapter("ref")  # a new version would only be staged until it loads
            engine.load_adapter("ref", str(path))
            loader.finish_all(rng)
        for i, prompt in enumerate(PROMPTS):
            alone = Tracked("ref", prompt, MAX_TOKENS)
            params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
            engine.add_request(f"ref-{i}", prompt, params, None if path is None else "ref", alone)
            engine.run_until_idle()
            assert alone.ended and alone.outputs[-1].finish_reason == "length"
            refs[(path, i)] = alone.tokens
    engine.unload_adapter("ref")
    return refs


def step(engine: LLMEngine, tracked: dict[str, Tracked], invariants: PoolInvariants) -> None:
    """One turn of the engine's loop, by hand; records the version each running request runs on."""
    engine._drain_commands()
    engine._reap()
    if engine.scheduler.has_work():
        engine.step()
    for seq in engine.scheduler.running:
        t = tracked[seq.request_id]
        if not t.ran:
            t.ran, t.ran_on = True, seq.adapter
            assert seq.adapter is None or not seq.adapter.retired, f"{seq.request_id} started on a retired version"
        assert seq.adapter is t.ran_on, f"{seq.request_id} changed adapter version while running"
        t.swapped_under |= seq.adapter is not None and seq.adapter.retired
    invariants.check(list(engine.scheduler.running))


@pytest.mark.parametrize("async_steps", ["off", "on"])
@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_serve_each_request_on_one_version(
    loaders: list[ManualLoader],
    model: Path,
    files: tuple[list[Path], list[Path], list[Path]],
    seed: int,
    async_steps: str,
) -> None:
    good = files[0]
    rng = random.Random(seed)
    engine = new_engine(model, async_steps, fills_ahead=rng.choice([0, 2]))
    loader = loaders[-1]
    try:
        refs = {p: load_adapter(read_spec(p, engine.arch, 8), torch.float32, pin=False).tensors for p in good}
        invariants = PoolInvariants(engine.pool, refs)
        engine.pool.negative_ttl_s = 1e9  # expired only on purpose
        tracked: dict[str, Tracked] = {}
        run(engine, loader, invariants, tracked, files, rng, ops=400)
        # The end: every load ends, and every request within a bounded number of steps.
        for _ in range(300):
            loader.finish_all(rng)
            step(engine, tracked, invariants)
            if all(t.ended for t in tracked.values()) and not loader.pending:
                break
        hung = [rid for rid, t in tracked.items() if not t.ended]
        assert not hung, f"requests that never ended: {hung}"
        assert not engine._live and not engine.scheduler.waiting and not engine.scheduler.running
        assert all(v.active == 0 for v in invariants.versions)
        slots = {v for v in engine.pool._slots if v is not None}
        assert slots <= set(engine.pool._by_name.values()), "a retired version kept its slot"
        assert all(v.weights is None for v in invariants.versions if v.retired), "a retired version kept weights"

        assert engine.prefix_cache.hit_tokens > 0, "no prompt started from the prefix cache"
        uncached = new_engine(model, async_steps, fills_ahead=0, prefix_caching="off")
        try:
            expected = references(uncached, loaders[-1], good, rng)
        finally:
            uncached.stop()
        ran_on = [t for t in tracked.values() if t.ran_on is not None]
        reasons = [t.outputs[-1].finish_reason for t in tracked.values()]
        assert len(ran_on) >= 10 and "abort" in reasons and "error" in reasons, "the run exercised too little"
        through = [t for t in tracked.values() if t.swapped_under and t.outputs[-1].finish_reason == "length"]
        assert through, "no request ran to its end through a hot swap or unload"
        distinct = {tuple(expected[(p, 0)]) for p in [None, *good]}
        assert len(distinct) == len(good) + 1, "adapters too weak to tell versions apart"
        for rid, t in tracked.items():
            last = t.outputs[-1]
            assert sum(o.finish_reason is not None for o in t.outputs) == 1
            prompt = PROMPTS.index(t.prompt)
            if not t.ran:
                assert not t.tokens and last.finish_reason in ("abort", "error"), (rid, last)
                continue
            path = None if t.ran_on is None else t.ran_on.spec.path
            want = expected[(path, prompt)][: t.max_tokens]
            if last.finish_reason == "length":
                assert t.tokens == want, f"{rid} on {path}: {t.tokens} != {want}"
            else:
                assert last.finish_reason == "abort", (rid, last)
                assert t.tokens == want[: len(t.tokens)], f"{rid} on {path}: {t.tokens} not a prefix of {want}"
        for name in NAMES:
            engine.unload_adapter(name)
        invariants.check([])
        assert all(v is None for v in engine.pool._slots)
        assert all(v.weights is None for v in invariants.versions), "an unloaded version kept its host weights"
    finally:
        engine.stop()


def run(
    engine: LLMEngine,
    loader: ManualLoader,
    invariants: PoolInvariants,
    tracked: dict[str, Tracked],
    files: tuple[list[Path], list[Path], list[Path]],
    rng: random.Random,
    ops: int,
) -> None:
    good, failing, refused = files
    for n in range(ops):
        op = rng.choices(list(OPS), weights=list(OPS.values()))[0]
        name = rng.choice(NAMES)
        if op == "register":
            busy = sorted(s.adapter.name for s in engine.scheduler.running if s.adapter is not None)
            if busy and rng.random() < 0.5:  # a hot swap under running requests
                name = rng.choice(busy)
            path, pin = rng.choice(good + failing + refused), rng.random() < 0.2
            try:
                invariants.saw([engine.load_adapter(name, str(path), pin)])
            except EngineError as exc:
                assert exc.code == "INVALID_ARGUMENT" and (path in refused or pin), exc
        elif op == "unregister":
            engine.unload_adapter(name)
        elif op == "pin":
            version = engine.pool.lookup(name)
            if version is not None:
                try:
                    invariants.saw([engine.load_adapter(name, str(version.spec.path), not version.pinned)])
                except EngineError:
                    assert not version.pinned  # no room for another pin
        elif op in ("request", "expire"):
            if op == "expire":  # failures leave the negative cache: the next request reads the file again
                engine.pool.negative_ttl_s = 0.0
            adapter = None if rng.random() < 0.15 else name
            prompt = rng.choice(PROMPTS)
            t = Tracked(adapter, prompt, rng.randint(2, MAX_TOKENS))
            params = SamplingParams(max_tokens=t.max_tokens, ignore_eos=True)
            try:
                engine.add_request(f"r{n}", prompt, params, adapter, t)
                tracked[f"r{n}"] = t
            except EngineError as exc:
                assert exc.code in ("NOT_FOUND", "UNAVAILABLE", "RESOURCE_EXHAUSTED"), exc
            engine.pool.negative_ttl_s = 1e9
        elif op == "abort":
            live = [rid for rid, t in tracked.items() if not t.ended]
            if live:
                engine.abort(rng.choice(live))
        elif op == "start":
            loader.start(rng)
        elif op == "load":
            loader.finish(rng)
        elif op == "step":
            step(engine, tracked, invariants)
            continue
        invariants.check(list(engine.scheduler.running))
