"""Ways to bring one adapter file from the page cache onto a GPU, side by side (a diagnostic for hot swap (f)).

  PYTHONPATH=. python3 bench/adapter_upload_paths.py [--rounds 8]

The adapter: all 32 layers of a Llama-7B-shaped PEFT adapter, rank 16 on all seven projections, an fp32
safetensors file of 153 MiB, read once before timing so that it sits in the page cache (as a new version's file
does right after it is written). Each round times, one after another:

- the engine's way: 8 loader processes (`ProcessLoader`) map the file, pack bf16 into the shared pinned
  arena and check it; then the 80 MB image is copied to the GPU;
- `os.preadv` of the file's data section by 4, 8 or 16 threads of one process straight into page-locked
  memory, fp32 as the file stores it, then one copy to the GPU (or each thread's share copied as soon as it
  is read) and the conversion to bf16 and the finite check on the GPU;
- copies to the GPU straight from a memory map of the file (pageable memory, which the driver stages);
- the file's memory map page-locked in place (`cudaHostRegister`, read-only), then copied;
- for scale, the host's own fp32 -> bf16 conversion of 160 MB with 1, 8 and 16 torch threads.

It prints the median, min and max of each, in ms, and the ratios of the fastest paths to the engine's way.
`--phases-only` prints instead where one device loader load's time goes, phase by phase. Needs CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import mmap
import os
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.adapter_loading import llama_7b_adapter_file
from engine.adapter_device_loader import DeviceLoader
from engine.adapter_loader import AdapterLoader, ProcessLoader, ThreadLoader
from engine.adapters import WEIGHTS_FILE, AdapterSpec, read_spec
from engine.lora import LoRAStacks, SlotLayout, image_groups
from engine.pinned_arena import PinnedArena

CUDA_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the map is PROT_READ
ENGINE = "engine: + 80 MB image to GPU"


@dataclasses.dataclass
class Upload:
    """One adapter file and the buffers every path reuses."""

    path: Path
    data_start: int  # where the tensors begin (after the safetensors header)
    size: int  # bytes of tensor data
    pinned: torch.Tensor  # page-locked, `size` bytes
    gpu_raw: torch.Tensor  # `size` bytes on the GPU
    gpu_bf16: torch.Tensor
    side: torch.cuda.Stream

    def convert_and_check(self) -> None:
        """The raw fp32 bytes on the GPU turned bf16 and checked finite, as a fill would, then waited for."""
        torch.cuda.current_stream().wait_stream(self.side)
        self.gpu_bf16.copy_(self.gpu_raw.view(torch.float32))
        if not bool(torch.isfinite(self.gpu_bf16).all()):
            raise AssertionError("the uploaded adapter is not finite")
        torch.cuda.synchronize()


def pread_threads(up: Upload, pool: ThreadPoolExecutor, threads: int, copy_each: bool) -> tuple[float, float]:
    """Seconds until the host holds the bytes, and until the GPU holds them converted."""
    fd = os.open(up.path, os.O_RDONLY)
    view = up.pinned.numpy().data
    lock = threading.Lock()

    def share(i: int) -> None:
        lo, hi = up.size * i // threads // 4 * 4, up.size * (i + 1) // threads // 4 * 4
        done = lo
        while done < hi:
            read = os.preadv(fd, [view[done:hi]], up.data_start + done)
            if read == 0:
                raise EOFError(f"{up.path} ended early")
            done += read
        if copy_each:
            with lock, torch.cuda.stream(up.side):
                up.gpu_raw[lo:hi].copy_(up.pinned[lo:hi], non_blocking=True)

    try:
        start = time.perf_counter()
        list(pool.map(share, range(threads)))
        read = time.perf_counter()
        if not copy_each:
            with torch.cuda.stream(up.side):
                up.gpu_raw.copy_(up.pinned, non_blocking=True)
        up.convert_and_check()
        return read - start, time.perf_counter() - start
    finally:
        os.close(fd)


def pageable(up: Upload, pool: ThreadPoolExecutor, streams: int) -> float:
    with up.path.open("rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)
    source = torch.frombuffer(mapped, dtype=torch.uint8)  # (read-only: torch warns, nothing writes it)
    side = [torch.cuda.Stream() for _ in range(streams)]

    def share(i: int, source: torch.Tensor = source) -> None:
        lo, hi = up.size * i // streams // 4 * 4, up.size * (i + 1) // streams // 4 * 4
        with torch.cuda.stream(side[i]):
            up.gpu_raw[lo:hi].copy_(source[up.data_start + lo : up.data_start + hi], non_blocking=True)
        side[i].synchronize()

    start = time.perf_counter()
    list(pool.map(share, range(streams)))
    up.convert_and_check()
    took = time.perf_counter() - start
    del source
    mapped.close()
    return took


def registered(up: Upload) -> tuple[float, float, float]:
    """Seconds to page-lock the file's map, then also to copy and convert, then also to unlock it."""
    start = time.perf_counter()
    with up.path.open("rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)
    source = torch.frombuffer(mapped, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    code = int(cudart.cudaHostRegister(source.data_ptr(), source.numel(), CUDA_HOST_REGISTER_READ_ONLY))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of the file's map failed with CUDA error {code}")
    locked = time.perf_counter()
    with torch.cuda.stream(up.side):
        up.gpu_raw.copy_(source[up.data_start :], non_blocking=True)
    up.convert_and_check()
    copied = time.perf_counter()
    cudart.cudaHostUnregister(source.data_ptr())
    unlocked = time.perf_counter()
    del source
    mapped.close()
    return locked - start, copied - start, unlocked - start


def host_conversion(size: int, threads: int) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    source = torch.ones(size // 4, dtype=torch.float32)
    target = torch.zeros(size // 4, dtype=torch.bfloat16)
    start = time.perf_counter()
    target.copy_(source)
    took = time.perf_counter() - start
    torch.set_num_threads(before)
    return took


def device_loader_phases(folder: Path, spec: AdapterSpec, layout: SlotLayout, arena: PinnedArena, rounds: int) -> None:
    """Where one `DeviceLoader` load's time goes, the device waited for after each phase, per reading threads
    and chunk size: the header read and the plan (reused: the file's layout is the last one's), the reads with
    their copies to the GPU, the placement, the host image's copy back, the device image's clone; then one whole
    `submit` (the phases without the waits in between). Medians of `rounds` after two warm-up loads, in ms."""
    device = torch.device("cuda")
    for readers, chunk in ((16, 2 << 20), (16, 4 << 20), (16, 8 << 20), (16, 16 << 20), (8, 4 << 20)):
        threads = ThreadLoader(torch.bfloat16, layout)
        loader = DeviceLoader(threads, torch.bfloat16, layout, device, arena, readers, chunk)
        stream = loader._stream
        assert stream is not None
        times: dict[str, list[float]] = {}
        for i in range(rounds + 2):
            marks = [time.perf_counter()]
            with (folder / WEIGHTS_FILE).open("rb") as handle, torch.cuda.stream(stream):
                found = loader._plan_of(spec, handle)  # (parsed on the first load, reused after)
                assert found is not None
                plan, start = found
                marks.append(time.perf_counter())
                loader._read(handle.fileno(), folder, start, plan.raw)
                stream.synchronize()
                marks.append(time.perf_counter())
                plan.copies.run()
                stream.synchronize()
                marks.append(time.perf_counter())
                host = arena.take(plan.image.numel(), torch.bfloat16)
                assert host is not None
                host.copy_(plan.image, non_blocking=True)
                stream.synchronize()
                marks.append(time.perf_counter())
                clone = plan.image.clone()
                stream.synchronize()
                marks.append(time.perf_counter())
                arena.give_back(host)
                del clone
            whole = time.perf_counter()
            weights = loader.submit(spec).result()
            assert weights.packed is not None
            marks.append(marks[-1] + time.perf_counter() - whole)  # (so the last pair spans the submit alone)
            weights.give_back_host_image(arena)
            if i >= 2:
                names = ("header + plan", "reads + copies to the GPU", "placement", "host image back", "device clone")
                for name, (a, b) in zip((*names, "one whole submit"), itertools.pairwise(marks), strict=True):
                    times.setdefault(name, []).append((b - a) * 1e3)
        print(
            f"device loader, {readers} readers, {chunk >> 20} MiB chunks: "
            + ", ".join(f"{name} {statistics.median(values):.2f}" for name, values in times.items())
            + " ms",
            flush=True,
        )
        loader.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--phases-only", action="store_true", help="only where one device loader load's time goes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    arch, folder = llama_7b_adapter_file()
    path = folder / "adapter_model.safetensors"
    raw = path.read_bytes()  # (and so into the page cache)
    (header,) = struct.unpack("<Q", raw[:8])
    size = len(raw) - 8 - header
    print(f"{torch.cuda.get_device_name()}; file {len(raw) / 2**20:.1f} MiB; {os.cpu_count()} cores", flush=True)
    del raw
    device = torch.device("cuda")
    up = Upload(
        path,
        8 + header,
        size,
        torch.empty(size, dtype=torch.uint8, pin_memory=True),
        torch.empty(size, dtype=torch.uint8, device=device),
        torch.empty(size // 4, dtype=torch.bfloat16, device=device),
        torch.cuda.Stream(),
    )
    pools = {n: ThreadPoolExecutor(n) for n in (4, 8, 16)}

    layout = LoRAStacks(arch, 1, 16, torch.bfloat16, torch.device("cpu"), fused=True).layout
    assert layout is not None
    spec = read_spec(folder, arch, 16)
    image_bytes = layout.image_size(image_groups(spec.modules), 16) * 2
    arena = PinnedArena(image_bytes + (8 << 20))
    if args.phases_only:
        device_loader_phases(folder, spec, layout, arena, args.rounds)
        return
    loader = ProcessLoader(torch.bfloat16, layout, 8, arena)
    gpu_image = torch.empty(image_bytes // 2, dtype=torch.bfloat16, device=device)

    def load_and_upload(way: AdapterLoader) -> tuple[float, float]:
        """Seconds until `way` has loaded the host image, and until the image is on the GPU."""
        start = time.perf_counter()
        weights = way.submit(spec).result()
        image = weights.packed
        assert image is not None
        packed = time.perf_counter()
        with torch.cuda.stream(up.side):
            if weights.host_ready is not None:  # (the device loader's copy back may still run)
                up.side.wait_event(weights.host_ready)
            gpu_image.copy_(image, non_blocking=True)
        up.side.synchronize()
        arena.give_back(image)
        return packed - start, time.perf_counter() - start

    times: dict[str, list[float]] = {}

    def note(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds * 1e3)

    def engine_path() -> None:
        packed, uploaded = load_and_upload(loader)
        note("engine: 8 loader processes pack bf16 (host)", packed)
        note(ENGINE, uploaded)

    device_loaders = {
        n: DeviceLoader(ThreadLoader(torch.bfloat16, layout), torch.bfloat16, layout, device, arena, readers=n)
        for n in (8, 16)
    }

    def device_path(readers: int) -> None:
        loaded, uploaded = load_and_upload(device_loaders[readers])
        note(f"device loader, {readers} readers (host image)", loaded)
        note(f"device loader, {readers} readers + 80 MB image to GPU", uploaded)

    def pread_path(threads: int, copy_each: bool) -> None:
        read, uploaded = pread_threads(up, pools[threads], threads, copy_each)
        if copy_each:
            note(f"pread {threads} threads, each share copied as read, + convert", uploaded)
        else:
            note(f"pread {threads} threads (host)", read)
            note(f"pread {threads} threads + copy + convert on GPU", uploaded)

    def register_path() -> None:
        locked, copied, unlocked = registered(up)
        note("file map page-locked (cudaHostRegister)", locked)
        note("+ copy + convert", copied)
        note("+ unlock", unlocked)

    paths: list[Callable[[], None]] = [
        engine_path,
        functools.partial(device_path, 8),
        functools.partial(device_path, 16),
    ]
    paths += [functools.partial(pread_path, t, each) for t in (4, 8, 16) for each in (False, True)]
    paths += [
        functools.partial(
            lambda s: note(f"pageable copy from the file's map, {s} streams, + convert", pageable(up, pools[8], s)), s
        )
        for s in (1, 8)
    ]
    paths.append(register_path)
    paths += [
        functools.partial(
            lambda t: note(f"host fp32 -> bf16 of 160 MB, {t} torch threads", host_conversion(size, t)), t
        )
        for t in (1, 8, 16)
    ]

    for run in paths:  # warm-up: worker processes, CUDA contexts, page-locked staging
        run()
    times.clear()
    for _ in range(args.rounds):
        for run in paths:
            run()
    for name, values in times.items():
        print(
            f"{name:58s} median {statistics.median(values):7.2f} ms  (min {min(values):6.2f}, max {max(values):6.2f})"
        )
    engine = statistics.median(times[ENGINE])
    for threads in (8, 16):
        name = f"pread {threads} threads, each share copied as read, + convert"
        print(f"{name} / the engine's way: {statistics.median(times[name]) / engine:.2f}x")
    for readers in (8, 16):
        name = f"device loader, {readers} readers + 80 MB image to GPU"
        print(f"{name} / the engine's way: {statistics.median(times[name]) / engine:.2f}x")
    for device_loader in device_loaders.values():
        device_loader.close()
    loader.close()
    arena.close()


if __name__ == "__main__":
    main()
