"""The pinned arena's bookkeeping (ordinary memory here: no GPU), and the pool giving images back to it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine.adapter_loader import ThreadLoader
from engine.lora import LoRAStacks
from engine.pinned_arena import PinnedArena
from engine.pool import AdapterPool
from tests.unit.engine.tiny import TINY, write_adapter

PAGE = 1024


def test_extents_are_disjoint_typed_views_and_full_means_none() -> None:
    arena = PinnedArena(4 * PAGE, pin=False, page_bytes=PAGE)
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


def test_given_back_extents_merge_so_a_large_image_fits_again() -> None:
    arena = PinnedArena(6 * PAGE, pin=False, page_bytes=PAGE)
    first, middle, last = (arena.take(2 * PAGE, torch.uint8) for _ in range(3))
    assert first is not None and middle is not None and last is not None
    assert arena.take(1, torch.uint8) is None
    for extent in (first, last, middle):  # the middle one last: it must join both neighbours
        assert arena.give_back(extent)
    assert arena.free_pages == 6
    whole = arena.take(6 * PAGE, torch.uint8)
    assert whole is not None and whole.numel() == 6 * PAGE


@pytest.fixture
def arena_pool():  # type: ignore[no-untyped-def]
    stacks = LoRAStacks(TINY, slots=1, max_rank=8, dtype=torch.float32, device=torch.device("cpu"), fused=True)
    arena = PinnedArena(64 * PAGE, pin=False, page_bytes=PAGE)
    loader = ThreadLoader(torch.float32, stacks.layout, arena=arena)
    pool = AdapterPool(TINY, stacks, torch.float32, host_capacity=1, loader=loader, arena=arena)
    yield pool, arena
    pool.close()


def test_the_pool_loads_into_the_arena_and_gives_images_back_when_it_drops_them(arena_pool, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pool, arena = arena_pool
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
    arena_pool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    """Its weights used to stay in host memory for good: nobody could use or free them."""
    from engine import adapter_loader as loader_module

    pool, arena = arena_pool
    empty = arena.free_pages
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
    version.settled.wait(10)
    assert version.retired and version.weights is None
    assert arena.free_pages == empty
