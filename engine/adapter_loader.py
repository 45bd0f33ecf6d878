"""Where adapter files are read and prepared: threads of the engine process, or worker processes.

Reading an adapter (safetensors parse, dtype conversion, packing into the slot layout) holds the GIL for
milliseconds at a time. On a thread of the engine process that stalls the step loop, which is bound by
Python on a GPU (bench/RESULTS-gpu.md). `ProcessLoader` does the work in spawned worker processes; the
result comes back through shared memory and the engine process only copies it out, into pinned memory
when a GPU will read it (one large copy, during which torch releases the GIL).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Protocol

import torch

from engine.adapters import AdapterSpec, host_copy, load_adapter
from engine.lora import AdapterWeights, SlotLayout


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

    def __init__(self, dtype: torch.dtype, layout: SlotLayout | None, workers: int = 2) -> None:
        self._dtype, self._layout = dtype, layout
        self._pin = torch.cuda.is_available()
        # spawn, not fork: the engine process may hold CUDA state and threads a forked child cannot use.
        context = multiprocessing.get_context("spawn")
        self._executor = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_worker_init)

    def submit(self, spec: AdapterSpec) -> Future[AdapterWeights]:
        inner = self._executor.submit(read_adapter, spec, self._dtype, self._layout, False)
        outer: Future[AdapterWeights] = Future()
        outer.add_done_callback(lambda f: inner.cancel() if f.cancelled() else None)
        inner.add_done_callback(_settle(outer, self._pin))
        return outer

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _settle(outer: Future[AdapterWeights], pin: bool) -> Callable[[Future[AdapterWeights]], None]:
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
            outer.set_result(_own(inner.result(), pin))
        except Exception as copy_error:  # e.g. out of pinned memory: report it as the load's failure
            outer.set_exception(copy_error)

    return done


def _own(weights: AdapterWeights, pin: bool) -> AdapterWeights:
    """The weights copied out of the worker's shared memory (freed once the shared tensors die)."""
    if weights.packed is not None:
        packed = torch.empty_like(weights.packed, pin_memory=pin)
        packed.copy_(weights.packed)
        return AdapterWeights(weights.rank, weights.scaling, weights.modules, {}, packed, weights.packed_groups)
    dtype = next(iter(weights.tensors.values()))[0].dtype
    tensors, _ = host_copy(weights.tensors, dtype, pin)
    return AdapterWeights(weights.rank, weights.scaling, weights.modules, tensors)
