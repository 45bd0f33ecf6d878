"""Page-locked shared memory for adapter images, taken once at start-up and handed out in extents.

A GPU slot fill copies an adapter's image from pinned host memory on a side stream. Pinning memory as
adapters load (one `cudaHostAlloc` per new image) stalls the engine's step loop for milliseconds each
time (bench/RESULTS-gpu.md, section d: warming torch's pinned cache first took 35-60% off the p99
inter-token latency of other requests during cold loads). The arena pins one buffer when the engine
starts; loads take extents of it and the pool gives them back when it drops an adapter from host memory.
When the arena is full, callers fall back to ordinary pinned allocations.

The arena is a named shared-memory segment, page-locked with `cudaHostRegister`: loader processes write
images straight into extents the engine hands them (`attach`), so a load costs the engine process no copy,
no allocation and no per-tensor Python work.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
from multiprocessing import shared_memory

import torch

PAGE_BYTES = 1 << 20
_SHM_DIR = "/dev/shm"


class PinnedArena:
    """First-fit allocator of whole pages over one host buffer; thread-safe."""

    def __init__(self, nbytes: int, pin: bool = True, page_bytes: int = PAGE_BYTES) -> None:
        """The arena is a named shared-memory segment (`name`) that loader processes `attach` to; `pin=False`
        leaves it pageable (tests of the bookkeeping on machines without a GPU)."""
        self.page_bytes = page_bytes
        self.pages = nbytes // page_bytes
        size = self.pages * page_bytes
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(create=True, size=size)
        self.name = self._shm.name
        self._buffer = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=size)
        self._registered = False
        if pin:
            code = int(torch.cuda.cudart().cudaHostRegister(self._buffer.data_ptr(), size, 0))
            if code != 0:
                raise RuntimeError(f"cudaHostRegister of the adapter arena failed with CUDA error {code}")
            self._registered = True
        self._free: list[tuple[int, int]] = [(0, self.pages)] if self.pages else []  # (first page, count)
        self._taken: dict[int, tuple[int, int]] = {}  # data_ptr of a handed-out view -> its extent
        self._pending: list[tuple[tuple[torch.cuda.Event, ...], tuple[int, int]]] = []
        self._lock = threading.Lock()

    def offset(self, view: torch.Tensor) -> int:
        """Byte offset of a handed-out `view` in the arena."""
        return view.data_ptr() - self._buffer.data_ptr()

    def close(self) -> None:
        """Unpin and remove the arena's segment (its memory goes once the last view of it dies)."""
        if self._registered:
            self._registered = False
            torch.cuda.synchronize()  # copies out of the arena may still be queued on some stream
            torch.cuda.cudart().cudaHostUnregister(self._buffer.data_ptr())
        if self._shm is not None:
            self._shm.unlink()
            self._shm = None

    @property
    def free_pages(self) -> int:
        with self._lock:
            self._reclaim()
            return sum(count for _, count in self._free)

    def fits(self, numel: int, dtype: torch.dtype) -> bool:
        """Whether `take(numel, dtype)` would find an extent now. Extents given back with a stream (or a copy
        into them in flight, `written`) count once those copies have run (waited for here: a fill takes about a
        millisecond)."""
        count = self._pages(numel * dtype.itemsize)
        with self._lock:
            self._reclaim()
            if not self._has_extent(count) and self._pending:
                for events, _ in self._pending:
                    for event in events:
                        event.synchronize()
                self._reclaim()
            return self._has_extent(count)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is an extent the arena handed out and has not had back."""
        with self._lock:
            return tensor.data_ptr() in self._taken

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A 1-D `dtype` tensor of `numel` elements in the arena, or None when no extent is large enough."""
        nbytes = numel * dtype.itemsize
        count = self._pages(nbytes)
        with self._lock:
            self._reclaim()
            for i, (first, available) in enumerate(self._free):
                if available < count:
                    continue
                if available == count:
                    del self._free[i]
                else:
                    self._free[i] = (first + count, available - count)
                start = first * self.page_bytes
                view = self._buffer[start : start + nbytes].view(dtype)
                self._taken[view.data_ptr()] = (first, count)
                return view
        return None

    def give_back(
        self, tensor: torch.Tensor, stream: torch.cuda.Stream | None = None, written: torch.cuda.Event | None = None
    ) -> bool:
        """Return `tensor`'s extent (False if the arena did not hand it out). With `stream`, the extent is
        reused only after the work queued on it so far has run: copies out of the tensor may be in flight.
        With `written`, only after that event too: a copy into the tensor may be in flight (the device
        loader hands its host image over before the copy back has run: `AdapterWeights.host_ready`).
        """
        with self._lock:
            extent = self._taken.pop(tensor.data_ptr(), None)
            if extent is None:
                return False
            events: list[torch.cuda.Event] = [written] if written is not None else []
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
            self._pending.append((tuple(events), extent))
            return True

    def _pages(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page_bytes))

    def _has_extent(self, pages: int) -> bool:
        # Lock held.
        return any(available >= pages for _, available in self._free)

    def _reclaim(self) -> None:
        # Lock held: extents whose copies have run go back to the free list, merged with their neighbours.
        still: list[tuple[tuple[torch.cuda.Event, ...], tuple[int, int]]] = []
        for events, extent in self._pending:
            if not all(event.query() for event in events):
                still.append((events, extent))
                continue
            i = bisect.bisect(self._free, extent)
            self._free.insert(i, extent)
            if i + 1 < len(self._free) and extent[0] + extent[1] == self._free[i + 1][0]:
                self._free[i] = (extent[0], extent[1] + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free.pop(i)[1])
        self._pending = still


def shared_arena_fits(nbytes: int) -> bool:
    """Whether the shared-memory filesystem has room for a shared arena of `nbytes` (containers often
    give /dev/shm only 64 MiB; touching pages past its limit would kill the process with SIGBUS)."""
    try:
        stats = os.statvfs(_SHM_DIR)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize >= nbytes


_attached: dict[str, mmap.mmap] = {}


def map_arena(name: str, populate: bool = True) -> mmap.mmap:
    """In a loader process: shared arena `name`, mapped whole once, with every page table entry filled at once
    (MAP_POPULATE). Mapped lazily, a load's first write to each page of an extent this process had not
    touched yet took a fault: a part of 2 Llama-7B layers took 4.7-8.9 ms to pack into a new extent against
    1.5 ms into one written before (one process on the 2-core development machine), and on an H100 host
    each loader process's share of a hot swap took 9-14 ms against 4.4-6.1 ms populated (bench/RESULTS-gpu.md,
    stop 28). Loader processes map it as they start (`adapter_loader`), before any load waits for them.

    Mapped from /dev/shm directly rather than through `SharedMemory(name=...)`, which would register the name
    with the resource tracker once more. `populate=False` maps it lazily, as before (bench/adapter_loading.py
    compares)."""
    mapped = _attached.get(name)
    if mapped is None:
        fd = os.open(os.path.join(_SHM_DIR, name.lstrip("/")), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            populated = getattr(mmap, "MAP_POPULATE", 0) if populate else 0
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populated)
        finally:
            os.close(fd)
        _attached[name] = mapped
    return mapped


def attach(name: str, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """In a loader process: the extent at byte `offset` of shared arena `name`, as `numel` `dtype`s."""
    count = numel * dtype.itemsize
    return torch.frombuffer(map_arena(name), dtype=torch.uint8, count=count, offset=offset).view(dtype)
