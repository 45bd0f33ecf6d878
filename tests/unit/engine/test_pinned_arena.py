"""The pinned arena's bookkeeping (ordinary memory here: no GPU), and the pool giving images back to it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engine.adapters import AdapterSpec, load_layers_into, read_spec
from engine.config import ModelArch
from engine.lora import AdapterWeights, LoRAStacks, SlotLayout, image_groups
from engine.pinned_arena import PinnedArena
from engine.pool import AdapterPool
from tests.unit.engine.tiny import TINY, write_adapter

PAGE = 1024


@pytest.fixture
def make_arena() -> Iterator[Callable[[int], PinnedArena]]:
    """Arenas of a number of pages (pageable here), whose segments are removed after the test."""
    arenas: list[PinnedArena] = []

    def make(pages: int) -> PinnedArena:
        arenas.append(PinnedArena(pages * PAGE, pin=False, page_bytes=PAGE))
        return arenas[-1]

    yield make
    for arena in arenas:
        arena.close()


def test_extents_are_disjoint_typed_views_and_full_means_none(make_arena: Callable[[int], PinnedArena]) -> None:
    arena = make_arena(4)
    a = arena.take(100, torch.float32)  # 400 bytes: one page
    b = arena.take(600, torch.bfloat16)  # 1200 bytes: two pages
    assert a is not None and b is not None
    assert (a.dtype, a.numel(), b.dtype, b.numel()) == (torch.float32, 100, torch.bfloat16, 600)
    a.fill_(1.0)
    b.fill_(2.0)
    assert bool((a == 1.0).all()) and bool((b == 2.0).all())  # no overlap
    assert arena.free_pages == 1
    assert arena.take(2 * PAGE, torch.uint8) is None  # no room: the caller falls back
    assert arena.give_back(torch.empty(4)) is False  # not handed out by this arena


def test_given_back_extents_merge_so_a_large_image_fits_again(make_arena: Callable[[int], PinnedArena]) -> None:
    arena = make_arena(6)
    first, middle, last = (arena.take(2 * PAGE, torch.uint8) for _ in range(3))
    assert first is not None and middle is not None and last is not None
    assert arena.take(1, torch.uint8) is None
    for extent in (first, last, middle):  # the middle one last: it must join both neighbours
        assert arena.give_back(extent)
    assert arena.free_pages == 6
    whole = arena.take(6 * PAGE, torch.uint8)
    assert whole is not None and whole.numel() == 6 * PAGE


class _ArenaLoader:
    """Loads on a thread into `arena` the way loader processes fill a shared one (a `gate` holds loads)."""

    def __init__(self, layout: SlotLayout, arena: PinnedArena) -> None:
        self.layout, self.arena = layout, arena
        self.gate: threading.Event | None = None
        self.started = threading.Event()
        self._executor = ThreadPoolExecutor(max_workers=1)

    def check(self, path: Path, arch: ModelArch, max_rank: int) -> AdapterSpec:
        return read_spec(path, arch, max_rank)

    def submit(self, spec: AdapterSpec) -> Future[AdapterWeights]:
        return self._executor.submit(self._load, spec)

    def _load(self, spec: AdapterSpec) -> AdapterWeights:
        self.started.set()
        if self.gate is not None:
            self.gate.wait(10)
        groups = image_groups(spec.modules)
        image = self.arena.take(self.layout.image_size(groups, spec.rank), torch.float32)
        assert image is not None
        load_layers_into(spec, torch.float32, self.layout, image, range(self.layout.num_layers))
        return AdapterWeights(spec.rank, spec.scaling, spec.modules, {}, image, groups)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


@pytest.fixture
def arena_pool() -> Iterator[tuple[AdapterPool, PinnedArena, _ArenaLoader]]:
    stacks = LoRAStacks(TINY, slots=1, max_rank=8, dtype=torch.float32, device=torch.device("cpu"), fused=True)
    arena = PinnedArena(64 * PAGE, pin=False, page_bytes=PAGE)
    assert stacks.layout is not None
    loader = _ArenaLoader(stacks.layout, arena)
    pool = AdapterPool(TINY, stacks, torch.float32, host_capacity=1, loader=loader, arena=arena)
    yield pool, arena, loader
    pool.close()
    arena.close()


def test_the_pool_loads_into_the_arena_and_gives_images_back_when_it_drops_them(
    arena_pool: tuple[AdapterPool, PinnedArena, _ArenaLoader], tmp_path: Path
) -> None:
    pool, arena, _ = arena_pool
    empty = arena.free_pages
    a = pool.register("a", write_adapter(tmp_path / "a", seed=1))
    pool.wait_loaded(a, timeout=10)
    assert a.weights is not None and a.weights.packed is not None
    held = arena.free_pages
    assert held < empty  # the image lives in the arena
    b = pool.register("b", write_adapter(tmp_path / "b", seed=2))
    pool.wait_loaded(b, timeout=10)
    assert a.weights is None  # host capacity 1: a was dropped from host memory...
    assert arena.free_pages == held  # ...and its extent reused by b's image
    assert pool.unregister("b")
    assert arena.free_pages == empty


def test_a_version_unloaded_while_it_loads_is_dropped_when_the_load_ends(
    arena_pool: tuple[AdapterPool, PinnedArena, _ArenaLoader], tmp_path: Path
) -> None:
    """Its weights used to stay in host memory for good: nobody could use or free them."""
    pool, arena, loader = arena_pool
    empty = arena.free_pages
    loader.gate = threading.Event()
    version = pool.register("a", write_adapter(tmp_path / "a", seed=1))
    assert loader.started.wait(10)  # the load is running: it cannot be cancelled
    assert pool.unregister("a")
    loader.gate.set()
    assert version.settled.wait(10)
    assert version.retired and version.weights is None
    assert arena.free_pages == empty


def test_a_shared_arena_is_one_segment_that_attached_views_write_into() -> None:
    from engine.pinned_arena import attach

    arena = PinnedArena(4 * PAGE, pin=False, page_bytes=PAGE)
    assert Path("/dev/shm", arena.name).exists()
    extent = arena.take(300, torch.float32)
    assert extent is not None
    view = attach(arena.name, arena.offset(extent), 300, torch.float32)  # what a loader process does
    view.copy_(torch.arange(300, dtype=torch.float32))
    assert torch.equal(extent, torch.arange(300, dtype=torch.float32))
    name = arena.name
    arena.close()
    assert not Path("/dev/shm", name).exists()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the mapping's resident size from /proc")
def test_a_loader_process_maps_the_whole_arena_with_its_pages_in_place() -> None:
    """`map_arena` fills the mapping's page tables as it maps (MAP_POPULATE): a load writing into an extent the
    process never touched then takes no page faults (a 2-layer Llama-7B part packed 2-6x slower without)."""
    import ctypes

    from engine.pinned_arena import map_arena

    arena = PinnedArena(8 * PAGE, pin=False, page_bytes=PAGE)
    try:
        arena._buffer.fill_(1)  # the segment's pages exist, as a pinned arena's do
        mapped = map_arena(arena.name)
        assert map_arena(arena.name) is mapped  # once per process
        start = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        assert resident_kib(start) * 1024 == len(mapped) == 8 * PAGE
    finally:
        arena.close()


def resident_kib(start: int) -> int:
    """The Rss of this process's mapping that starts at `start`, from /proc/self/smaps."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{start:x}":
            return next(int(x.split()[1]) for x in lines[i + 1 :] if x.startswith("Rss:"))
    raise AssertionError(f"no mapping at {start:x}")


def test_fits_answers_what_take_would_find_and_holds_only_extents_out(make_arena: Callable[[int], PinnedArena]) -> None:
    arena = make_arena(4)
    first = arena.take(2 * PAGE // 4, torch.float32)  # 2 pages
    assert first is not None and arena.holds(first)
    assert arena.fits(2 * PAGE // 4, torch.float32) and not arena.fits(3 * PAGE // 4, torch.float32)
    assert not arena.holds(torch.zeros(4))
    arena.give_back(first)
    assert not arena.holds(first)
    assert arena.fits(4 * PAGE // 4, torch.float32)  # given back and merged with its free neighbour
    assert arena.take(4 * PAGE // 4, torch.float32) is not None


class _CopyInFlight:
    """Stands in for a CUDA event of a copy into an extent (the device loader's copy back): not passed until
    `done`, and `synchronize` waits for it."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def test_an_extent_given_back_with_a_copy_into_it_in_flight_is_reused_only_after_it(
    make_arena: Callable[[int], PinnedArena],
) -> None:
    arena = make_arena(2)
    image = arena.take(2 * PAGE, torch.uint8)
    assert image is not None
    written = _CopyInFlight()
    assert arena.give_back(image, written=written)  # type: ignore[arg-type]
    assert arena.free_pages == 0 and arena.take(1, torch.uint8) is None  # the copy may still write it
    written.done = True
    assert arena.free_pages == 2


def test_fits_waits_for_a_copy_into_an_extent_given_back(make_arena: Callable[[int], PinnedArena]) -> None:
    arena = make_arena(2)
    image = arena.take(2 * PAGE, torch.uint8)
    assert image is not None
    written = _CopyInFlight()
    arena.give_back(image, written=written)  # type: ignore[arg-type]
    assert arena.fits(2 * PAGE, torch.uint8) and written.waited
