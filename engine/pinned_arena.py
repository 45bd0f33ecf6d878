"""Page-locked host memory for adapter images, taken once at start-up and handed out in extents.

A GPU slot fill copies an adapter's image from pinned host memory on a side stream. Pinning memory as
adapters load (one `cudaHostAlloc` per new image) stalls the engine's step loop for milliseconds each
time (bench/RESULTS-gpu.md, section d: warming torch's pinned cache first took 35-60% off the p99
inter-token latency of other requests during cold loads). The arena pins one buffer when the engine
starts; loads take extents of it and the pool gives them back when it drops an adapter from host memory.
When the arena is full, callers fall back to ordinary pinned allocations.
"""

from __future__ import annotations

import bisect
import threading

import torch

PAGE_BYTES = 1 << 20


class PinnedArena:
    """First-fit allocator of whole pages over one host buffer; thread-safe."""

    def __init__(self, nbytes: int, pin: bool = True, page_bytes: int = PAGE_BYTES) -> None:
        """`pin=False` gives ordinary memory (tests of the bookkeeping on machines without a GPU)."""
        self.page_bytes = page_bytes
        self.pages = nbytes // page_bytes
        self._buffer = torch.empty(self.pages * page_bytes, dtype=torch.uint8, pin_memory=pin)
        self._free: list[tuple[int, int]] = [(0, self.pages)] if self.pages else []  # (first page, count)
        self._taken: dict[int, tuple[int, int]] = {}  # data_ptr of a handed-out view -> its extent
        self._pending: list[tuple[torch.cuda.Event | None, tuple[int, int]]] = []
        self._lock = threading.Lock()

    @property
    def free_pages(self) -> int:
        with self._lock:
            self._reclaim()
            return sum(count for _, count in self._free)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A 1-D `dtype` tensor of `numel` elements in the arena, or None when no extent is large enough."""
        nbytes = numel * dtype.itemsize
        count = max(1, -(-nbytes // self.page_bytes))
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

    def give_back(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None = None) -> bool:
        """Return `tensor`'s extent (False if the arena did not hand it out). With `stream`, the extent is
        reused only after the work queued on it so far has run: copies out of the tensor may be in flight.
        """
        with self._lock:
            extent = self._taken.pop(tensor.data_ptr(), None)
            if extent is None:
                return False
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
            self._pending.append((event, extent))
            return True

    def _reclaim(self) -> None:
        # Lock held: extents whose copies have run go back to the free list, merged with their neighbours.
        still: list[tuple[torch.cuda.Event | None, tuple[int, int]]] = []
        for event, extent in self._pending:
            if event is not None and not event.query():
                still.append((event, extent))
                continue
            i = bisect.bisect(self._free, extent)
            self._free.insert(i, extent)
            if i + 1 < len(self._free) and extent[0] + extent[1] == self._free[i + 1][0]:
                self._free[i] = (extent[0], extent[1] + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free.pop(i)[1])
        self._pending = still
