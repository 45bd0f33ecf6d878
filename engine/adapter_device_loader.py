"""Adapter loads read by threads of the engine process and converted on the GPU (`DeviceLoader`).

Loader processes (`adapter_loader.ProcessLoader`) pack an adapter's slot image on the host: each part maps the
file, parses its header, converts to the engine's dtype and checks the values, and the image then goes to the
GPU in a slot fill. At Llama-7B dims (32 layers, rank 16 on all seven projections, an fp32 file of 153 MiB)
that took 14.5 ms on an H100 host. Reading the file's bytes as stored by 16 threads into page-locked memory,
each share copied to the GPU as soon as it was read, and converting and checking there took 0.47x of it
(bench/adapter_upload_paths.py; bench/RESULTS-gpu.md, stop 34). This loader is built on that path. Inside the
engine (stops 36 and 38, one H100, side by side in four runs) its loads of that file took 0.41-0.64x the
loader processes' and hot swap (f) 0.62-0.96x, with others' inter-token latency during cold joins no worse
(stop 36). It is the GPU default (`--adapter-loader auto`, or `device`).

`DeviceLoader` loads so:
1. the weights file's header is read (`stored_tensors`: safetensors parses and validates it), unless the file's
   stored header and size equal the last load's, whose plan (step 3) is then reused as it is;
2. `readers` threads `os.preadv` the data, a chunk at a time, into a ring of page-locked chunks, and each
   chunk is copied to the GPU on the loader's stream as soon as it is read;
3. one multi-tensor copy places every tensor in a device image in slot layout, converted to the engine's
   dtype (`LayerCopies`), and one reduction checks that image finite. The device buffers and the copies'
   views are made once per file layout and kept for the next load laid out alike (the versions of one
   adapter): making them is milliseconds of Python, holding the GIL the step loop needs;
4. the image is copied back into host memory (an extent of the shared arena): the host image is what the
   pool's host tier holds and slot fills read, as with the other loaders. A clone of the device image comes
   back beside it, and the pool keeps it for a fill expected soon (a hot swap's, a waiting request's), which
   then copies device to device instead of from the host (`AdapterPool._drop_device_image`). The load is
   done once the check's flag and the device image are; the copy back is still in flight then
   (`AdapterWeights.host_ready`, which fills from the host image and the arena wait for).
All of it runs on threads of the engine process: the header parse and the plan's key (1.7-2.6 ms of Python on
an H100 host, skipped when the file's stored header and size equal the last load's), the reads and the
copies' launches; the GIL is released while a read or a device wait blocks.
Registration checks (`check`), and loads of files whose tensors are not aligned to their dtype (the format
does not promise it), go to the `fallback` loader.

Without CUDA the same steps run on the CPU, unpinned and synchronous (the unit tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import queue
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from engine.adapter_loader import AdapterLoader, cancel_with
from engine.adapters import (
    WEIGHTS_FILE,
    AdapterError,
    AdapterSpec,
    StoredTensor,
    check_registered,
    layer_of,
    non_finite,
    pair_tensors,
    stored_tensors,
)
from engine.config import ModelArch
from engine.lora import AdapterWeights, LayerCopies, SlotLayout, image_groups
from engine.pinned_arena import PinnedArena

# One read and one copy to the device. A 32-layer Llama-7B file (153 MiB) took 7.4-7.6 ms to read and copy in
# chunks of 16 MiB by 16 threads, 11.4 ms in 8 MiB, 12.3 ms in 4 MiB and 23.0 ms in 2 MiB ones: each chunk costs
# its own Python under the GIL the readers share (one H100 host; bench/RESULTS-gpu.md, stops 35 and 36, when
# the readers entered the loader's stream per chunk; stop 38, set once: 2 MiB chunks 14.5 ms, 16 MiB 8.4 ms).
CHUNK_BYTES = 16 << 20
RING_BYTES = 192 << 20  # page-locked chunks in the ring: the reads run ahead of the copies by this much
MAX_HEADER_BYTES = 100 << 20  # (safetensors refuses larger headers)
# What `gpu_bytes` leaves room for: files of floats up to 4 bytes (float64 ones go to the fallback), and device
# images alive at once: the pool keeps at most two (`pool.DEVICE_IMAGES_KEPT`), and a load just done holds one
# more; loads started ahead of hot swaps' checks, which the pool does not count, get none past the limit.
MAX_STORED_ITEMSIZE = 4
MAX_DEVICE_IMAGES = 3


class DeviceLoader:
    """Reads adapter files with threads into page-locked chunks, and converts, places and checks them on the
    device (see the module's docstring). Loads run one at a time, each over all the readers."""

    def __init__(
        self,
        fallback: AdapterLoader,
        dtype: torch.dtype,
        layout: SlotLayout,
        device: torch.device,
        arena: PinnedArena | None = None,
        readers: int = 16,
        chunk_bytes: int | None = None,
        chunks: int | None = None,
    ) -> None:
        """`fallback` checks registrations and loads what this loader cannot (misaligned tensors); `arena`,
        if given, holds the host images (beyond it, each is pinned alone, on CUDA). The ring has `chunks`
        chunks of `chunk_bytes` (by default `CHUNK_BYTES`, and as many as `RING_BYTES` holds, read when the
        loader is made: benches set them)."""
        self._fallback, self._dtype, self._layout, self._device, self._arena = fallback, dtype, layout, device, arena
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        chunk_bytes = chunk_bytes or CHUNK_BYTES
        chunks = chunks or max(1, RING_BYTES // chunk_bytes)
        self._chunk_bytes = chunk_bytes
        # The ring: taken one page-locked buffer at start-up (a cudaHostAlloc stalls the device's streams).
        self._staging = torch.empty(chunks * chunk_bytes, dtype=torch.uint8, pin_memory=self._cuda)
        self._staging_bytes = self._staging.numpy().data  # what os.preadv reads into
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(chunks):
            self._free.put(index)
        # Per chunk: its last copy to the device, which must have read it before the next read overwrites it.
        self._copied: list[torch.cuda.Event | None] = [None] * chunks
        self._loads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-device-load")
        # Each reading thread makes the loader's stream its current one once: entering it per piece
        # (`torch.cuda.stream`) took 2 MiB pieces of a 153 MiB file from 8.30 to 16.87 ms (one H100, stop 38,
        # bench/read_chunk_costs.py; the loader itself was not measured both ways). The initializer is not a
        # bound method: each thread keeps it for its life, and would keep an unclosed loader alive with it.
        self._readers = ThreadPoolExecutor(
            max_workers=readers,
            thread_name_prefix="adapter-read",
            initializer=functools.partial(torch.cuda.set_stream, self._stream) if self._stream is not None else None,
        )
        self._closed = threading.Event()
        # The image on the device comes back beside the host one, for the version's first slot fill (the pool
        # keeps it only for a fill expected soon: `AdapterPool._drop_device_image`); bench/engine_gpu_e2e.py
        # turns it off to compare.
        self.keep_device_image = True
        self._device_images = threading.BoundedSemaphore(MAX_DEVICE_IMAGES)
        self._plan: _Plan | None = None  # the last file layout's buffers and copies (`_plan_for`)

    def check(self, path: Path, arch: ModelArch, max_rank: int) -> AdapterSpec:
        return self._fallback.check(path, arch, max_rank)

    def submit(self, spec: AdapterSpec) -> Future[AdapterWeights]:
        outer: Future[AdapterWeights] = Future()
        inner = self._loads.submit(self._load, spec)
        cancel_with(outer, inner)

        def settle(done: Future[AdapterWeights | None]) -> None:
            if done.cancelled():
                outer.cancel()
            elif (exc := done.exception()) is not None:
                self._fail(outer, exc)
            elif (weights := done.result()) is not None:
                self._hand_over(outer, weights)
            elif not outer.cancelled():  # not this loader's to load: the fallback's result becomes this load's
                try:
                    source = self._fallback.submit(spec)
                except Exception as error:  # (no loader process could start) raised here, it left `outer` pending
                    self._fail(outer, error)
                else:
                    self._chain(source, outer)

        inner.add_done_callback(settle)
        return outer

    def _chain(self, source: Future[AdapterWeights], outer: Future[AdapterWeights]) -> None:
        cancel_with(outer, source)

        def done(f: Future[AdapterWeights]) -> None:
            if f.cancelled():
                outer.cancel()
            elif (exc := f.exception()) is not None:
                self._fail(outer, exc)
            else:
                self._hand_over(outer, f.result())

        source.add_done_callback(done)

    @staticmethod
    def _fail(outer: Future[AdapterWeights], exc: BaseException) -> None:
        if outer.set_running_or_notify_cancel():
            outer.set_exception(exc)

    def _hand_over(self, outer: Future[AdapterWeights], weights: AdapterWeights) -> None:
        """`weights` as `outer`'s result; if `outer` was cancelled meanwhile nobody takes them, and their
        extent goes back to the arena."""
        if outer.set_running_or_notify_cancel():
            outer.set_result(weights)
        elif self._arena is not None:
            weights.give_back_host_image(self._arena)

    def close(self) -> None:
        self._closed.set()  # reads not yet started fail at once
        self._readers.shutdown(wait=False, cancel_futures=True)
        # A load in flight may still queue a copy into the arena, which the engine closes next: wait for it, and
        # for the copies back to the host that loads handed over leave in flight.
        self._loads.shutdown(wait=True, cancel_futures=True)
        if self._stream is not None:
            self._stream.synchronize()
        self._fallback.close()

    # -- one load (on the load thread) ------------------------------------------------------------------

    def _load(self, spec: AdapterSpec) -> AdapterWeights | None:
        """`spec`'s host image, or None when its file is the fallback's to load."""
        folder = spec.path
        try:
            handle = (folder / WEIGHTS_FILE).open("rb")
        except OSError as exc:
            raise AdapterError(f"{folder}: cannot load {WEIGHTS_FILE} ({exc})") from exc
        with handle, self._on_stream():
            found = self._plan_of(spec, handle)
            if found is None:
                return None
            plan, start = found
            self._read(handle.fileno(), folder, start, plan.raw)
            return self._place(spec, plan)

    def _plan_of(self, spec: AdapterSpec, handle: BinaryIO) -> tuple[_Plan, int] | None:
        """The plan for the weights file `handle` has open, and where its tensors' data starts; None when the
        file is the fallback's to load (tensors not aligned to their dtype, or float64 ones: `gpu_bytes`). The
        last plan, unparsed, if the file's stored header and size are the last load's (`_Plan.laid_out_as`);
        else from the parsed header."""
        folder, fd = spec.path, handle.fileno()
        try:
            header, file_size = stored_header(fd), os.fstat(fd).st_size
        except OSError as exc:
            raise AdapterError(f"{folder}: cannot load {WEIGHTS_FILE} ({exc})") from exc
        # (No local for the last plan: a plan made anew below must find the last one's buffers let go.)
        if self._plan is not None and self._plan.laid_out_as(spec, header, file_size):
            return self._plan, file_size - self._plan.raw.numel()
        try:
            stored = stored_tensors(folder, handle)
            # The parse opened the file by its path: rewritten in place since the header was read, the layout
            # it found is not that header's, and a plan tagged with it would serve later files of that header
            # wrong offsets. Such a plan is not tagged (the next load parses again).
            if (stored_header(fd), os.fstat(fd).st_size) != (header, file_size):
                header = None
        except AdapterError:
            raise
        except Exception as exc:  # SafetensorError: a header that no longer parses; OSError
            raise AdapterError(f"{folder}: cannot load {WEIGHTS_FILE} ({exc})") from exc
        if not stored or any(t.offset % t.dtype.itemsize or t.dtype.itemsize > MAX_STORED_ITEMSIZE for t in stored):
            return None
        start = stored[0].offset
        return self._plan_for(spec, stored, start, sum(t.nbytes for t in stored), header), start

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _read(self, fd: int, folder: Path, start: int, raw: torch.Tensor) -> None:
        """The file's bytes from `start` on, into `raw` (on the device), by the readers a chunk each."""
        size = raw.numel()
        chunks = [(lo, min(size, lo + self._chunk_bytes)) for lo in range(0, size, self._chunk_bytes)]
        reads = [self._readers.submit(self._read_chunk, fd, folder, start, lo, hi, raw) for lo, hi in chunks]
        # Every read ends before the load does, failed or not: they write into `raw`, and their copies are
        # queued on the stream the load waits for.
        wait(reads)
        for read in reads:
            read.result()

    def _read_chunk(self, fd: int, folder: Path, start: int, lo: int, hi: int, raw: torch.Tensor) -> None:
        if self._closed.is_set():
            raise AdapterError(f"{folder}: the engine is stopping")
        index = self._free.get()
        try:
            copied = self._copied[index]
            if copied is not None:
                copied.synchronize()  # (releases the GIL) its last copy has read it
            base = index * self._chunk_bytes
            view = self._staging_bytes[base : base + hi - lo]
            done = 0
            while done < hi - lo:
                try:
                    got = os.preadv(fd, [view[done:]], start + lo + done)
                except OSError as exc:
                    raise AdapterError(f"{folder}: cannot read {WEIGHTS_FILE} ({exc})") from exc
                if got == 0:
                    raise AdapterError(f"{folder}: {WEIGHTS_FILE} ends before the tensors its header lists")
                done += got
            raw[lo:hi].copy_(self._staging[base : base + hi - lo], non_blocking=self._cuda)  # (on the loader's stream)
            self._copied[index] = self._record()
        finally:
            self._free.put(index)

    def _plan_for(
        self, spec: AdapterSpec, stored: list[StoredTensor], start: int, size: int, header: bytes | None
    ) -> _Plan:
        """The device buffers and copies for a file laid out as `stored` (its data `size` bytes from `start`):
        the last one made if the layout and `spec`'s rank and projections are the same (adapters written
        alike), else new ones, checked against `spec`. Making them is milliseconds of Python (views of 448
        tensors at Llama-7B dims), which holds the GIL the engine's step loop needs."""
        key = (spec.rank, spec.modules, size, tuple((t.name, t.dtype, t.shape, t.offset - start) for t in stored))
        if self._plan is not None and self._plan.key == key:
            self._plan = dataclasses.replace(self._plan, header=header, file_size=start + size)
            return self._plan
        self._plan = None  # its buffers go before new ones are taken
        folder = spec.path
        for t in stored:
            layer_of(folder, t.name, self._layout.num_layers)  # AdapterError for a name or layer we lack
        raw = torch.empty(size, dtype=torch.uint8, device=self._device)
        try:
            views = {
                t.name: raw[t.offset - start : t.offset - start + t.nbytes].view(t.dtype).view(t.shape) for t in stored
            }
        except RuntimeError as exc:  # (not expected: `stored` lies back to back within `size`)
            raise AdapterError(f"{folder}: cannot load {WEIGHTS_FILE} ({exc})") from exc
        tensors = pair_tensors(folder, views)
        check_registered(spec, tensors)
        groups = image_groups(spec.modules)
        image = torch.empty(self._layout.image_size(groups, spec.rank), dtype=self._dtype, device=self._device)
        try:
            copies = LayerCopies.of(self._layout, image, groups, spec.rank, tensors, range(self._layout.num_layers))
        except RuntimeError as exc:  # a shape that no longer fits its place
            raise AdapterError(f"{folder}: {WEIGHTS_FILE} no longer fits its registered shapes ({exc})") from exc
        self._plan = _Plan(key, raw, image, groups, tensors, copies, header, start + size)
        return self._plan

    def _place(self, spec: AdapterSpec, plan: _Plan) -> AdapterWeights:
        """The image placed and converted on the device from the bytes read, checked finite and copied to host
        memory (and, with `keep_device_image`, to a device image of its own).

        The load is done once the check's flag and the device image are: the copy back to the host (1.6 ms of
        an 80 MB image on an H100) is still in flight then, and the weights say so (`host_ready`). A hot swap
        or a waiting request fills its slot from the device image meanwhile."""
        plan.copies.run()
        image = plan.image
        low, high = torch.aminmax(image)
        finite = (torch.isfinite(low) & torch.isfinite(high)).to("cpu", non_blocking=self._cuda)
        # The plan's image is overwritten by the next load: the pool gets a copy (device to device, 80 MB in
        # tens of microseconds at Llama-7B dims).
        device_image = self._device_image(image) if self.keep_device_image else None
        checked = self._record()
        host = self._arena.take(image.numel(), self._dtype) if self._arena is not None else None
        if host is None:
            host = torch.empty(image.numel(), dtype=self._dtype, pin_memory=self._cuda)
        try:
            host.copy_(image, non_blocking=self._cuda)
            host_ready = self._record()
            weights = AdapterWeights(
                spec.rank, spec.scaling, spec.modules, {}, host, plan.groups, device_image, host_ready
            )
            if checked is not None:
                checked.synchronize()  # (releases the GIL) the check's flag and the device image are written
            if not bool(finite):
                raise AdapterError(
                    f"{spec.path}: {non_finite(plan.tensors, self._dtype)} contains NaN or infinite values "
                    f"(in {self._dtype})"
                )
        except BaseException:
            if self._arena is not None:  # reused once the copy queued into it has run
                self._arena.give_back(host, self._stream)
            raise
        return weights

    def _device_image(self, image: torch.Tensor) -> torch.Tensor | None:
        """A copy of `image` for the pool, unless `MAX_DEVICE_IMAGES` are alive (each gives its place back when
        it is freed)."""
        if not self._device_images.acquire(blocking=False):
            return None
        try:
            copy = image.clone()
        except BaseException:
            self._device_images.release()
            raise
        weakref.finalize(copy, self._device_images.release)  # (the semaphore's: the loader stays collectable)
        return copy

    def _record(self) -> torch.cuda.Event | None:
        """An event of the work queued on the loader's stream so far (None on the CPU, where it has run)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event


def gpu_bytes(layout: SlotLayout, dtype: torch.dtype) -> int:
    """The most GPU memory a `DeviceLoader` takes for adapters of `layout` at its largest rank, all projections:
    one file's bytes as stored (`MAX_STORED_ITEMSIZE` an element at most) and the `dtype` image placed from
    them, which its plan keeps for the next load alike, and `MAX_DEVICE_IMAGES` more images."""
    elements = layout.image_size(layout.group_fan_in, layout.max_rank)  # (a file stores as many: no repeats)
    return elements * (MAX_STORED_ITEMSIZE + dtype.itemsize * (1 + MAX_DEVICE_IMAGES))


def stored_header(fd: int) -> bytes | None:
    """A safetensors file's header as stored (its length, then its JSON), or None if the file is too short to
    hold the one its first bytes announce. Equal headers in files of equal size lay their tensors out alike."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return None
    length = int.from_bytes(head, "little")
    if length > MAX_HEADER_BYTES:
        return None
    body = os.pread(fd, length, 8)
    return head + body if len(body) == length else None


@dataclass(frozen=True, slots=True)
class _Plan:
    """One file layout's device buffers (its bytes as read, its image) and the copies between them."""

    key: tuple[object, ...]
    raw: torch.Tensor
    image: torch.Tensor
    groups: tuple[str, ...]
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # views of `raw`, by (layer, module)
    copies: LayerCopies
    # The file's header as stored, and its size: a load of a file with both the same skips the header's parse
    # (1.7-2.4 ms of Python on an H100 host, stop 35) and the key's making.
    header: bytes | None
    file_size: int

    def laid_out_as(self, spec: AdapterSpec, header: bytes | None, file_size: int) -> bool:
        """Whether a file of `header` and `file_size`, registered as `spec`, has this plan's layout."""
        return (
            header is not None
            and header == self.header
            and file_size == self.file_size
            and (spec.rank, spec.modules) == self.key[:2]
        )
