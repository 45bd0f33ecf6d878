"""Where adapter files are read and prepared: threads of the engine process, or worker processes.

Reading an adapter (safetensors parse, dtype conversion, packing into the slot layout) holds the GIL for
milliseconds at a time. On a thread of the engine process that stalls the step loop, which is bound by
Python on a GPU (bench/RESULTS-gpu.md). `ProcessLoader` does the work in spawned worker processes. With a shared
arena (`PinnedArena`, page-locked shared memory) a worker writes the slot image straight into
an extent the engine handed it, and only a few numbers come back. Without one (or when it is full), the
result comes back through torch's shared memory and the engine process copies it out, into pinned memory
when a GPU will read it.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from engine.adapters import AdapterSpec, host_copy, load_adapter
from engine.lora import AdapterWeights, SlotLayout, image_groups
from engine.pinned_arena import GivenExtent, PinnedArena, attach

log = logging.getLogger("engine.adapter_loader")
T = TypeVar("T")


class AdapterLoader(Protocol):
    """Reads adapters off the caller's thread; the future holds host weights or an AdapterError."""

    def submit(self, spec: AdapterSpec) -> Future[AdapterWeights]: ...

    def close(self) -> None: ...


def read_adapter(spec: AdapterSpec, dtype: torch.dtype, layout: SlotLayout | None, pin: bool) -> AdapterWeights:
    """Disk -> host memory; for fused stacks (`layout`) straight into the slot layout."""
    return load_adapter(spec, dtype, pin=pin, layout=layout)


class ThreadLoader:
    """Loads on threads of the engine process."""

    def __init__(self, dtype: torch.dtype, layout: SlotLayout | None, workers: int = 2) -> None:
        self._dtype, self._layout = dtype, layout
        self._pin = torch.cuda.is_available()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="adapter-load")

    def submit(self, spec: AdapterSpec) -> Future[AdapterWeights]:
        return self._executor.submit(read_adapter, spec, self._dtype, self._layout, self._pin)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _worker_init() -> None:
    torch.set_num_threads(1)  # one adapter per worker; leave the cores to the engine


class ProcessLoader:
    """Loads in spawned worker processes (started on first use; each imports torch once)."""

    def __init__(
        self, dtype: torch.dtype, layout: SlotLayout | None, workers: int = 2, arena: PinnedArena | None = None
    ) -> None:
        self._dtype, self._layout, self._arena = dtype, layout, arena
        self._pin = torch.cuda.is_available()
        self._workers = workers
        self._executor = self._start_workers()

    def _start_workers(self) -> ProcessPoolExecutor:
        # spawn, not fork: the engine process may hold CUDA state and threads a forked child cannot use.
        context = multiprocessing.get_context("spawn")
        return ProcessPoolExecutor(max_workers=self._workers, mp_context=context, initializer=_worker_init)

    def _run(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """`fn(*args)` in a worker. A worker that died (killed, out of memory) breaks the whole pool: its
        loads in flight fail with BrokenProcessPool, and the next load starts new workers."""
        try:
            return self._executor.submit(fn, *args)
        except BrokenProcessPool:
            log.warning("adapter loader processes died: starting new ones")
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = self._start_workers()
            return self._executor.submit(fn, *args)

    def submit(self, spec: AdapterSpec) -> Future[AdapterWeights]:
        outer: Future[AdapterWeights] = Future()
        extent = self._extent_for(spec)
        if extent is not None:
            assert self._arena is not None and self._layout is not None
            args = (spec, self._dtype, self._layout, self._arena.name, self._arena.offset(extent))
            try:
                into = self._run(read_into_arena, *args)
            except Exception:
                self._arena.give_back(extent)
                raise
            outer.add_done_callback(lambda f: into.cancel() if f.cancelled() else None)
            into.add_done_callback(_settle_in_arena(outer, extent, self._arena))
            return outer
        inner = self._run(read_adapter, spec, self._dtype, self._layout, False)
        outer.add_done_callback(lambda f: inner.cancel() if f.cancelled() else None)
        inner.add_done_callback(_settle(outer, self._pin, self._arena))
        return outer

    def _extent_for(self, spec: AdapterSpec) -> torch.Tensor | None:
        """An extent of the shared arena for `spec`'s slot image, if there is one and it has room."""
        if self._arena is None or self._layout is None:
            return None
        return self._arena.take(self._layout.image_size(image_groups(spec.modules), spec.rank), self._dtype)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True, slots=True)
class PackedInfo:
    """What a loader process reports about an image it wrote into the shared arena."""

    rank: int
    scaling: float
    modules: frozenset[str]
    groups: tuple[str, ...]


def read_into_arena(spec: AdapterSpec, dtype: torch.dtype, layout: SlotLayout, arena: str, offset: int) -> PackedInfo:
    """In a loader process: disk -> the slot image at byte `offset` of shared arena `arena`."""
    groups = image_groups(spec.modules)
    extent = attach(arena, offset, layout.image_size(groups, spec.rank), dtype)
    weights = load_adapter(spec, dtype, pin=False, layout=layout, arena=GivenExtent(extent))
    assert weights.packed_groups == groups
    return PackedInfo(weights.rank, weights.scaling, weights.modules, groups)


def _settle_in_arena(
    outer: Future[AdapterWeights], extent: torch.Tensor, arena: PinnedArena
) -> Callable[[Future[PackedInfo]], None]:
    # The extent goes back to the arena on every outcome but a delivered result (no copy has read it).
    def done(inner: Future[PackedInfo]) -> None:
        if outer.cancelled() or inner.cancelled():
            arena.give_back(extent)
            outer.cancel()
            return
        exc = inner.exception()
        if exc is not None:
            arena.give_back(extent)
            outer.set_exception(exc)
            return
        info = inner.result()
        if not outer.set_running_or_notify_cancel():
            arena.give_back(extent)
            return
        outer.set_result(AdapterWeights(info.rank, info.scaling, info.modules, {}, extent, info.groups))

    return done


def _settle(
    outer: Future[AdapterWeights], pin: bool, arena: PinnedArena | None
) -> Callable[[Future[AdapterWeights]], None]:
    def done(inner: Future[AdapterWeights]) -> None:
        if outer.cancelled():
            return
        if inner.cancelled():
            outer.cancel()
            return
        exc = inner.exception()
        if exc is not None:
            outer.set_exception(exc)
            return
        try:
            outer.set_result(_own(inner.result(), pin, arena))
        except Exception as copy_error:  # e.g. out of pinned memory: report it as the load's failure
            outer.set_exception(copy_error)

    return done


def _own(weights: AdapterWeights, pin: bool, arena: PinnedArena | None) -> AdapterWeights:
    """The weights copied out of the worker's shared memory (freed once the shared tensors die)."""
    if weights.packed is not None:
        packed = arena.take(weights.packed.numel(), weights.packed.dtype) if arena is not None else None
        if packed is None:
            packed = torch.empty_like(weights.packed, pin_memory=pin)
        packed.copy_(weights.packed)
        return AdapterWeights(weights.rank, weights.scaling, weights.modules, {}, packed, weights.packed_groups)
    dtype = next(iter(weights.tensors.values()))[0].dtype
    tensors, _ = host_copy(weights.tensors, dtype, pin)
    return AdapterWeights(weights.rank, weights.scaling, weights.modules, tensors)
