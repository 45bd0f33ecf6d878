"""Where adapter files are checked, read and prepared: threads of the engine process, or worker processes.

Reading an adapter (safetensors parse, dtype conversion, packing into the slot layout) holds the GIL for
milliseconds at a time. On a thread of the engine process that stalls the step loop, which is bound by
Python on a GPU (bench/RESULTS-gpu.md). `ProcessLoader` does the work in spawned worker processes. With a shared
arena (`PinnedArena`, page-locked shared memory) the workers write the slot image straight into
an extent the engine handed out, each worker its own share of the layers side by side, and nothing but
their outcome comes back. Without one (or when it is full), the
result comes back through torch's shared memory and the engine process copies it out, into pinned memory
when a GPU will read it. Registration's header check (`check`) runs in a process of its own.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import torch

from engine.adapters import AdapterSpec, host_copy, load_adapter, load_layers_into, read_spec
from engine.config import EngineConfig, ModelArch
from engine.lora import AdapterWeights, SlotLayout, image_groups
from engine.pinned_arena import PinnedArena, attach, map_arena, shared_arena_fits

log = logging.getLogger("engine.adapter_loader")
T = TypeVar("T")
LOAD_RETRIES = 2  # tries more for a load whose workers died under it (`ProcessLoader._start`)
CHECK_TIMEOUT_S = 60.0  # a check waits behind queued checks; beyond this the caller gets a TimeoutError


class AdapterLoader(Protocol):
    """Checks adapters, and reads them off the caller's thread; the future holds host weights or an
    AdapterError."""

    def check(self, path: Path, arch: ModelArch, max_rank: int) -> AdapterSpec:
        """`read_spec(path, arch, max_rank)`: the adapter's validated spec, or AdapterError saying why not."""
        ...

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

    def check(self, path: Path, arch: ModelArch, max_rank: int) -> AdapterSpec:
        return read_spec(path, arch, max_rank)

    def submit(self, spec: AdapterSpec) -> Future[AdapterWeights]:
        return self._executor.submit(read_adapter, spec, self._dtype, self._layout, self._pin)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _worker_init(arena: str | None, populate: bool) -> None:
    torch.set_num_threads(1)  # one adapter per worker; leave the cores to the engine
    if arena is not None:
        try:
            map_arena(arena, populate)  # its page tables filled now, not page by page inside loads
        except OSError:  # (the arena closed meanwhile: an engine stopping) a raising initializer breaks the pool
            log.warning("a loader process could not map the adapter arena %s", arena, exc_info=True)


def _alive(process: multiprocessing.process.BaseProcess) -> bool:
    """Whether a worker's process still runs (tests stand in for a death its executor has not seen yet)."""
    return process.is_alive()


def _started() -> None:
    """A task that only makes the pool start a worker (its import of torch is the slow part)."""


class ProcessLoader:
    """Loads in spawned worker processes, started with the loader in the background (each imports torch
    once, for a second or more, which the first cold load would otherwise wait for).

    Each worker has a queue of its own (a one-process `ProcessPoolExecutor`), and the parts of a split load
    go one to each worker, the least busy first. Workers that share one queue take their tasks one after
    another: each reads its task under the queue's lock and only then wakes the next, and on the GPU host
    each of those wake-ups took about a millisecond, so 8 parts of one load started over 9-17 ms
    (bench/RESULTS-gpu.md, stop 33).

    Checks run in one more process of their own, so that a registration never waits behind loads: a hot swap
    starts its new version's load beside the version's check (`AdapterPool.register`), and with a load's
    parts on every worker, the check would otherwise queue behind one of them.
    """

    def __init__(
        self,
        dtype: torch.dtype,
        layout: SlotLayout | None,
        workers: int = 2,
        arena: PinnedArena | None = None,
        populate_arena: bool = True,
    ) -> None:
        """With `arena` (and fused stacks' `layout`), one load is split over all `workers`, by layers. Each
        worker maps the arena as it starts, its page tables filled (`map_arena`); `populate_arena=False` leaves
        them to fill page by page as loads write (bench/adapter_loading.py compares)."""
        self._dtype, self._layout, self._arena = dtype, layout, arena
        self._populate_arena = populate_arena
        self._pin = torch.cuda.is_available()
        self._workers = workers
        self._lock = threading.RLock()  # load callbacks on the executors' threads may restart one too
        # Workers 0..workers-1 load; the last one checks (`_checker`).
        self._executors = [self._start_worker() for _ in range(workers + 1)]
        self._queued = [0] * (workers + 1)  # tasks submitted to each worker and not yet done
        self._checker = workers

    def _start_worker(self) -> ProcessPoolExecutor:
        # spawn, not fork: the engine process may hold CUDA state and threads a forked child cannot use.
        executor = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
            initargs=(self._arena.name if self._arena is not None else None, self._populate_arena),
        )
        executor.submit(_started)  # the executor starts its process at the first task
        return executor

    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        """The worker processes running now (one per worker, once started; the checker's last)."""
        with self._lock:
            return [p for executor in self._executors for p in (executor._processes or {}).values()]

    def _run(self, fn: Callable[..., T], *args: object, worker: int | None = None) -> Future[T]:
        """`fn(*args)` on `worker`, or on the loading one with the fewest tasks queued. A worker that died (killed, out
        of memory, SIGBUS on a file truncated under its map) fails its tasks in flight with BrokenProcessPool,
        and the next task for it starts a new process."""
        with self._lock:
            index = self._least_busy()[0] if worker is None else worker
            if not all(_alive(p) for p in (self._executors[index]._processes or {}).values()):
                self._replace_worker(index)
            try:
                future = self._executors[index].submit(fn, *args)
            except BrokenProcessPool:
                self._replace_worker(index)
                future = self._executors[index].submit(fn, *args)
            self._queued[index] += 1
        future.add_done_callback(lambda _: self._task_done(index))
        return future

    def _replace_worker(self, index: int) -> None:
        """A new process for worker `index`, whose process died. Its executor learns of a death only when its
        own thread next wakes, and meanwhile still takes tasks, which then fail with BrokenProcessPool: a load
        started again after its workers were killed sent a part there, and failed a second time. So a death
        is looked for before each task, as well as seen when a submission fails."""
        log.warning("adapter loader process %d died: starting a new one", index)
        # Its queued tasks are not cancelled: the executor's thread fails them with BrokenProcessPool once it
        # sees the death, which starts their loads again. Cancelled, they ended loads that nobody retried.
        self._executors[index].shutdown(wait=False)
        self._executors[index] = self._start_worker()

    def _least_busy(self) -> list[int]:
        """The loading workers, those with the fewest tasks queued first."""
        with self._lock:
            return sorted(range(self._workers), key=self._queued.__getitem__)

    def _task_done(self, index: int) -> None:
        with self._lock:
            self._queued[index] -= 1

    def check(self, path: Path, arch: ModelArch, max_rank: int) -> AdapterSpec:
        """`read_spec` in a worker, waited for. The header check is milliseconds of Python: on a thread of the
        engine process (a gRPC handler's) it held the GIL that long, and the step loop, waiting for it,
        doubled the inter-token gaps of running requests (bench/RESULTS-gpu.md). It runs in the checker
        process, behind other checks only."""
        try:
            return self._checked(path, arch, max_rank)
        except BrokenProcessPool:  # the checker process died meanwhile (killed, out of memory): once more
            return self._checked(path, arch, max_rank)

    def _checked(self, path: Path, arch: ModelArch, max_rank: int) -> AdapterSpec:
        future = self._run(read_spec, path, arch, max_rank, worker=self._checker)
        try:
            return future.result(CHECK_TIMEOUT_S)
        except TimeoutError:
            future.cancel()  # still queued behind other checks: then it never runs
            raise

    def submit(self, spec: AdapterSpec) -> Future[AdapterWeights]:
        outer: Future[AdapterWeights] = Future()
        self._start(spec, outer, retries=LOAD_RETRIES)
        return outer

    def _start(self, spec: AdapterSpec, outer: Future[AdapterWeights], retries: int) -> None:
        # A load that fails because a worker died is started again, on new processes in their place: the worker
        # may have died loading another adapter, and this one's requests should not fail for it. More than once:
        # workers killed together die a few milliseconds apart, and a load started again when the first death
        # was seen could send a part to a worker about to die. A load that kills its workers itself (a file
        # truncated under their maps) fails after `LOAD_RETRIES` more tries.
        def again() -> None:
            if not outer.done():
                try:
                    self._start(spec, outer, retries - 1)
                except Exception as exc:  # no new workers: in a future's callback, raising would leave it pending
                    outer.set_exception(exc)

        on_broken = again if retries > 0 else None
        extent = self._extent_for(spec)
        if extent is not None:
            assert self._arena is not None and self._layout is not None
            offset = self._arena.offset(extent)
            parts: list[Future[tuple[float, float]]] = []
            split = layer_parts(self._layout.num_layers, self._workers)
            for worker, layers in zip(self._least_busy(), split, strict=False):
                try:
                    args = (spec, self._dtype, self._layout, self._arena.name, offset, layers)
                    parts.append(self._run(fill_layers, *args, worker=worker))
                except Exception as exc:  # no workers could start: the parts already queued are cancelled
                    failed: Future[tuple[float, float]] = Future()
                    failed.set_exception(exc)
                    parts.append(failed)
                    break
            image = AdapterWeights(spec.rank, spec.scaling, spec.modules, {}, extent, image_groups(spec.modules))
            _settle_parts(outer, parts, image, self._arena, on_broken)
            return
        inner = self._run(read_adapter, spec, self._dtype, self._layout, False)
        cancel_with(outer, inner)
        inner.add_done_callback(_settle(outer, self._pin, self._arena, on_broken))

    def _extent_for(self, spec: AdapterSpec) -> torch.Tensor | None:
        """An extent of the shared arena for `spec`'s slot image, if there is one and it has room."""
        if self._arena is None or self._layout is None:
            return None
        return self._arena.take(self._layout.image_size(image_groups(spec.modules), spec.rank), self._dtype)

    def close(self) -> None:
        with self._lock:
            for executor in self._executors:
                executor.shutdown(wait=False, cancel_futures=True)


def make_loader(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, layout: SlotLayout | None
) -> tuple[AdapterLoader, PinnedArena | None]:
    """The loader `config.adapter_loader` asks for, and the shared page-locked arena it writes into, if any.

    "device" (CUDA, fused stacks) reads files by threads and converts them on the GPU (`DeviceLoader`), with
    loader processes (one loading, one checking) for checks and for the files it leaves to others. "auto" takes
    it on a GPU: its loads measured 0.41-0.64x the loader processes' on one H100, hot swaps 0.62-0.96x
    (RESULTS-gpu.md, stops 36 and 38), with others' p99 during loads no worse (stop 36). Loader processes alone
    ("process") keep every load off a GPU engine's GIL-bound step loop; a CPU engine's loop is bound by its
    matmuls, and threads start faster there.
    """
    kind = loader_kind(config.adapter_loader, device, fused=layout is not None)
    if config.adapter_loader == "device" and kind != "device":
        log.warning("--adapter-loader device places fused slot images; these stacks are not fused: loader processes")
    if kind == "thread":
        return ThreadLoader(dtype, layout), None
    arena = _shared_arena(device, config.pinned_adapter_memory_mb)
    if kind == "device":
        from engine.adapter_device_loader import DeviceLoader  # (which imports this module)

        assert layout is not None
        fallback = ProcessLoader(dtype, layout, 1, arena)
        return DeviceLoader(fallback, dtype, layout, device, arena, config.reader_threads()), arena
    return ProcessLoader(dtype, layout, config.loader_workers(), arena), arena


def loader_gpu_bytes(config: EngineConfig, device: torch.device, dtype: torch.dtype, layout: SlotLayout | None) -> int:
    """GPU memory the loader `make_loader` builds takes at most once it loads: the KV cache's sizing leaves it
    free (`kv_cache.kv_slots`). Only the device loader takes any."""
    if loader_kind(config.adapter_loader, device, fused=layout is not None) != "device":
        return 0
    from engine.adapter_device_loader import gpu_bytes  # (which imports this module)

    assert layout is not None
    return gpu_bytes(layout, dtype)


def loader_kind(asked: str, device: torch.device, fused: bool) -> Literal["thread", "process", "device"]:
    """The loader that `--adapter-loader asked` means on `device`, with the stacks `fused` or not: "auto" is
    the device loader on a GPU and threads on a CPU; "device" (or "auto") without fused stacks (it places fused
    slot images) falls back to loader processes."""
    if asked == "thread" or (asked == "auto" and device.type != "cuda"):
        return "thread"
    return "device" if asked in ("device", "auto") and fused else "process"


def _shared_arena(device: torch.device, megabytes: int) -> PinnedArena | None:
    """Page-locked shared memory that loader processes write adapter images straight into (CUDA, and only if
    /dev/shm has room; otherwise they hand results back to be copied)."""
    if device.type != "cuda" or megabytes == 0:
        return None
    if not shared_arena_fits(megabytes << 20):
        log.warning("/dev/shm has no room for a %d MiB adapter arena: loader processes copy results", megabytes)
        return None
    return PinnedArena(megabytes << 20)


def layer_parts(num_layers: int, parts: int) -> list[range]:
    """`num_layers` split into at most `parts` contiguous ranges of near-equal length."""
    parts = max(1, min(parts, num_layers))
    bounds = [num_layers * i // parts for i in range(parts + 1)]
    return [range(lo, hi) for lo, hi in itertools.pairwise(bounds)]


def fill_layers(
    spec: AdapterSpec, dtype: torch.dtype, layout: SlotLayout, arena: str, offset: int, layers: range
) -> tuple[float, float]:
    """In a loader process: `layers` of `spec`'s slot image, written into it at byte `offset` of shared arena
    `arena` (`load_layers_into`). Returns the part's start and end on `time.perf_counter` (CLOCK_MONOTONIC,
    one clock for every process of the machine), for load timelines (bench/engine_gpu_e2e.py --trace)."""
    start = time.perf_counter()
    groups = image_groups(spec.modules)
    image = attach(arena, offset, layout.image_size(groups, spec.rank), dtype)
    load_layers_into(spec, dtype, layout, image, layers)
    return start, time.perf_counter()


def _settle_parts(
    outer: Future[AdapterWeights],
    parts: list[Future[tuple[float, float]]],
    image: AdapterWeights,
    arena: PinnedArena,
    on_broken: Callable[[], None] | None,
) -> None:
    """Resolve `outer` with `image` once every part has filled its layers. The image's extent goes back to
    the arena on every other outcome, but only after the last part has ended: until then a worker may still
    write into it. Cancelling `outer` cancels the parts not yet started. If a part's worker died,
    `on_broken` (when given) starts the load again instead of failing it."""
    lock = threading.Lock()
    pending = [len(parts)]

    def part_done(_: Future[tuple[float, float]]) -> None:
        with lock:
            pending[0] -= 1
            if pending[0]:
                return
        assert image.packed is not None
        # Let go of the list: each part's callback holds this closure, which held the parts (a cycle that kept
        # the result until the cyclic garbage collector ran).
        ended = parts.copy()
        parts.clear()
        failure = next((p.exception() for p in ended if not p.cancelled() and p.exception() is not None), None)
        if failure is None and not any(p.cancelled() for p in ended) and outer.set_running_or_notify_cancel():
            outer.set_result(image)
            return
        if isinstance(failure, BrokenProcessPool):
            # Not reused, to be safe: when workers shared one executor, it failed the futures before it had
            # terminated the other workers, which could still be writing into the extent. A worker dying is
            # rare, and the arena has room.
            log.warning("an adapter image's extent is left unused: a loader process died while writing it")
        else:
            arena.give_back(image.packed)
        if outer.done():
            return
        if isinstance(failure, BrokenProcessPool) and on_broken is not None:
            on_broken()
        elif failure is not None:
            outer.set_exception(failure)
        else:
            outer.cancel()

    cancel_with(outer, *parts)
    for part in parts:
        part.add_done_callback(part_done)


def cancel_with(outer: Future[Any], *inner: Future[Any]) -> None:
    """The `inner` futures cancelled when `outer` is. By weak references (a pending one is held by its
    executor): each inner future's own callback holds `outer`, and a cycle between them kept a load's result,
    its images included, until the cyclic garbage collector ran."""
    refs = [weakref.ref(future) for future in inner]

    def cancel(done: Future[Any]) -> None:
        if done.cancelled():
            for ref in refs:
                if (future := ref()) is not None:
                    future.cancel()

    outer.add_done_callback(cancel)


def _settle(
    outer: Future[AdapterWeights], pin: bool, arena: PinnedArena | None, on_broken: Callable[[], None] | None
) -> Callable[[Future[AdapterWeights]], None]:
    def done(inner: Future[AdapterWeights]) -> None:
        if outer.cancelled():
            return
        if inner.cancelled():
            outer.cancel()
            return
        exc = inner.exception()
        if isinstance(exc, BrokenProcessPool) and on_broken is not None:
            on_broken()
            return
        if exc is not None:
            outer.set_exception(exc)
            return
        # Running, `outer` can no longer be cancelled: the copy (maybe an extent of the arena) then always
        # reaches the caller, who gives it back. A cancel during the copy left it with nobody.
        if not outer.set_running_or_notify_cancel():
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
