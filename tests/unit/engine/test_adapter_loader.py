"""Adapter loaders: worker processes give exactly what the in-process threads give, errors included."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import engine.adapter_loader as loader_module
from engine.adapter_device_loader import gpu_bytes
from engine.adapter_loader import ProcessLoader, ThreadLoader
from engine.adapters import AdapterError, read_spec
from engine.config import EngineConfig
from engine.lora import AdapterWeights, LoRAStacks
from engine.pinned_arena import PinnedArena
from engine.pool import AdapterPool
from tests.unit.engine.test_pool import _poison
from tests.unit.engine.tiny import TINY, write_adapter

ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def fused_layout():  # type: ignore[no-untyped-def]
    stacks = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"), fused=True)
    return stacks.layout


@pytest.fixture(scope="module")
def shared_arena() -> Iterator[PinnedArena]:
    arena = PinnedArena(64 * 4096, pin=False, page_bytes=4096)
    yield arena
    arena.close()


@pytest.fixture(scope="module")
def process_loaders(fused_layout, shared_arena: PinnedArena) -> Iterator[dict[str, ProcessLoader]]:  # type: ignore[no-untyped-def]
    # Spawned workers import torch once each: share them across this module's tests.
    loaders = {
        "loose": ProcessLoader(torch.float32, None, workers=1),
        "packed": ProcessLoader(torch.float32, fused_layout, workers=1),
        # Two workers: each load into the shared arena is split in two parts, one layer each.
        "shared": ProcessLoader(torch.float32, fused_layout, workers=2, arena=shared_arena),
    }
    yield loaders
    for loader in loaders.values():
        loader.close()


def _same(a: AdapterWeights, b: AdapterWeights) -> None:
    assert (a.rank, a.scaling, a.modules, a.packed_groups) == (b.rank, b.scaling, b.modules, b.packed_groups)
    assert a.tensors.keys() == b.tensors.keys()
    for key, (a_a, a_b) in a.tensors.items():
        torch.testing.assert_close(a_a, b.tensors[key][0], rtol=0, atol=0)
        torch.testing.assert_close(a_b, b.tensors[key][1], rtol=0, atol=0)
    if a.packed is not None or b.packed is not None:
        assert a.packed is not None and b.packed is not None
        torch.testing.assert_close(a.packed, b.packed, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["loose", "packed", "shared"])
def test_process_loader_returns_what_the_thread_loader_returns(
    kind: str,
    fused_layout,
    process_loaders: dict[str, ProcessLoader],
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=ALL7, seed=3), TINY, 8)
    threads = ThreadLoader(torch.float32, fused_layout if kind != "loose" else None)
    try:
        want = threads.submit(spec).result(30)
    finally:
        threads.close()
    got = process_loaders[kind].submit(spec).result(60)
    assert (got.packed is not None) == (kind != "loose")
    _same(got, want)


def test_a_worker_writes_the_image_straight_into_the_shared_arena(
    process_loaders: dict[str, ProcessLoader], shared_arena: PinnedArena, tmp_path: Path
) -> None:
    empty = shared_arena.free_pages
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=ALL7, seed=5), TINY, 8)
    got = process_loaders["shared"].submit(spec).result(60)
    assert got.packed is not None
    assert 0 <= shared_arena.offset(got.packed) < shared_arena.pages * shared_arena.page_bytes
    assert shared_arena.free_pages < empty
    assert shared_arena.give_back(got.packed)  # the engine process owns it, as an extent of its arena
    assert shared_arena.free_pages == empty


def test_a_failed_or_cancelled_load_into_the_shared_arena_gives_its_extent_back(
    process_loaders: dict[str, ProcessLoader], shared_arena: PinnedArena, tmp_path: Path
) -> None:
    empty = shared_arena.free_pages
    # Poisoned in layer 0: one part of the split load fails, the other succeeds; the load fails as a whole.
    broken = read_spec(_poison(write_adapter(tmp_path / "bad"), float("nan")), TINY, 8)
    error = process_loaders["shared"].submit(broken).exception(60)
    assert isinstance(error, AdapterError) and "NaN or infinite" in str(error)
    assert shared_arena.free_pages == empty
    good = read_spec(write_adapter(tmp_path / "good"), TINY, 8)
    futures = [process_loaders["shared"].submit(good) for _ in range(20)]
    for future in futures:  # some are queued, some running, some done: every outcome must free its extent
        future.cancel()
    for future in futures:
        if not future.cancelled():
            weights = future.result(60)
            assert weights.packed is not None
            shared_arena.give_back(weights.packed)  # delivered: the pool's to give back
    deadline = time.monotonic() + 60
    while shared_arena.free_pages != empty and time.monotonic() < deadline:
        time.sleep(0.05)
    assert shared_arena.free_pages == empty


@pytest.mark.parametrize("kind", ["packed", "shared"])
def test_a_process_load_let_go_is_freed_without_the_cyclic_collector(
    kind: str, process_loaders: dict[str, ProcessLoader], tmp_path: Path
) -> None:
    """The outer future and the worker's (or the parts') referred to each other (each cancels the other), so
    a result let go of, its page-locked image included, lived until a garbage collection."""
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=ALL7, seed=3), TINY, 8)
    gc.disable()
    try:
        got = process_loaders[kind].submit(spec).result(60)
        assert got.packed is not None
        image = weakref.ref(got.packed)
        if kind == "shared":
            process_loaders[kind]._arena.give_back(got.packed)  # type: ignore[union-attr]  # (as the pool does)
        del got
        deadline = time.monotonic() + 5  # (a pool thread may hold its task a moment after the result is set)
        while image() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert image() is None
    finally:
        gc.enable()


def test_process_loader_reports_a_broken_adapter(process_loaders: dict[str, ProcessLoader], tmp_path: Path) -> None:
    spec = read_spec(_poison(write_adapter(tmp_path / "a"), float("nan")), TINY, 8)
    error = process_loaders["loose"].submit(spec).exception(60)
    assert isinstance(error, AdapterError) and "NaN or infinite" in str(error)


def test_process_loader_checks_adapters_as_read_spec_does(
    process_loaders: dict[str, ProcessLoader], tmp_path: Path
) -> None:
    """Registration's header check runs in a worker (off the engine process's GIL): same spec, same errors."""
    loader = process_loaders["shared"]
    good = write_adapter(tmp_path / "good", modules=ALL7, rank=4)
    assert loader.check(good, TINY, 8) == read_spec(good, TINY, 8)
    with pytest.raises(AdapterError, match="exceeds the engine's max_lora_rank 2"):
        loader.check(good, TINY, 2)
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        loader.check(tmp_path / "missing", TINY, 8)


def test_a_check_after_the_workers_died_runs_on_new_ones(tmp_path: Path) -> None:
    loader = ProcessLoader(torch.float32, None, workers=1)
    try:
        path = write_adapter(tmp_path / "a")
        for process in loader.processes():
            process.kill()
        assert loader.check(path, TINY, 8) == read_spec(path, TINY, 8)
    finally:
        loader.close()


def test_a_check_that_waits_too_long_times_out_and_the_next_one_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    loader = ProcessLoader(torch.float32, None, workers=1)
    try:
        path = write_adapter(tmp_path / "a")
        monkeypatch.setattr(loader_module, "CHECK_TIMEOUT_S", 0.0)  # no answer from a worker is that fast
        with pytest.raises(TimeoutError):
            loader.check(path, TINY, 8)
        monkeypatch.undo()
        assert loader.check(path, TINY, 8) == read_spec(path, TINY, 8)
    finally:
        loader.close()


def test_a_cancelled_process_load_stays_cancelled(process_loaders: dict[str, ProcessLoader], tmp_path: Path) -> None:
    spec = read_spec(write_adapter(tmp_path / "a"), TINY, 8)
    loader = process_loaders["packed"]
    # The one worker sleeps first, so the load is still queued when it is cancelled: a warm worker could
    # otherwise finish a tiny load before `cancel` runs (it did once, on a busy 2-core machine).
    busy = loader._run(time.sleep, 1.0)
    future = loader.submit(spec)
    assert future.cancel() and future.cancelled()
    busy.result(60)
    assert loader.submit(spec).result(60).rank == spec.rank  # the worker is still usable afterwards
    assert future.cancelled()


def test_pool_with_a_process_loader_loads_and_hot_swaps(tmp_path: Path) -> None:
    stacks = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"), fused=True)
    loader = ProcessLoader(torch.float32, stacks.layout, workers=1)
    pool = AdapterPool(TINY, stacks, torch.float32, host_capacity=4, loader=loader)
    try:
        old = pool.register("x", write_adapter(tmp_path / "v1", seed=1))
        pool.wait_loaded(old, timeout=60)
        assert pool.acquire(old) is not None and int(stacks.group_ranks["qkv"][old.slot]) == 4
        new = pool.register("x", write_adapter(tmp_path / "v2", seed=2))
        pool.wait_loaded(new, timeout=60)
        assert pool.lookup("x") is new and old.retired
    finally:
        pool.close()


@pytest.mark.parametrize("kind", ["whole", "split"])
def test_loads_in_flight_when_the_workers_die_are_started_again(
    kind: str,
    fused_layout,
    shared_arena: PinnedArena,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """Killed workers fail their tasks in flight with BrokenProcessPool (a worker may have been loading another
    adapter, or its part of one), and at first every later task for them too: the loads start again."""
    if kind == "split":
        loader = ProcessLoader(torch.float32, fused_layout, workers=2, arena=shared_arena)
    else:
        loader = ProcessLoader(torch.float32, None, workers=1)
    try:
        specs = [read_spec(write_adapter(tmp_path / f"a{i}", modules=ALL7, seed=i), TINY, 8) for i in range(6)]
        loader.submit(specs[0]).result(60)
        futures = [loader.submit(spec) for spec in specs]
        for process in loader.processes():
            process.kill()
        for future in futures:
            weights = future.result(60)
            if weights.packed is not None:
                shared_arena.give_back(weights.packed)
        loader.submit(specs[1]).result(60)  # and later loads work
    finally:
        loader.close()


def test_the_parts_of_a_split_load_go_one_to_each_worker(
    fused_layout,  # type: ignore[no-untyped-def]
    shared_arena: PinnedArena,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Workers that shared one queue started the parts of a load one after another, a wake-up apart (9-17 ms
    for 8 parts on the GPU host): each part now goes to a worker's own queue, the least busy workers first."""
    loader = ProcessLoader(torch.float32, fused_layout, workers=2, arena=shared_arena)
    workers: list[int | None] = []
    run = loader._run

    def spy(fn, *args, worker=None):  # type: ignore[no-untyped-def]
        if fn is loader_module.fill_layers:
            workers.append(worker)
        return run(fn, *args, worker=worker)

    monkeypatch.setattr(loader, "_run", spy)
    try:
        spec = read_spec(write_adapter(tmp_path / "a", modules=ALL7), TINY, 8)
        busy = run(time.sleep, 0.5, worker=0)
        weights = loader.submit(spec).result(60)
        assert workers == [1, 0]  # worker 1 first: worker 0 was busy
        assert weights.packed is not None and shared_arena.give_back(weights.packed)
        busy.result(60)
    finally:
        loader.close()


def test_a_check_runs_beside_busy_workers_not_behind_them(tmp_path: Path) -> None:
    """A hot swap starts its new version's load beside the check (`AdapterPool._load_ahead`), a part on every
    worker: the check must not queue behind one of them."""
    loader = ProcessLoader(torch.float32, None, workers=2)
    try:
        path = write_adapter(tmp_path / "a")
        for worker in range(3):  # all started (each imports torch first)
            loader._run(int, worker=worker).result(60)
        busy = [loader._run(time.sleep, 20.0, worker=worker) for worker in range(2)]
        assert loader.check(path, TINY, 8) == read_spec(path, TINY, 8)
        assert not any(future.done() for future in busy)
    finally:
        for process in loader.processes():  # the sleeping one, which a shutdown would wait for at exit
            process.kill()
        loader.close()


def test_workers_start_with_the_loader_not_with_the_first_load() -> None:
    """A first cold load used to wait for its worker's start (a second or more: the import of torch)."""
    loader = ProcessLoader(torch.float32, None, workers=2)
    try:
        assert len(loader.processes()) == 3  # two loading, one checking
    finally:
        loader.close()


def test_a_load_cancelled_while_its_result_is_copied_out_leaves_no_extent_taken(
    shared_arena: PinnedArena, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's result is copied into an extent of the arena (`_own`) on a thread of the engine process. A
    cancel meanwhile (the pool retires a version in a hot swap or an unload) made the result undeliverable,
    and the extent, held by nobody, never went back."""
    from concurrent.futures import Future

    empty = shared_arena.free_pages
    outer: Future[AdapterWeights] = Future()
    real_own = loader_module._own

    def own_then_cancel(*args):  # type: ignore[no-untyped-def]
        owned = real_own(*args)
        outer.cancel()  # from another thread, while the copy ran
        return owned

    monkeypatch.setattr(loader_module, "_own", own_then_cancel)
    packed = torch.ones(3 * shared_arena.page_bytes // 4)  # a worker's image in its shared memory
    inner: Future[AdapterWeights] = Future()
    inner.add_done_callback(loader_module._settle(outer, False, shared_arena, None))
    inner.set_result(AdapterWeights(4, 2.0, frozenset({"q_proj"}), {}, packed, ("qkv",)))
    assert outer.done()
    if not outer.cancelled():  # delivered: the caller's (the pool's) to give back
        weights = outer.result(0)
        assert weights.packed is not None and shared_arena.give_back(weights.packed)
    assert shared_arena.free_pages == empty


def _loader_without_workers() -> ProcessLoader:
    import threading

    loader = ProcessLoader.__new__(ProcessLoader)
    loader._dtype, loader._layout, loader._arena = torch.float32, None, None
    loader._pin, loader._workers, loader._lock = False, 1, threading.RLock()
    return loader


def test_a_load_restarted_after_the_workers_died_fails_if_no_new_worker_takes_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The restart runs in a callback of the failed future, where an exception is only logged: a restart
    that could not submit (new workers that could not start) left the load pending for good, and the
    requests waiting for its adapter with it."""
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    loader = _loader_without_workers()  # `_run` below stands for them
    calls = []

    def run(fn, *args):  # type: ignore[no-untyped-def]
        calls.append(fn)
        if len(calls) > 1:
            raise RuntimeError("cannot start loader processes")
        broken: Future[AdapterWeights] = Future()
        broken.set_exception(BrokenProcessPool("a worker died"))
        return broken

    monkeypatch.setattr(loader, "_run", run)
    future = loader.submit(read_spec(write_adapter(tmp_path / "a"), TINY, 8))
    assert len(calls) == 2  # started once more
    with pytest.raises(RuntimeError, match="cannot start loader processes"):
        future.result(timeout=1)


def test_a_load_whose_workers_keep_dying_is_tried_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Workers killed together die milliseconds apart, so a load started again at the first death may lose a
    part to the next one: it is tried again more than once, but a load that kills every worker it runs on (a
    file truncated under their maps) must end."""
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    loader = _loader_without_workers()  # `_run` below stands for them
    calls = []

    def run(fn, *args):  # type: ignore[no-untyped-def]
        calls.append(fn)
        broken: Future[AdapterWeights] = Future()
        broken.set_exception(BrokenProcessPool("a worker died"))
        return broken

    monkeypatch.setattr(loader, "_run", run)
    future = loader.submit(read_spec(write_adapter(tmp_path / "a"), TINY, 8))
    assert len(calls) == 1 + loader_module.LOAD_RETRIES > 2
    with pytest.raises(BrokenProcessPool):
        future.result(timeout=1)


def test_a_worker_replaced_as_dead_leaves_its_queued_tasks_to_end_not_cancelled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`_run` replaces a worker whose process has died before the executor noticed. Shutting the old executor
    down cancelled its queued tasks, and a cancelled part ended its load with nobody to start it again (the
    pool ignored cancelled loads). Now they end as the executor ends them: here, with the process alive after
    all, they run. (Only the loader is told the process died: patched on the process itself, the executor's
    own thread saw no child to stop at shutdown, and waited for it at the interpreter's exit.)"""
    loader = ProcessLoader(torch.float32, None, workers=1)
    try:
        loader._run(int, worker=0).result(60)  # started
        queued = [loader._run(time.sleep, 0.3, worker=0)] + [loader._run(int, "7", worker=0) for _ in range(4)]
        with monkeypatch.context() as patch:
            patch.setattr(loader_module, "_alive", lambda process: False)
            replaced = loader._run(int, "8", worker=0)  # on a new process
        assert replaced.result(60) == 8
        assert not any(f.cancelled() for f in queued)
        assert [f.result(60) for f in queued[1:]] == [7] * 4
    finally:
        loader.close()


@pytest.mark.parametrize(
    ("asked", "device", "fused", "kind"),
    [
        ("auto", "cuda", True, "device"),  # the GPU default: read by threads, converted on the device
        ("auto", "cuda", False, "process"),
        ("auto", "cpu", True, "thread"),
        ("auto", "cpu", False, "thread"),
        ("process", "cuda", True, "process"),
        ("process", "cpu", False, "process"),
        ("thread", "cuda", True, "thread"),
        ("thread", "cpu", True, "thread"),
        ("device", "cuda", True, "device"),
        ("device", "cuda", False, "process"),  # the device loader places fused slot images only
    ],
)
def test_the_loader_each_setting_means(asked: str, device: str, fused: bool, kind: str) -> None:
    assert loader_module.loader_kind(asked, torch.device(device), fused=fused) == kind


@pytest.mark.parametrize(
    ("asked", "device", "takes"),
    [("auto", "cuda", True), ("device", "cuda", True), ("process", "cuda", False), ("auto", "cpu", False)],
)
def test_only_the_device_loader_takes_gpu_memory_the_kv_cache_leaves(asked: str, device: str, takes: bool) -> None:
    stacks = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.bfloat16, device=torch.device("cpu"), fused=True)
    assert stacks.layout is not None
    config = EngineConfig(adapter_loader=asked)
    got = loader_module.loader_gpu_bytes(config, torch.device(device), torch.bfloat16, stacks.layout)
    assert gpu_bytes(stacks.layout, torch.bfloat16) > 0
    assert got == (gpu_bytes(stacks.layout, torch.bfloat16) if takes else 0)
