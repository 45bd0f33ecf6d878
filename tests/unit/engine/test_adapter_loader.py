"""Adapter loaders: worker processes give exactly what the in-process threads give, errors included."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.adapter_loader import ProcessLoader, ThreadLoader
from engine.adapters import AdapterError, read_spec
from engine.lora import AdapterWeights, LoRAStacks
from engine.pool import AdapterPool
from tests.unit.engine.test_pool import _poison
from tests.unit.engine.tiny import TINY, write_adapter

ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def fused_layout():  # type: ignore[no-untyped-def]
    stacks = LoRAStacks(TINY, slots=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"), fused=True)
    return stacks.layout


@pytest.fixture(scope="module")
def process_loaders(fused_layout) -> Iterator[dict[str, ProcessLoader]]:  # type: ignore[no-untyped-def]
    # Spawned workers import torch once each: share them across this module's tests.
    loaders = {
        "loose": ProcessLoader(torch.float32, None, workers=1),
        "packed": ProcessLoader(torch.float32, fused_layout, workers=1),
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


@pytest.mark.parametrize("kind", ["loose", "packed"])
def test_process_loader_returns_what_the_thread_loader_returns(
    kind: str,
    fused_layout,
    process_loaders: dict[str, ProcessLoader],
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    spec = read_spec(write_adapter(tmp_path / "a", rank=4, modules=ALL7, seed=3), TINY, 8)
    threads = ThreadLoader(torch.float32, fused_layout if kind == "packed" else None)
    try:
        want = threads.submit(spec).result(30)
    finally:
        threads.close()
    got = process_loaders[kind].submit(spec).result(60)
    assert (got.packed is not None) == (kind == "packed")
    _same(got, want)


def test_process_loader_reports_a_broken_adapter(process_loaders: dict[str, ProcessLoader], tmp_path: Path) -> None:
    spec = read_spec(_poison(write_adapter(tmp_path / "a"), float("nan")), TINY, 8)
    error = process_loaders["loose"].submit(spec).exception(60)
    assert isinstance(error, AdapterError) and "NaN or infinite" in str(error)


def test_a_cancelled_process_load_stays_cancelled(process_loaders: dict[str, ProcessLoader], tmp_path: Path) -> None:
    spec = read_spec(write_adapter(tmp_path / "a"), TINY, 8)
    future = process_loaders["packed"].submit(spec)
    assert future.cancel() and future.cancelled()
    process_loaders["packed"].submit(spec).result(60)  # the worker is still usable afterwards


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
