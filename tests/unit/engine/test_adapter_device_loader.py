"""DeviceLoader: reads adapter files by threads, a chunk at a time, and places and checks them where the engine
runs; it gives exactly the image the in-process thread loader packs, and the same errors. On this CPU machine
the device is the CPU (the copies are synchronous); tests/gpu/test_lora_gpu.py runs it on CUDA."""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import BinaryIO

import pytest
import torch
from safetensors.torch import load_file, save, save_file

from engine import adapter_device_loader
from engine.adapter_device_loader import DeviceLoader, stored_header
from engine.adapter_loader import ThreadLoader
from engine.adapters import WEIGHTS_FILE, AdapterError, AdapterSpec, StoredTensor, read_spec, stored_tensors
from engine.lora import AdapterWeights, LoRAStacks, SlotLayout
from engine.pinned_arena import PinnedArena
from engine.pool import DEVICE_IMAGES_KEPT, AdapterPool, AdapterState
from tests.unit.engine.test_adapter_loader import _same
from tests.unit.engine.test_pool import _poison
from tests.unit.engine.tiny import TINY, write_adapter

ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def layout() -> SlotLayout:
    stacks = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.bfloat16, device=torch.device("cpu"), fused=True)
    assert stacks.layout is not None
    return stacks.layout


@pytest.fixture
def arena() -> Iterator[PinnedArena]:
    arena = PinnedArena(64 * 4096, pin=False, page_bytes=4096)
    yield arena
    arena.close()


@pytest.fixture
def loader(layout: SlotLayout, arena: PinnedArena) -> Iterator[DeviceLoader]:
    # Chunks far smaller than a file, and a ring of 3: every load reuses chunks, and its reads run side by side.
    loader = DeviceLoader(
        ThreadLoader(torch.bfloat16, layout),
        torch.bfloat16,
        layout,
        torch.device("cpu"),
        arena,
        readers=4,
        chunk_bytes=1000,
        chunks=3,
    )
    yield loader
    loader.close()


def _thread_load(spec: AdapterSpec, layout: SlotLayout) -> AdapterWeights:
    threads = ThreadLoader(torch.bfloat16, layout)
    try:
        return threads.submit(spec).result(30)
    finally:
        threads.close()


@pytest.mark.parametrize(
    ("modules", "dtype"),
    [(ALL7, torch.float32), (("q_proj", "v_proj"), torch.float32), (ALL7, torch.bfloat16), (ALL7, torch.float16)],
)
def test_a_load_gives_the_image_the_thread_loader_packs(
    modules: tuple[str, ...], dtype: torch.dtype, loader: DeviceLoader, layout: SlotLayout, tmp_path: Path
) -> None:
    folder = write_adapter(tmp_path / "a", rank=4, modules=modules, seed=5)
    if dtype != torch.float32:  # files as stored in other dtypes: converted where the image is placed
        path = folder / WEIGHTS_FILE
        save_file({k: v.to(dtype) for k, v in load_file(str(path)).items()}, str(path))
    spec = read_spec(folder, TINY, 8)
    got = loader.submit(spec).result(30)
    _same(got, _thread_load(spec, layout))


def test_the_host_image_is_an_extent_of_the_arena(loader: DeviceLoader, arena: PinnedArena, tmp_path: Path) -> None:
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=ALL7), TINY, 8)
    free = arena.free_pages
    got = loader.submit(spec).result(30)
    assert got.packed is not None and arena.holds(got.packed)
    assert arena.free_pages < free


def test_a_load_with_no_arena_room_gets_an_image_of_its_own(layout: SlotLayout, tmp_path: Path) -> None:
    tiny_arena = PinnedArena(4096, pin=False, page_bytes=4096)  # one page: no ALL7 image fits
    loader = DeviceLoader(ThreadLoader(torch.bfloat16, layout), torch.bfloat16, layout, torch.device("cpu"), tiny_arena)
    try:
        spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=ALL7), TINY, 8)
        got = loader.submit(spec).result(30)
        assert got.packed is not None and not tiny_arena.holds(got.packed)
        _same(got, _thread_load(spec, layout))
    finally:
        loader.close()
        tiny_arena.close()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_file_with_non_finite_values_fails_and_gives_its_extent_back(
    value: float, loader: DeviceLoader, arena: PinnedArena, tmp_path: Path
) -> None:
    folder = write_adapter(tmp_path / "a", rank=4, modules=ALL7)
    spec = read_spec(folder, TINY, 8)
    _poison(folder, value)
    free = arena.free_pages
    with pytest.raises(AdapterError, match="NaN or infinite"):
        loader.submit(spec).result(30)
    assert arena.free_pages == free


def test_a_value_that_overflows_the_engine_dtype_fails(loader: DeviceLoader, tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", rank=4)
    spec = read_spec(folder, TINY, 8)
    _poison(folder, 3.4e38)  # finite in the file's float32, infinite in bfloat16 (largest finite: 3.39e38)
    with pytest.raises(AdapterError, match="NaN or infinite"):
        loader.submit(spec).result(30)


def test_a_file_rewritten_at_another_rank_since_its_check_fails(loader: DeviceLoader, tmp_path: Path) -> None:
    spec = read_spec(write_adapter(tmp_path / "a", rank=4), TINY, 8)
    write_adapter(tmp_path / "a", rank=2)
    with pytest.raises(AdapterError, match="changed since it was registered"):
        loader.submit(spec).result(30)


def test_a_file_rewritten_with_other_projections_since_its_check_fails(loader: DeviceLoader, tmp_path: Path) -> None:
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=("q_proj",)), TINY, 8)
    write_adapter(tmp_path / "a", rank=4, modules=("q_proj", "down_proj"))
    with pytest.raises(AdapterError, match="changed since it was registered"):
        loader.submit(spec).result(30)


def test_a_truncated_file_fails_with_an_adapter_error(loader: DeviceLoader, tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", rank=4, modules=ALL7)
    spec = read_spec(folder, TINY, 8)
    path = folder / WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(AdapterError, match=WEIGHTS_FILE):
        loader.submit(spec).result(30)


def test_a_missing_file_fails_with_an_adapter_error(loader: DeviceLoader, tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", rank=4)
    spec = read_spec(folder, TINY, 8)
    (folder / WEIGHTS_FILE).unlink()
    with pytest.raises(AdapterError, match="cannot load"):
        loader.submit(spec).result(30)


def _misaligned(folder: Path) -> None:
    """Rewrite the weights file with a header two bytes longer than the writer pads it to: its float32 tensors
    then start at offsets that are not multiples of 4 (valid safetensors; the format does not promise
    alignment)."""
    path = folder / WEIGHTS_FILE
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.dumps(json.loads(data[8 : 8 + length])).encode()
    header += b" " * ((2 - (8 + len(header))) % 4)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + length :])


def _as_float64(folder: Path) -> None:
    path = folder / WEIGHTS_FILE
    save_file({k: v.to(torch.float64) for k, v in load_file(str(path)).items()}, str(path))


@pytest.mark.parametrize("rewrite", [_misaligned, _as_float64], ids=["misaligned", "float64"])
def test_a_file_of_misaligned_or_float64_tensors_is_loaded_by_the_fallback(
    rewrite: Callable[[Path], None], loader: DeviceLoader, layout: SlotLayout, tmp_path: Path
) -> None:
    """Float64 files too: `gpu_bytes`, which the KV cache leaves free, counts 4 bytes an element as stored."""
    folder = write_adapter(tmp_path / "a", rank=4, modules=ALL7, seed=8)
    rewrite(folder)
    spec = read_spec(folder, TINY, 8)
    fallback = loader._fallback
    submitted: list[AdapterSpec] = []
    submit = fallback.submit
    fallback.submit = lambda s: submitted.append(s) or submit(s)  # type: ignore[method-assign]
    got = loader.submit(spec).result(30)
    assert submitted == [spec]
    _same(got, _thread_load(spec, layout))
    aligned = read_spec(write_adapter(tmp_path / "b", rank=4, modules=ALL7, seed=8), TINY, 8)
    loader.submit(aligned).result(30)
    assert submitted == [spec]  # an aligned file is read by the loader's own threads


def test_checks_are_the_fallbacks(loader: DeviceLoader, tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", rank=4)
    assert loader.check(folder, TINY, 8) == read_spec(folder, TINY, 8)
    with pytest.raises(AdapterError, match="exceeds"):
        loader.check(folder, TINY, 2)


def test_a_load_cancelled_while_queued_never_runs_and_takes_no_extent(
    loader: DeviceLoader, arena: PinnedArena, tmp_path: Path
) -> None:
    specs = [read_spec(write_adapter(tmp_path / n, rank=4, modules=ALL7, seed=i), TINY, 8) for i, n in enumerate("ab")]
    free = arena.free_pages
    first: Future[AdapterWeights] = loader.submit(specs[0])
    second = loader.submit(specs[1])  # queued behind the first: loads run one at a time
    assert second.cancel()
    image = first.result(30).packed
    assert image is not None
    assert arena.free_pages == free - arena._pages(image.numel() * image.element_size())


def test_a_result_nobody_takes_goes_back_to_the_arena(loader: DeviceLoader, arena: PinnedArena, tmp_path: Path) -> None:
    specs = [read_spec(write_adapter(tmp_path / n, rank=4, modules=ALL7, seed=i), TINY, 8) for i, n in enumerate("ab")]
    free = arena.free_pages
    futures = [loader.submit(spec) for spec in specs]
    # Cancel the second: whether it had started or not, its image must not stay taken.
    futures[1].cancel()
    kept = futures[0].result(30).packed
    assert kept is not None
    loader._loads.submit(lambda: None).result(30)  # every load has ended
    assert arena.free_pages == free - arena._pages(kept.numel() * kept.element_size())


def test_a_pool_loads_and_hot_swaps_through_it(layout: SlotLayout, arena: PinnedArena, tmp_path: Path) -> None:
    stacks = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.bfloat16, device=torch.device("cpu"), fused=True)
    loader = DeviceLoader(
        ThreadLoader(torch.bfloat16, stacks.layout), torch.bfloat16, layout, torch.device("cpu"), arena, readers=2
    )
    pool = AdapterPool(TINY, stacks, torch.bfloat16, host_capacity=4, loader=loader, arena=arena)
    try:
        v1 = pool.register("a", write_adapter(tmp_path / "v1", rank=4, modules=ALL7, seed=1))
        pool.wait_loaded(v1, 30)
        assert v1.state is AdapterState.HOST and pool.acquire(v1) is not None
        v2 = pool.register("a", write_adapter(tmp_path / "v2", rank=8, modules=ALL7, seed=2))
        pool.wait_loaded(v2, 30)
        assert pool.lookup("a") is v2 and v2.weights is not None
        _same(v2.weights, _thread_load(v2.spec, layout))
        pool.release(v1, tokens=1)
        assert v1.weights is None  # retired and idle: dropped, its extent back in the arena
    finally:
        pool.close()


@pytest.fixture
def device_pool(arena: PinnedArena) -> Iterator[tuple[AdapterPool, DeviceLoader, LoRAStacks]]:
    stacks = LoRAStacks(TINY, slots=3, max_rank=8, dtype=torch.bfloat16, device=torch.device("cpu"), fused=True)
    assert stacks.layout is not None
    loader = DeviceLoader(
        ThreadLoader(torch.bfloat16, stacks.layout), torch.bfloat16, stacks.layout, torch.device("cpu"), arena
    )
    pool = AdapterPool(TINY, stacks, torch.bfloat16, host_capacity=4, loader=loader, arena=arena)
    yield pool, loader, stacks
    pool.close()


def _slot_weights(stacks: LoRAStacks, slot: int) -> list[torch.Tensor]:
    return [t[:, slot] for table in (stacks._group_a_all, stacks._group_b_all) for t in table.values()]


def test_a_load_nobody_waits_for_keeps_no_device_image(
    device_pool: tuple[AdapterPool, DeviceLoader, LoRAStacks], tmp_path: Path
) -> None:
    pool, _, _ = device_pool
    version = pool.register("a", write_adapter(tmp_path / "a", rank=4, modules=ALL7))
    pool.wait_loaded(version, 30)
    assert version.weights is not None and version.weights.packed is not None
    assert version.weights.device_packed is None


def test_a_waited_for_load_is_filled_from_its_device_image_once(
    device_pool: tuple[AdapterPool, DeviceLoader, LoRAStacks], tmp_path: Path
) -> None:
    pool, loader, stacks = device_pool
    gate = threading.Event()
    loader._loads.submit(gate.wait)  # the load below queues behind it
    version = pool.register("a", write_adapter(tmp_path / "a", rank=4, modules=ALL7, seed=4))
    assert not pool.ready(version)  # a request waits for it
    gate.set()
    pool.wait_loaded(version, 30)
    weights = version.weights
    assert weights is not None and weights.device_packed is not None
    slot = pool.acquire(version)
    assert slot is not None
    assert version.weights is not None and version.weights.device_packed is None  # later fills read the host
    # The fill from the device image put in the slot what a fill from the host image puts.
    stacks.set_lora(2, dataclasses.replace(weights, device_packed=None))
    for got, want in zip(_slot_weights(stacks, slot), _slot_weights(stacks, 2), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_request_that_stops_waiting_lets_the_device_image_go(
    device_pool: tuple[AdapterPool, DeviceLoader, LoRAStacks], tmp_path: Path
) -> None:
    pool, loader, _ = device_pool
    gate = threading.Event()
    loader._loads.submit(gate.wait)
    version = pool.register("a", write_adapter(tmp_path / "a", rank=4))
    pool.ready(version)
    gate.set()
    pool.wait_loaded(version, 30)
    assert version.weights is not None and version.weights.device_packed is not None
    pool.unwanted(version)
    assert version.weights is not None and version.weights.device_packed is None


def test_a_hot_swap_keeps_the_device_image_for_the_fill_ahead_of_its_first_request(
    device_pool: tuple[AdapterPool, DeviceLoader, LoRAStacks], tmp_path: Path
) -> None:
    pool, _, _ = device_pool
    old = pool.register("a", write_adapter(tmp_path / "v1", rank=4, modules=ALL7, seed=1))
    pool.wait_loaded(old, 30)
    assert pool.acquire(old) is not None
    pool.release(old, tokens=1)
    new = pool.register("a", write_adapter(tmp_path / "v2", rank=4, modules=ALL7, seed=2))
    pool.wait_loaded(new, 30)
    assert pool.lookup("a") is new
    assert new.weights is not None and new.weights.device_packed is not None
    assert pool.fill_ahead([], most=2) == 1 and new.slot is not None
    assert new.weights is not None and new.weights.device_packed is None


def test_without_keep_device_image_no_load_returns_one(
    device_pool: tuple[AdapterPool, DeviceLoader, LoRAStacks], tmp_path: Path
) -> None:
    _, loader, _ = device_pool
    spec = read_spec(write_adapter(tmp_path / "a", rank=4), TINY, 8)
    assert loader.submit(spec).result(30).device_packed is not None
    loader.keep_device_image = False
    assert loader.submit(spec).result(30).device_packed is None


def test_a_hot_swap_not_filled_in_its_pass_lets_the_device_image_go(
    device_pool: tuple[AdapterPool, DeviceLoader, LoRAStacks], tmp_path: Path
) -> None:
    pool, _, _ = device_pool
    old = pool.register("a", write_adapter(tmp_path / "v1", rank=4, seed=1))
    busy = [pool.register(n, write_adapter(tmp_path / n, rank=4, seed=i)) for i, n in enumerate("bc")]
    for version in (old, *busy):
        pool.wait_loaded(version, 30)
        assert pool.acquire(version) is not None  # every slot taken, and kept busy
    pool.release(old, tokens=1)
    new = pool.register("a", write_adapter(tmp_path / "v2", rank=4, seed=2))
    pool.wait_loaded(new, 30)
    assert new.weights is not None and new.weights.device_packed is not None
    # Its predecessor is dropped at the switch (idle), so the pass finds its slot free: fill another name's into
    # it first, then pass with no slot left.
    filler = pool.register("d", write_adapter(tmp_path / "d", rank=4, seed=3))
    pool.wait_loaded(filler, 30)
    assert pool.acquire(filler) is not None
    assert pool.fill_ahead([], most=2) == 0 and new.slot is None
    assert new.weights is not None and new.weights.device_packed is None


def test_files_laid_out_alike_reuse_one_plan_and_each_gets_its_own_values(
    loader: DeviceLoader, layout: SlotLayout, tmp_path: Path
) -> None:
    """The versions of one adapter (and adapters written alike) share the loader's device buffers and copies:
    each load must still give its own file's image, and another layout must get buffers of its own."""
    specs = [read_spec(write_adapter(tmp_path / f"v{i}", rank=4, modules=ALL7, seed=i), TINY, 8) for i in range(2)]
    first = loader.submit(specs[0]).result(30)
    plan = loader._plan
    second = loader.submit(specs[1]).result(30)
    assert plan is not None and loader._plan is not None and loader._plan.raw is plan.raw
    _same(first, _thread_load(specs[0], layout))
    _same(second, _thread_load(specs[1], layout))
    other = read_spec(write_adapter(tmp_path / "q", rank=2, modules=("q_proj",), seed=7), TINY, 8)
    _same(loader.submit(other).result(30), _thread_load(other, layout))
    assert loader._plan is not None and loader._plan.raw is not plan.raw
    # The device image handed out is the load's own: the next load does not overwrite it.
    assert first.device_packed is not None and second.device_packed is not None
    torch.testing.assert_close(first.device_packed, first.packed, rtol=0, atol=0)


def test_loads_cancelled_at_random_leave_no_extent_taken(
    loader: DeviceLoader, arena: PinnedArena, tmp_path: Path
) -> None:
    """Loads of two layouts submitted together and cancelled at random points: every extent goes back, whether
    a cancel came before its load started, while it ran or after it ended."""
    rng = random.Random(5)
    specs = [
        read_spec(write_adapter(tmp_path / f"a{i}", rank=4, modules=ALL7 if i % 2 else ("q_proj",), seed=i), TINY, 8)
        for i in range(6)
    ]
    free = arena.free_pages
    for _ in range(3):
        futures = [loader.submit(rng.choice(specs)) for _ in range(12)]
        for future in futures:
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.002)
                future.cancel()
        for future in futures:
            if not future.cancelled():
                image = future.result(30).packed
                assert image is not None and arena.give_back(image)
        loader._loads.submit(lambda: None).result(30)  # every load has ended (they run one at a time)
        assert arena.free_pages == free


def test_a_fallback_that_cannot_take_the_load_fails_it(loader: DeviceLoader, tmp_path: Path) -> None:
    """The fallback's submit runs in a callback: raised there, it left the load pending for good, and the pool's
    requests for the adapter waiting with it (review of stop 35)."""
    folder = write_adapter(tmp_path / "a", rank=4, modules=ALL7)
    _misaligned(folder)
    spec = read_spec(folder, TINY, 8)

    def refuse(_: AdapterSpec) -> Future[AdapterWeights]:
        raise RuntimeError("no loader process could start")

    loader._fallback.submit = refuse  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="no loader process could start"):
        loader.submit(spec).result(30)


def test_a_fallback_load_cancelled_as_it_ends_gives_its_extent_back(
    loader: DeviceLoader, arena: PinnedArena, tmp_path: Path
) -> None:
    """A cancel that comes once the fallback's future runs cannot stop it: its image must go back to the arena
    (review of stop 35: it was dropped with its extent still taken)."""
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=ALL7), TINY, 8)
    free = arena.free_pages
    source: Future[AdapterWeights] = Future()
    outer: Future[AdapterWeights] = Future()
    loader._chain(source, outer)
    assert source.set_running_or_notify_cancel()  # the fallback's worker has it
    assert outer.cancel()
    image = arena.take(1000, torch.bfloat16)
    assert image is not None
    source.set_result(AdapterWeights(spec.rank, spec.scaling, spec.modules, {}, image, ("qkv",)))
    assert arena.free_pages == free


def test_a_failure_after_the_host_image_was_taken_gives_it_back(
    loader: DeviceLoader, arena: PinnedArena, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of memory in the copy back to the host (or in the device image's clone) lost the extent for good
    (review of stop 35)."""
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=ALL7), TINY, 8)
    loader.submit(spec).result(30)  # the plan exists: the next load only copies
    free = arena.free_pages
    real_copy = torch.Tensor.copy_

    def failing_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if arena.holds(self):
            raise RuntimeError("out of memory")
        return real_copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", failing_copy)
    with pytest.raises(RuntimeError, match="out of memory"):
        loader.submit(spec).result(30)
    monkeypatch.undo()
    loader._loads.submit(lambda: None).result(30)
    assert arena.free_pages == free


def test_close_waits_for_a_load_in_flight(layout: SlotLayout, arena: PinnedArena, tmp_path: Path) -> None:
    """The engine closes the arena right after the loader: a load still running could queue a copy into it."""
    loader = DeviceLoader(ThreadLoader(torch.bfloat16, layout), torch.bfloat16, layout, torch.device("cpu"), arena)
    gate = threading.Event()
    started = threading.Event()
    loader._loads.submit(lambda: (started.set(), gate.wait(5)))
    started.wait(5)
    closer = threading.Thread(target=loader.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waits for the task in flight
    gate.set()
    closer.join(5)
    assert not closer.is_alive()


def test_gpu_bytes_is_what_a_load_at_the_largest_rank_takes(
    loader: DeviceLoader, layout: SlotLayout, tmp_path: Path
) -> None:
    """The KV cache leaves `gpu_bytes` free for the loader (`kv_cache.kv_slots`): fp32 files of every
    projection at the stacks' largest rank fill it exactly, the plan's buffers and the most device images."""
    spec = read_spec(write_adapter(tmp_path / "a", rank=layout.max_rank, modules=ALL7), TINY, layout.max_rank)
    got = [loader.submit(spec).result(30) for _ in range(adapter_device_loader.MAX_DEVICE_IMAGES + 1)]
    assert loader._plan is not None
    images = [w.device_packed.nbytes for w in got if w.device_packed is not None]
    assert len(images) == adapter_device_loader.MAX_DEVICE_IMAGES
    taken = loader._plan.raw.nbytes + loader._plan.image.nbytes + sum(images)
    assert adapter_device_loader.gpu_bytes(layout, torch.bfloat16) == taken


def test_no_more_device_images_are_alive_than_the_kv_cache_left_room_for(loader: DeviceLoader, tmp_path: Path) -> None:
    """However many loads hold theirs (loads started ahead of hot swaps' checks, which the pool does not count),
    a load past `MAX_DEVICE_IMAGES` alive returns none; one freed makes room for the next."""
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=ALL7), TINY, 8)
    held = [loader.submit(spec).result(30) for _ in range(adapter_device_loader.MAX_DEVICE_IMAGES)]
    assert all(w.device_packed is not None for w in held)
    assert loader.submit(spec).result(30).device_packed is None
    held[0] = dataclasses.replace(held[0], device_packed=None)  # (as the pool lets one go)
    gc.collect()
    assert loader.submit(spec).result(30).device_packed is not None


def test_a_result_let_go_frees_its_device_image_without_the_cyclic_collector(
    loader: DeviceLoader, tmp_path: Path
) -> None:
    """A load's two futures referred to each other (each cancels the other), so a result the pool let go of,
    device image included, stayed in GPU memory until a garbage collection, and took one of the loader's
    `MAX_DEVICE_IMAGES` places meanwhile: a hot swap's new version then got none."""
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=ALL7), TINY, 8)
    gc.disable()
    try:
        got = loader.submit(spec).result(30)
        assert got.device_packed is not None
        image = weakref.ref(got.device_packed)
        del got
        deadline = time.monotonic() + 5  # (the load's thread may hold its task a moment after the result is set)
        while image() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert image() is None
    finally:
        gc.enable()


def test_a_plan_made_anew_finds_the_last_ones_buffers_let_go(
    loader: DeviceLoader, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Else a load of another layout holds two plans' buffers at once, more than `gpu_bytes` leaves room for."""
    loader.submit(read_spec(write_adapter(tmp_path / "a", rank=4, modules=ALL7), TINY, 8)).result(30)
    assert loader._plan is not None
    last_raw = weakref.ref(loader._plan.raw)
    alive_as_new_ones_are_made: list[bool] = []
    layer_of = adapter_device_loader.layer_of

    def watched(*args: object) -> int:
        gc.collect()
        alive_as_new_ones_are_made.append(last_raw() is not None)
        return layer_of(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(adapter_device_loader, "layer_of", watched)
    loader.submit(read_spec(write_adapter(tmp_path / "b", rank=8, modules=ALL7), TINY, 8)).result(30)
    assert alive_as_new_ones_are_made and not any(alive_as_new_ones_are_made)


def test_a_loader_dropped_without_close_is_collected(layout: SlotLayout, tmp_path: Path) -> None:
    """Its reading threads do not keep it alive (an engine whose start fails after `make_loader` never closes
    it): their initializer once was a bound method of the loader, which each thread holds for its life."""
    loader = DeviceLoader(
        ThreadLoader(torch.bfloat16, layout), torch.bfloat16, layout, torch.device("cpu"), None, readers=2
    )
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=ALL7), TINY, 8)
    loader.submit(spec).result(30)  # (its reading threads started)
    dropped = weakref.ref(loader)
    del loader
    deadline = time.monotonic() + 5  # (a pool thread may hold its last task a moment after the result is set)
    while dropped() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert dropped() is None


def test_no_more_than_a_few_waited_for_loads_keep_their_device_images(
    device_pool: tuple[AdapterPool, DeviceLoader, LoRAStacks], tmp_path: Path
) -> None:
    """Every queued request marks its adapter wanted: a deep queue of cold adapters kept one device image each,
    GPU memory the KV cache was sized without (review of stop 35)."""
    pool, loader, _ = device_pool
    gate = threading.Event()
    loader._loads.submit(gate.wait)
    versions = [pool.register(f"a{i}", write_adapter(tmp_path / f"a{i}", rank=4, seed=i)) for i in range(4)]
    for version in versions:
        pool.ready(version)  # a request waits for each
    gate.set()
    for version in versions:
        pool.wait_loaded(version, 30)
    kept = [v for v in versions if v.weights is not None and v.weights.device_packed is not None]
    assert len(kept) == DEVICE_IMAGES_KEPT
    assert pool.acquire(kept[0]) is not None  # its fill lets its image go: the next load may keep one
    gate2 = threading.Event()
    loader._loads.submit(gate2.wait)
    later = pool.register("b", write_adapter(tmp_path / "b", rank=4, seed=9))
    pool.ready(later)
    gate2.set()
    pool.wait_loaded(later, 30)
    assert later.weights is not None and later.weights.device_packed is not None


def _count_parses(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The folders whose headers the device loader parses from now on."""
    parsed: list[Path] = []

    def counting(folder: Path, handle: BinaryIO) -> list[StoredTensor]:
        parsed.append(folder)
        return stored_tensors(folder, handle)

    monkeypatch.setattr(adapter_device_loader, "stored_tensors", counting)
    return parsed


def test_a_file_with_the_last_loads_header_skips_the_parse_and_gets_its_own_values(
    loader: DeviceLoader, layout: SlotLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The versions of one adapter have equal headers: their loads reuse the plan without parsing it (1.7-2.4
    ms of Python on an H100 host), and each still reads its own values."""
    specs = [read_spec(write_adapter(tmp_path / f"v{i}", rank=4, modules=ALL7, seed=i), TINY, 8) for i in range(3)]
    loader.submit(specs[0]).result(30)
    parsed = _count_parses(monkeypatch)
    for spec in specs[1:]:
        _same(loader.submit(spec).result(30), _thread_load(spec, layout))
    assert parsed == []
    other = read_spec(write_adapter(tmp_path / "q", rank=2, modules=("q_proj",), seed=7), TINY, 8)
    _same(loader.submit(other).result(30), _thread_load(other, layout))
    assert parsed == [other.path]


def test_a_file_rewritten_to_the_last_loads_layout_since_its_check_fails(
    loader: DeviceLoader, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header alone does not say the file is still the one registered: a file registered at rank 2 and
    rewritten at the rank and layout of the last load must fail as it would have without that load."""
    loader.submit(read_spec(write_adapter(tmp_path / "last", rank=4, modules=ALL7), TINY, 8)).result(30)
    spec = read_spec(write_adapter(tmp_path / "a", rank=2, modules=ALL7), TINY, 8)
    write_adapter(tmp_path / "a", rank=4, modules=ALL7, seed=3)
    with pytest.raises(AdapterError, match="changed since it was registered"):
        loader.submit(spec).result(30)


def test_a_file_truncated_after_a_load_of_its_layout_fails_with_an_adapter_error(
    loader: DeviceLoader, tmp_path: Path
) -> None:
    folder = write_adapter(tmp_path / "a", rank=4, modules=ALL7)
    spec = read_spec(folder, TINY, 8)
    loader.submit(spec).result(30)
    path = folder / WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:-100])  # the header as before, the file shorter
    with pytest.raises(AdapterError, match=WEIGHTS_FILE):
        loader.submit(spec).result(30)


@pytest.mark.parametrize("header", [b"", b"\x05\x00", struct.pack("<Q", 1 << 40), struct.pack("<Q", 64) + b"{}"])
def test_a_header_cut_short_or_too_long_is_none(header: bytes, tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(header)
    with path.open("rb") as handle:
        assert stored_header(handle.fileno()) is None


def test_the_header_read_is_the_stored_length_and_json(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", rank=4)
    data = (folder / WEIGHTS_FILE).read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    with (folder / WEIGHTS_FILE).open("rb") as handle:
        assert stored_header(handle.fileno()) == data[: 8 + length]


def _stored_as(folder: Path, dtype: torch.dtype, metadata_pad: int = 0) -> bytes:
    tensors = {k: v.to(dtype) for k, v in load_file(str(folder / WEIGHTS_FILE)).items()}
    return save(tensors, metadata={"pad": "x" * metadata_pad} if metadata_pad else None)


def _fp16_and_bf16_files_of_one_size(folder: Path) -> tuple[bytes, bytes]:
    """`folder`'s adapter stored in float16 and in bfloat16, the float16 file's header padded to the same size."""
    bf16 = _stored_as(folder, torch.bfloat16)
    for pad in range(1, 200):
        if len(fp16 := _stored_as(folder, torch.float16, pad)) == len(bf16):
            return fp16, bf16
    raise AssertionError("no padding gives the two files one size")


def _rewrite_in_place(folder: Path, data: bytes) -> None:
    with (folder / WEIGHTS_FILE).open("r+b") as f:  # the same inode, as writers that open with "wb" keep it
        f.write(data)
        f.truncate()


def test_a_file_rewritten_in_place_as_its_header_is_parsed_leaves_no_plan_for_that_header(
    loader: DeviceLoader, layout: SlotLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header is read from the open file, the parse opens it again by its path. A float16 file rewritten in
    between as bfloat16 of the same size, rank and projections was parsed as bfloat16, and the plan was tagged
    with the float16 header: the next float16 file written alike was then read as bfloat16, every value wrong
    and finite (review of stop 36)."""
    a = write_adapter(tmp_path / "a", rank=4, modules=ALL7, seed=1)
    fp16, bf16 = _fp16_and_bf16_files_of_one_size(a)
    _rewrite_in_place(a, fp16)
    spec_a = read_spec(a, TINY, 8)
    rewritten: list[Path] = []

    def rewrite_then_parse(folder: Path, handle: BinaryIO) -> list[StoredTensor]:
        if not rewritten:
            rewritten.append(folder)
            _rewrite_in_place(folder, bf16)
        return stored_tensors(folder, handle)

    monkeypatch.setattr(adapter_device_loader, "stored_tensors", rewrite_then_parse)
    loader.submit(spec_a).result(30)
    assert rewritten == [a]
    b = write_adapter(tmp_path / "b", rank=4, modules=ALL7, seed=2)
    _rewrite_in_place(b, _fp16_and_bf16_files_of_one_size(b)[0])
    spec_b = read_spec(b, TINY, 8)
    _same(loader.submit(spec_b).result(30), _thread_load(spec_b, layout))


def test_a_header_that_cannot_be_read_fails_with_an_adapter_error(
    loader: DeviceLoader, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreadable(fd: int) -> bytes | None:
        raise OSError(5, "Input/output error")

    spec = read_spec(write_adapter(tmp_path / "a", rank=4), TINY, 8)
    monkeypatch.setattr(adapter_device_loader, "stored_header", unreadable)
    with pytest.raises(AdapterError, match="Input/output error"):
        loader.submit(spec).result(30)
