"""Adapter pool: background loads, slot eviction, pinning, hot swap and failed loads."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.adapters import AdapterError
from engine.lora import LoRAStacks, image_groups
from engine.lora_batch import LoRABatch
from engine.pinned_arena import PinnedArena
from engine.pool import AdapterCacheStats, AdapterPool, AdapterState
from tests.unit.engine.manual_loader import ManualLoader
from tests.unit.engine.tiny import TINY, write_adapter


@pytest.fixture
def pool() -> AdapterPool:
    stacks = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    p = AdapterPool(TINY, stacks, torch.float32, host_capacity=8)
    yield p
    p.close()


def _loaded(pool: AdapterPool, name: str, folder: Path, pin: bool = False):  # type: ignore[no-untyped-def]
    version = pool.register(name, folder, pin)
    pool.wait_loaded(version, timeout=10)
    return version


def _poison(folder: Path, value: float) -> Path:
    """Overwrite one weight of the adapter in `folder` with `value` (a load must then refuse it)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    tensors[next(iter(tensors))][0, 0] = value
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_register_loads_in_background_then_acquires_a_slot(pool: AdapterPool, tmp_path: Path) -> None:
    version = _loaded(pool, "a", write_adapter(tmp_path / "a"))
    assert version.state is AdapterState.HOST
    slot = pool.acquire(version)
    assert slot is not None and version.state is AdapterState.RESIDENT
    assert pool.acquire(version) == slot  # a second request shares the slot
    assert version.active == 2


def test_a_version_notes_when_its_load_ended(tmp_path: Path) -> None:
    """Its load's duration (what a bench reports for loads alone) is measured from the pool's own clock; a
    reload clears the time of the load before."""
    stacks = LoRAStacks(TINY, slots=1, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    loader = ManualLoader(torch.float32, stacks.layout)
    pool = AdapterPool(TINY, stacks, torch.float32, 8, loader=loader)
    try:
        registered = time.monotonic()
        version = pool.register("a", write_adapter(tmp_path / "a"))
        assert version.settled_at is None  # still queued
        time.sleep(0.01)
        loader.finish_all(random.Random(0))
        pool.wait_loaded(version, timeout=10)
        assert version.settled_at is not None and version.settled_at - registered >= 0.01
        with pool._lock:
            pool._discard_weights(version)  # the host tier dropped it
        pool.ready(version)  # a request wants it again: a second load runs
        assert version.loading is not None and version.settled_at is None  # not the first load's end
    finally:
        pool.close()


def test_only_idle_adapters_are_evicted(pool: AdapterPool, tmp_path: Path) -> None:
    a, b, c = (_loaded(pool, n, write_adapter(tmp_path / n, seed=i)) for i, n in enumerate("abc"))
    for v in (a, b):
        pool.acquire(v)
        pool.release(v, tokens=1)
    pool.acquire(b)  # b is busy again and more recent
    assert pool.acquire(c) is not None
    assert a.slot is None and b.slot is not None and c.slot is not None


def test_frequently_used_adapter_outlives_a_recent_one_off(pool: AdapterPool, tmp_path: Path) -> None:
    hot, once, new = (
        _loaded(pool, n, write_adapter(tmp_path / n, seed=i)) for i, n in enumerate(("hot", "once", "new"))
    )
    for _ in range(5):
        pool.acquire(hot)
        pool.release(hot, tokens=1)
    pool.acquire(once)
    pool.release(once, tokens=1)  # more recent than `hot`, but used once: plain LRU would evict `hot`
    assert pool.acquire(new) is not None
    assert hot.slot is not None and once.slot is None
    assert pool.evictions == 1


def test_busy_and_pinned_adapters_are_never_evicted(pool: AdapterPool, tmp_path: Path) -> None:
    a = _loaded(pool, "a", write_adapter(tmp_path / "a"), pin=True)
    b = _loaded(pool, "b", write_adapter(tmp_path / "b", seed=1))
    c = _loaded(pool, "c", write_adapter(tmp_path / "c", seed=2))
    pool.acquire(a)
    pool.release(a, tokens=1)  # idle but pinned
    pool.acquire(b)  # busy
    assert pool.acquire(c) is None


def test_pins_leave_a_slot_for_unpinned_adapters(pool: AdapterPool, tmp_path: Path) -> None:
    # Pins once could take every slot: a request for any other adapter then waited for a slot forever, and the
    # engine's loop spun on it.
    a = _loaded(pool, "a", write_adapter(tmp_path / "a"), pin=True)
    with pytest.raises(AdapterError, match=r"cannot pin 'b'.*one of the engine's 2 LoRA slots"):
        pool.register("b", write_adapter(tmp_path / "b", seed=1), pinned=True)
    assert pool.lookup("b") is None
    b = _loaded(pool, "b", write_adapter(tmp_path / "b", seed=1))  # unpinned: fine
    assert pool.acquire(a) is not None
    pool.release(a, tokens=1)
    assert pool.acquire(b) is not None  # the slot the pin left free
    again = _loaded(pool, "a", write_adapter(tmp_path / "a2", seed=3), pin=True)  # a new version of a pinned name
    assert again.pinned and pool.lookup("a") is again


def test_hot_swap_keeps_old_version_until_its_requests_finish(pool: AdapterPool, tmp_path: Path) -> None:
    old = _loaded(pool, "x", write_adapter(tmp_path / "v1", seed=1))
    slot = pool.acquire(old)
    assert slot is not None
    new = _loaded(pool, "x", write_adapter(tmp_path / "v2", seed=2))
    assert pool.lookup("x") is new and old.retired
    assert old.slot == slot  # still serving its in-flight request
    pool.release(old, tokens=3)
    assert old.slot is None and old.weights is None  # memory released after the last request


def test_failed_load_is_reported(pool: AdapterPool, tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a")
    version = pool.register("a", folder)
    pool.wait_loaded(version, timeout=10)
    pool.unregister("a")
    broken = pool.register("a", _poison(folder, float("inf")))
    with pytest.raises(AdapterError, match="NaN or infinite"):
        pool.wait_loaded(broken, timeout=10)
    assert broken.state is AdapterState.FAILED


def test_many_concurrent_requests_for_a_cold_adapter_cause_one_load(pool: AdapterPool, tmp_path: Path) -> None:
    version = pool.register("a", write_adapter(tmp_path / "a"))
    before = pool.loads_started
    for _ in range(20):
        pool.ready(version)
    pool.wait_loaded(version, timeout=10)
    assert pool.loads_started == before


def test_failed_load_is_not_retried_while_in_the_negative_cache(pool: AdapterPool, tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a")
    version = pool.register("a", folder)
    pool.wait_loaded(version, timeout=10)
    version.weights = None  # dropped from host memory, as the host tier does under pressure
    (folder / "adapter_model.safetensors").write_bytes(b"")  # and the file broke meanwhile
    assert not pool.ready(version)  # starts the reload
    with pytest.raises(AdapterError):
        pool.wait_loaded(version, timeout=10)
    deadline = time.monotonic() + 5
    while pool.failure(version) is None and time.monotonic() < deadline:  # the done-callback may lag
        time.sleep(0.01)
    loads = pool.loads_started
    for _ in range(10):
        assert not pool.ready(version)
    assert pool.loads_started == loads and pool.failure(version) is not None
    pool.negative_ttl_s = 0.0  # expired: the next request tries the disk again
    pool.ready(version)
    assert pool.loads_started == loads + 1


def test_hot_swap_serves_the_old_version_until_the_new_one_is_loaded(
    pool: AdapterPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _loaded(pool, "x", write_adapter(tmp_path / "v1", seed=1))
    gate = _hold_loads(monkeypatch)
    new = pool.register("x", write_adapter(tmp_path / "v2", seed=2))
    assert pool.lookup("x") is old and not old.retired  # requests arriving now still get working weights
    gate.set()
    pool.wait_loaded(new, timeout=10)
    assert pool.lookup("x") is new and old.retired


def test_a_replacement_that_fails_to_load_leaves_the_working_version(pool: AdapterPool, tmp_path: Path) -> None:
    old = _loaded(pool, "x", write_adapter(tmp_path / "v1", seed=1))
    new = pool.register("x", _poison(write_adapter(tmp_path / "v2", seed=2), float("nan")))
    with pytest.raises(AdapterError, match="NaN"):
        pool.wait_loaded(new, timeout=10)
    assert pool.lookup("x") is old and not old.retired and old.weights is not None


def test_a_new_load_is_not_dropped_to_make_room_when_the_rest_sit_in_slots(tmp_path: Path) -> None:
    """Host capacity 1 with the one other adapter in a slot: the just-loaded adapter (never used yet, so
    the least recent) used to be dropped at once, and its requests would reload it forever."""
    stacks = LoRAStacks(TINY, slots=1, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    pool = AdapterPool(TINY, stacks, torch.float32, host_capacity=1)
    try:
        a = _loaded(pool, "a", write_adapter(tmp_path / "a", seed=1))
        pool.acquire(a)
        pool.release(a, tokens=1)  # a stays in its slot, idle
        b = _loaded(pool, "b", write_adapter(tmp_path / "b", seed=2))
        assert b.weights is not None and pool.ready(b)
        assert pool.acquire(b) is not None  # evicts a from the slot
    finally:
        pool.close()


def test_a_version_unloaded_while_it_loads_is_dropped_when_the_load_ends(
    pool: AdapterPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its weights used to stay in host memory for good: nobody could use or free them."""
    import threading

    from engine import adapter_loader as loader_module

    gate, started = threading.Event(), threading.Event()
    real_load = loader_module.load_adapter

    def held_load(*args, **kwargs):  # type: ignore[no-untyped-def]
        started.set()
        gate.wait(10)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(loader_module, "load_adapter", held_load)
    version = pool.register("a", write_adapter(tmp_path / "a", seed=1))
    assert started.wait(10)  # the load is running: it cannot be cancelled
    assert pool.unregister("a")
    gate.set()
    assert version.settled.wait(10)
    assert version.retired and version.weights is None


@pytest.mark.parametrize("fused", [False, True], ids=["loose", "fused"])
def test_an_evicting_fill_leaves_nothing_of_the_evicted_adapter(tmp_path: Path, fused: bool) -> None:
    """A slot miss evicts an idle adapter and fills its slot in one go (no reset between): the slot must then
    hold exactly what a fill of an empty slot holds, whatever the evicted adapter's rank and projections."""
    stacks = LoRAStacks(TINY, slots=1, max_rank=8, dtype=torch.float32, device=torch.device("cpu"), fused=fused)
    fresh = LoRAStacks(TINY, slots=1, max_rank=8, dtype=torch.float32, device=torch.device("cpu"), fused=fused)
    pool = AdapterPool(TINY, stacks, torch.float32, host_capacity=8)
    try:
        wide = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
        old = _loaded(pool, "old", write_adapter(tmp_path / "old", rank=8, modules=wide, seed=1))
        new = _loaded(pool, "new", write_adapter(tmp_path / "new", rank=2, modules=("k_proj",), seed=2))
        assert pool.acquire(old) == 0
        pool.release(old, tokens=1)
        assert pool.acquire(new) == 0 and old.slot is None and pool.evictions == 1
        assert new.weights is not None
        fresh.set_lora(0, new.weights)
        assert stacks.ranks.tolist() == fresh.ranks.tolist() == [2]
        assert {g: r.tolist() for g, r in stacks.group_ranks.items()} == {
            g: r.tolist() for g, r in fresh.group_ranks.items()
        }
        for layer in range(TINY.num_layers):
            torch.testing.assert_close(stacks.a[(layer, "k_proj")], fresh.a[(layer, "k_proj")])
            torch.testing.assert_close(stacks.b[(layer, "k_proj")], fresh.b[(layer, "k_proj")])
            if not fused:  # loose stacks are zero wherever the new adapter has nothing
                for module in wide:
                    if module != "k_proj":
                        assert torch.count_nonzero(stacks.a[(layer, module)]) == 0
                        assert torch.count_nonzero(stacks.b[(layer, module)]) == 0
        shapes = TINY.projection_shapes()
        for module in ("q_proj", "k_proj", "down_proj"):  # what the kernels' path computes, token by token
            fan_in, fan_out = shapes[module]
            x = torch.randn(3, fan_in)
            ys = [torch.zeros(3, fan_out), torch.zeros(3, fan_out)]
            for s, y in zip((stacks, fresh), ys, strict=True):
                batch = LoRABatch.build(s, [0, 0, -1], torch.device("cpu"))
                assert batch is not None
                batch.apply(0, module, x, y)
            torch.testing.assert_close(ys[0], ys[1])
    finally:
        pool.close()


def test_fill_ahead_fills_the_next_requests_adapters_and_their_acquire_counts_the_miss(
    pool: AdapterPool, tmp_path: Path
) -> None:
    a, b = (_loaded(pool, n, write_adapter(tmp_path / n, seed=i)) for i, n in enumerate("ab"))
    assert pool.fill_ahead([a, b], most=1) == 1  # at most `most`, in the requests' order
    assert a.state is AdapterState.RESIDENT and b.state is AdapterState.HOST
    assert pool.fill_ahead([a, b], most=2) == 1  # a is already in its slot
    slot = b.slot
    assert pool.acquire(b) == slot and b.active == 1
    assert (pool.slot_misses, pool.slot_hits, pool.fills_ahead) == (1, 0, 2)  # b's fill was ahead, still a miss
    assert pool.cache_stats() == AdapterCacheStats(slot_hits=0, slot_misses=1, evictions=0, loads=2, fills_ahead=2)
    pool.release(b, tokens=1)
    assert pool.acquire(b) == slot and pool.slot_hits == 1  # from then on its slot is a hit


def test_fill_ahead_never_evicts_an_upcoming_or_busy_adapter(pool: AdapterPool, tmp_path: Path) -> None:
    a, b, c = (_loaded(pool, n, write_adapter(tmp_path / n, seed=i)) for i, n in enumerate("abc"))
    pool.acquire(a)
    pool.release(a, tokens=1)  # idle in its slot, but a request for it is next in line
    pool.acquire(b)  # busy
    assert pool.fill_ahead([a, c], most=2) == 0
    assert a.slot is not None and c.slot is None and pool.evictions == 0
    assert pool.fill_ahead([c], most=2) == 1  # nobody waits for a any more: its slot may go
    assert a.slot is None and c.slot is not None


def test_a_fill_ahead_is_kept_for_its_request_until_that_leaves_the_queue(pool: AdapterPool, tmp_path: Path) -> None:
    a, b, c = (_loaded(pool, n, write_adapter(tmp_path / n, seed=i)) for i, n in enumerate("abc"))
    assert pool.fill_ahead([a, b], most=2) == 2  # both slots, neither acquired yet
    assert pool.fill_ahead([a, b, c], most=2) == 0  # c's fill ahead must not undo a's or b's
    assert pool.fill_ahead([b, c], most=2) == 1  # a's request left the queue (aborted, say)
    assert a.slot is None and b.slot is not None and c.slot is not None
    assert pool.acquire(a) is not None  # a step's own fill may still take an unacquired slot
    assert pool.acquire(b) is not None and pool.acquire(c) is None  # both slots now busy


def test_a_hot_swap_fills_the_new_version_ahead_when_the_old_one_held_a_slot(pool: AdapterPool, tmp_path: Path) -> None:
    """The first request on a swapped-in version finds it in a slot: the fill-ahead pass after the swap copies
    it, once, even with no request queued for it; a swap of an adapter in no slot fills nothing."""
    hot = _loaded(pool, "hot", write_adapter(tmp_path / "hot1", seed=1))
    cold = _loaded(pool, "cold", write_adapter(tmp_path / "cold1", seed=2))
    pool.acquire(hot)  # a request runs on it, and keeps running through the swap
    new_hot = _loaded(pool, "hot", write_adapter(tmp_path / "hot2", seed=3))
    new_cold = _loaded(pool, "cold", write_adapter(tmp_path / "cold2", seed=4))
    assert pool.lookup("hot") is new_hot and hot.retired and hot.slot is not None
    assert cold.retired and cold.slot is None
    assert pool.fill_ahead([], most=2) == 1
    assert new_hot.state is AdapterState.RESIDENT and new_cold.state is AdapterState.HOST
    assert pool.fill_ahead([], most=2) == 0  # once
    slot = new_hot.slot
    assert pool.acquire(new_hot) == slot
    assert pool.fills_ahead == 1


def test_a_swapped_in_version_filled_ahead_is_evictable_like_any_idle_one(pool: AdapterPool, tmp_path: Path) -> None:
    """After its pass, a swapped-in version no request has asked for holds its slot only as long as the
    eviction policy keeps it: no slot is kept for a version nobody uses."""
    a = _loaded(pool, "a", write_adapter(tmp_path / "a1", seed=1))
    pool.acquire(a)
    pool.release(a, tokens=1)  # idle in its slot
    new_a = _loaded(pool, "a", write_adapter(tmp_path / "a2", seed=2))  # a dropped at once: nothing runs on it
    assert a.slot is None and pool.fill_ahead([], most=2) == 1 and new_a.slot is not None
    b, c = (_loaded(pool, n, write_adapter(tmp_path / n, seed=i)) for i, n in enumerate("bc", start=3))
    assert pool.acquire(b) is not None and pool.acquire(c) is not None  # two slots: new_a's went
    assert new_a.slot is None


def _hold_loads(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the thread loader's loads wait until the returned event is set."""
    from engine import adapter_loader as loader_module

    gate = threading.Event()
    real_load = loader_module.load_adapter

    def held_load(*args, **kwargs):  # type: ignore[no-untyped-def]
        gate.wait(10)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(loader_module, "load_adapter", held_load)
    return gate


def test_registering_the_current_path_again_drops_a_replacement_still_loading(
    pool: AdapterPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The latest registration wins: going back to v1 while v2 still loads used to leave v2 staged, and the
    name switched to v2 once it had loaded."""
    v1 = write_adapter(tmp_path / "v1", seed=1)
    old = _loaded(pool, "x", v1)
    gate = _hold_loads(monkeypatch)
    new = pool.register("x", write_adapter(tmp_path / "v2", seed=2))
    assert pool.register("x", v1) is old
    gate.set()
    assert new.settled.wait(10)
    assert pool.lookup("x") is old and not old.retired
    assert new.retired and new.weights is None


def test_a_failed_load_wakes_the_engine(pool: AdapterPool, tmp_path: Path) -> None:
    """The engine sleeps until a load ends (`on_loaded`), then starts the requests that waited for it or ends
    them with the load's error (`LLMEngine._reap`); a failed load used to call nobody, and its requests got
    their error only at the engine's next poll."""
    ended = threading.Event()
    pool.on_loaded.append(ended.set)
    version = pool.register("a", _poison(write_adapter(tmp_path / "a"), float("nan")))
    assert ended.wait(5)
    assert version.state is AdapterState.FAILED


@pytest.mark.parametrize("fill", ["acquire", "fill_ahead"])
def test_weights_that_do_not_fit_a_slot_fail_their_adapter_not_the_step(
    pool: AdapterPool, tmp_path: Path, fill: str
) -> None:
    """A file rewritten for another base model (same rank and projections) after its check loads on loose
    stacks but cannot be copied into a slot. The error used to leave `acquire` (the engine's step) and fail
    the step's running requests, at every step, while the adapter's own request never ended."""
    folder = write_adapter(tmp_path / "a", seed=1)
    version = _loaded(pool, "a", folder)
    version.weights = None  # dropped from host memory, as the host tier does under pressure
    write_adapter(folder, arch=dataclasses.replace(TINY, hidden_size=48), seed=2)
    assert not pool.ready(version)
    pool.wait_loaded(version, timeout=10)
    deadline = time.monotonic() + 5
    while version.weights is None and time.monotonic() < deadline:  # the done-callback may lag
        time.sleep(0.01)
    if fill == "acquire":
        assert pool.acquire(version) is None
    else:
        assert pool.fill_ahead([version], most=1) == 0
    failure = pool.failure(version)
    assert failure is not None and "slot" in failure
    assert version.state is AdapterState.FAILED and version.active == 0
    assert not pool.ready(version)  # held in the negative cache like a failed load
    other = _loaded(pool, "b", write_adapter(tmp_path / "b", seed=3))
    assert pool.acquire(other) is not None  # the slots still serve other adapters


def test_a_load_no_loader_can_take_fails_like_a_failed_load(tmp_path: Path) -> None:
    """`submit` raises when no loader can take a load (loader processes that cannot be started again). That
    used to leave `ready` as an exception: in the engine's loop, outside its step, or in `add_request` after
    the request had been counted, which then never ended."""
    from engine.adapter_loader import ThreadLoader
    from engine.adapters import AdapterSpec

    class RefusingLoader(ThreadLoader):
        refuse = False

        def submit(self, spec: AdapterSpec):  # type: ignore[no-untyped-def]
            if self.refuse:
                raise RuntimeError("cannot start loader processes")
            return super().submit(spec)

    stacks = LoRAStacks(TINY, slots=1, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    loader = RefusingLoader(torch.float32, None)
    pool = AdapterPool(TINY, stacks, torch.float32, host_capacity=8, loader=loader)
    try:
        version = _loaded(pool, "a", write_adapter(tmp_path / "a"))
        version.weights = None  # dropped from host memory, as the host tier does under pressure
        loader.refuse = True
        assert not pool.ready(version)
        assert "cannot start loader processes" in (pool.failure(version) or "")
        assert version.state is AdapterState.FAILED and version.settled.is_set()
        other = pool.register("b", write_adapter(tmp_path / "b", seed=1))  # registration answers too
        with pytest.raises(AdapterError, match="cannot start loader processes"):
            pool.wait_loaded(other, timeout=1)
    finally:
        pool.close()


def test_the_host_tier_drops_an_idle_adapter_before_one_that_requests_wait_for(tmp_path: Path) -> None:
    """Host memory full and every slot busy: a load for a waiting request dropped another waiting request's
    adapter (loaded, never used yet, so the least recent) and kept one that nobody had asked for since. Each
    step's scheduling then loaded the dropped one again, whose load dropped the other: adapters read from disk
    over and over for as long as the slots stayed busy."""
    stacks = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    pool = AdapterPool(TINY, stacks, torch.float32, host_capacity=4)
    try:
        x, y, z = (_loaded(pool, n, write_adapter(tmp_path / n, seed=i)) for i, n in enumerate("xyz"))
        pool.acquire(x)
        pool.release(x, tokens=1)
        pool.acquire(y)  # busy
        pool.acquire(z)  # busy; x, evicted from its slot, stays in host memory, idle
        assert x.slot is None and x.weights is not None
        a = pool.register("a", write_adapter(tmp_path / "a", seed=3))
        assert not pool.ready(a)  # a request waits for a (the scheduler asks at every step)
        pool.wait_loaded(a, timeout=10)
        b = pool.register("b", write_adapter(tmp_path / "b", seed=4))
        assert not pool.ready(b) and pool.ready(a)  # both requests wait for a slot
        pool.wait_loaded(b, timeout=10)
        assert a.weights is not None and b.weights is not None, "dropped an adapter a request waits for"
        assert x.weights is None  # the one nobody waits for makes the room
        loads = pool.loads_started
        assert pool.ready(a) and pool.ready(b) and pool.loads_started == loads
    finally:
        pool.close()


@pytest.mark.parametrize("fill", ["acquire", "fill_ahead"])
def test_an_adapter_evicted_from_its_slot_leaves_host_memory_when_that_is_full(tmp_path: Path, fill: str) -> None:
    """Host capacity counts every adapter with a host copy, those in slots too; only a load's end trimmed
    the host tier. An adapter evicted from its slot into a full host tier then stayed: up to one adapter per
    slot over the capacity, for as long as no load ended (with a pinned arena, extents new loads lacked)."""
    stacks = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    pool = AdapterPool(TINY, stacks, torch.float32, host_capacity=2)
    try:
        x, y = (_loaded(pool, n, write_adapter(tmp_path / n, seed=i)) for i, n in enumerate("xy"))
        for v in (x, y):
            pool.acquire(v)
            pool.release(v, tokens=1)  # both idle in their slots
        z = _loaded(pool, "z", write_adapter(tmp_path / "z", seed=2))
        assert x.weights is not None and y.weights is not None  # nothing could be dropped: x and y in slots
        if fill == "acquire":
            assert pool.acquire(z) is not None
        else:
            assert pool.fill_ahead([z], most=1) == 1
        assert x.slot is None and pool.evictions == 1
        assert x.weights is None, "the evicted adapter kept its host copy beyond the host capacity"
        assert y.weights is not None and z.weights is not None
    finally:
        pool.close()


def test_unpinning_an_adapter_beyond_the_host_capacity_drops_its_host_copy(pool: AdapterPool, tmp_path: Path) -> None:
    """A pinned adapter's host copy is kept whatever the capacity; unpinned, it stayed beyond it."""
    pool._host_capacity = 1
    folder = write_adapter(tmp_path / "p", seed=1)
    pinned = _loaded(pool, "p", folder, pin=True)
    other = _loaded(pool, "q", write_adapter(tmp_path / "q", seed=2))
    assert pinned.weights is not None and other.weights is not None  # the pin and the load just ended stay
    assert pool.register("p", folder, pinned=False) is pinned and not pinned.pinned
    assert sum(v.weights is not None for v in (pinned, other)) == 1


def _arena_pool(tmp_path: Path, images: int) -> tuple[AdapterPool, ManualLoader, PinnedArena]:
    """A pool of fused stacks with one slot, whose loads write into a shared arena with room for `images`
    rank-4 q/v images (as loader processes write them)."""
    stacks = LoRAStacks(TINY, slots=1, max_rank=8, dtype=torch.float32, device=torch.device("cpu"), fused=True)
    assert stacks.layout is not None
    image_bytes = stacks.layout.image_size(image_groups(("q_proj", "v_proj")), 4) * 4
    arena = PinnedArena(images * -(-image_bytes // 4096) * 4096, pin=False, page_bytes=4096)
    loader = ManualLoader(torch.float32, stacks.layout, arena)
    return AdapterPool(TINY, stacks, torch.float32, 8, loader=loader, arena=arena), loader, arena


@pytest.mark.parametrize("waited_for", [False, True], ids=["idle", "waited-for"])
def test_a_full_arena_makes_room_by_dropping_an_idle_host_copy(tmp_path: Path, waited_for: bool) -> None:
    """With the shared arena full of host copies nobody used, a load went to a pinned allocation of its own: on a
    GPU a cudaHostAlloc, which holds up every stream (at Llama-7B dims, others' p99 10x steady during cold joins
    once 26 adapters had loaded). An idle copy makes room now; one a request waits for, or one in a slot, stays."""
    pool, loader, arena = _arena_pool(tmp_path, images=2)
    rng = random.Random(0)

    def loaded(name: str, seed: int):  # type: ignore[no-untyped-def]
        version = pool.register(name, write_adapter(tmp_path / name, seed=seed))
        loader.finish_all(rng)
        assert version.weights is not None
        return version

    try:
        x, y = loaded("x", 0), loaded("y", 1)
        for v in (x, y):  # y takes the one slot: x, evicted, idles in the arena
            assert pool.acquire(v) is not None
            pool.release(v, tokens=1)
        assert x.slot is None and y.slot is not None
        assert all(v.weights is not None and arena.holds(v.weights.packed) for v in (x, y))
        if waited_for:
            assert pool.ready(x)  # a request waits for x
        z = loaded("z", 2)
        assert z.weights is not None and arena.holds(z.weights.packed) != waited_for
        assert (x.weights is not None) == waited_for, "dropped a host copy that a request waits for"
        assert y.weights is not None  # in the slot
    finally:
        pool.close()
        arena.close()


class _CheckingLoader(ManualLoader):
    """A `ManualLoader` that notes how many loads were submitted when each check ran, and can start the loads
    queued then (so that they run beside the check) or fail the check."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.submitted_at_check: list[int] = []
        self.start_all_during_check = False
        self.fail_check = False

    def check(self, path: Path, arch, max_rank: int):  # type: ignore[no-untyped-def]
        self.submitted_at_check.append(self.submitted)
        if self.start_all_during_check:
            while self.start(random.Random(0)):
                pass
        if self.fail_check:
            raise AdapterError(f"{path}: refused by the test")
        return super().check(path, arch, max_rank)


def _checking_pool(tmp_path: Path) -> tuple[AdapterPool, _CheckingLoader, PinnedArena]:
    stacks = LoRAStacks(TINY, slots=1, max_rank=8, dtype=torch.float32, device=torch.device("cpu"), fused=True)
    assert stacks.layout is not None
    arena = PinnedArena(16 * 4096, pin=False, page_bytes=4096)
    loader = _CheckingLoader(torch.float32, stacks.layout, arena)
    return AdapterPool(TINY, stacks, torch.float32, 8, loader=loader, arena=arena), loader, arena


def _image(version) -> torch.Tensor:  # type: ignore[no-untyped-def]
    assert version.weights is not None and version.weights.packed is not None
    return version.weights.packed


def test_a_hot_swap_starts_the_new_versions_load_before_its_check(tmp_path: Path) -> None:
    """The check is a round trip to a loader process (3-5 ms on an H100 host) that the load used to wait for."""
    pool, loader, arena = _checking_pool(tmp_path)
    rng = random.Random(0)
    old = pool.register("x", write_adapter(tmp_path / "v1", seed=1))
    loader.finish_all(rng)
    assert loader.submitted_at_check == [0]  # a first version: nothing to guess its shapes from
    new = pool.register("x", write_adapter(tmp_path / "v2", seed=2))
    assert loader.submitted_at_check == [0, 2] and loader.submitted == 2  # loading during the check, once
    assert pool.lookup("x") is old  # the old version serves until the new one has loaded
    loader.finish_all(rng)
    assert pool.lookup("x") is new and old.retired
    expected = ManualLoader(torch.float32, pool._stacks.layout)._read(new.spec)
    assert expected.packed is not None and torch.equal(_image(new), expected.packed)
    assert arena.holds(_image(new))
    pool.close()
    arena.close()


def test_a_load_started_ahead_for_other_shapes_is_dropped_for_one_of_the_checked_shapes(tmp_path: Path) -> None:
    pool, loader, arena = _checking_pool(tmp_path)
    rng = random.Random(0)
    old = pool.register("x", write_adapter(tmp_path / "v1", rank=4, seed=1))
    loader.finish_all(rng)
    loader.start_all_during_check = True  # the guess (rank 4) is running when the check says rank 8
    new = pool.register("x", write_adapter(tmp_path / "v2", rank=8, seed=2))
    assert loader.submitted == 3
    loader.finish_all(rng)  # the guess fails on the rank-8 file; the load of the checked spec succeeds
    assert pool.lookup("x") is new and new.error is None and new.weights is not None and new.weights.rank == 8
    assert old.weights is None  # retired, idle: dropped, its image given back
    assert arena.free_pages == arena.pages - _pages(arena, new), "the guess's image was not given back"
    pool.close()
    arena.close()


def _pages(arena: PinnedArena, *versions) -> int:  # type: ignore[no-untyped-def]
    return sum(-(-_image(v).numel() * _image(v).element_size() // arena.page_bytes) for v in versions)


def test_a_load_started_ahead_of_a_check_that_fails_is_dropped_and_its_image_given_back(tmp_path: Path) -> None:
    pool, loader, arena = _checking_pool(tmp_path)
    rng = random.Random(0)
    old = pool.register("x", write_adapter(tmp_path / "v1", seed=1))
    loader.finish_all(rng)
    loader.start_all_during_check, loader.fail_check = True, True  # no longer cancellable when the check fails
    with pytest.raises(AdapterError, match="refused by the test"):
        pool.register("x", write_adapter(tmp_path / "v2", seed=2))
    loader.finish_all(rng)  # the guess loads fine, for nobody
    assert pool.lookup("x") is old and not old.retired
    assert arena.free_pages == arena.pages - _pages(arena, old)
    pool.close()
    arena.close()


def test_without_load_ahead_a_hot_swap_loads_after_its_check(tmp_path: Path) -> None:
    pool, loader, _ = _checking_pool(tmp_path)
    pool.load_ahead = False
    pool.register("x", write_adapter(tmp_path / "v1", seed=1))
    loader.finish_all(random.Random(0))
    new = pool.register("x", write_adapter(tmp_path / "v2", seed=2))
    assert loader.submitted_at_check == [0, 1] and loader.submitted == 2
    loader.finish_all(random.Random(0))
    assert pool.lookup("x") is new
    pool.close()


def test_a_load_started_ahead_of_a_pin_refused_for_want_of_room_is_dropped(tmp_path: Path) -> None:
    """The refusal comes after the check, from the pool itself: the load started ahead was left running for
    nobody, and its image kept an extent of the arena for good."""
    pool, loader, arena = _checking_pool(tmp_path)  # one slot: no pin fits, one slot stays for the unpinned
    rng = random.Random(0)
    old = pool.register("x", write_adapter(tmp_path / "v1", seed=1))
    loader.finish_all(rng)
    loader.start_all_during_check = True
    with pytest.raises(AdapterError, match="cannot pin"):
        pool.register("x", write_adapter(tmp_path / "v2", seed=2), pinned=True)
    assert loader.submitted == 2  # it was started ahead
    loader.finish_all(rng)
    assert pool.lookup("x") is old
    assert arena.free_pages == arena.pages - _pages(arena, old), "the image loaded ahead kept its extent"
    pool.close()
    arena.close()


def test_a_load_cancelled_by_anything_but_a_retirement_fails_its_version(tmp_path: Path) -> None:
    """A load's future is cancelled on purpose only when its version is retired. Any other cancel (a loader
    that cancels its queued tasks) used to leave a staged version staged for good, and `wait_loaded` reported
    success for a version that never loaded."""
    pool, loader, arena = _checking_pool(tmp_path)
    rng = random.Random(0)
    old = pool.register("x", write_adapter(tmp_path / "v1", seed=1))
    loader.finish_all(rng)
    new = pool.register("x", write_adapter(tmp_path / "v2", seed=2))
    assert new.loading is not None and new.loading.cancel()
    assert new.settled.is_set() and pool.lookup("x") is old and not old.retired
    with pytest.raises(AdapterError, match="cancelled"):
        pool.wait_loaded(new, timeout=1)
    pool.close()
    arena.close()
