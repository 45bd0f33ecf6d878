"""What one read chunk of an adapter load costs, side by side (a diagnostic for the device loader's chunk size).

  PYTHONPATH=. python3 bench/read_chunk_costs.py [--rounds 8] [--threads 16]

The file: all 32 layers of a Llama-7B-shaped PEFT adapter, rank 16 on all seven projections, fp32 (153 MiB),
read once before timing so that it sits in the page cache. `--threads` threads `os.preadv` it into one
page-locked buffer and copy it to the GPU on a side stream, in these ways:

- one copy of the whole buffer alone, and the reads alone (one share per thread, and 1, 2 and 4 MiB pieces):
  the two floors;
- each thread's share read whole, then copied;
- 1, 2 and 4 MiB pieces, each copied as soon as it is read: with the side stream set once per thread (the
  executor's initializer, as `DeviceLoader` does since stop 38), entered per piece (`torch.cuda.stream`, as it
  did per chunk before), or set once with a new event recorded per piece (as it records one per chunk);
- `DeviceLoader._read` itself at 2 and 16 MiB chunks.

It prints the median (and min) of `--rounds` runs after two warm-ups, in ms, and each way of pieces against
the loader's default chunks. Needs CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.adapter_loading import llama_7b_adapter_file
from engine.adapter_device_loader import CHUNK_BYTES, DeviceLoader
from engine.adapter_loader import ThreadLoader
from engine.adapters import WEIGHTS_FILE, read_spec
from engine.lora import LoRAStacks
from engine.pinned_arena import PinnedArena

PIECES_MIB = (1, 2, 4)


@dataclasses.dataclass
class Reading:
    """The file, the page-locked buffer it is read into and the device buffer it is copied to."""

    path: Path
    size: int
    staging: torch.Tensor
    device_raw: torch.Tensor
    side: torch.cuda.Stream
    threads: int
    stream_set: ThreadPoolExecutor  # threads whose current stream is `side`, set once
    plain: ThreadPoolExecutor  # threads on the default stream, entering `side` per piece

    def pieces(self, piece: int) -> list[list[tuple[int, int]]]:
        """Each thread's share of the file, a contiguous range, cut into `piece`-byte pieces."""
        shares = []
        for i in range(self.threads):
            lo, hi = self.size * i // self.threads, self.size * (i + 1) // self.threads
            shares.append([(a, min(hi, a + piece)) for a in range(lo, hi, piece)])
        return shares

    def run(self, fd: int, piece: int, copy: bool, enter_stream: bool = False, new_event: bool = False) -> None:
        """Every thread reads its share a piece at a time (and copies each piece to the device if `copy`)."""
        view = self.staging.numpy().data

        def share(parts: list[tuple[int, int]]) -> None:
            for lo, hi in parts:
                done = lo
                while done < hi:
                    got = os.preadv(fd, [view[done:hi]], done)
                    if got == 0:
                        raise EOFError(f"{self.path} ended early")
                    done += got
                if not copy:
                    continue
                with torch.cuda.stream(self.side) if enter_stream else contextlib.nullcontext():
                    self.device_raw[lo:hi].copy_(self.staging[lo:hi], non_blocking=True)
                if new_event:
                    torch.cuda.Event().record(self.side)

        list((self.plain if enter_stream else self.stream_set).map(share, self.pieces(piece)))
        self.side.synchronize()

    def copy_whole(self, _fd: int) -> None:
        with torch.cuda.stream(self.side):
            self.device_raw.copy_(self.staging, non_blocking=True)
        self.side.synchronize()


def timed(path: Path, rounds: int, way: Callable[[int], None]) -> tuple[float, float]:
    """The median and min of `rounds` runs of `way` on an open `path`, after two warm-ups, in ms."""
    fd = os.open(path, os.O_RDONLY)
    try:
        times = []
        for i in range(rounds + 2):
            start = time.perf_counter()
            way(fd)
            if i >= 2:
                times.append((time.perf_counter() - start) * 1e3)
    finally:
        os.close(fd)
    return statistics.median(times), min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=16)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    arch, folder = llama_7b_adapter_file()
    path = folder / WEIGHTS_FILE
    path.read_bytes()  # into the page cache
    size = path.stat().st_size
    side = torch.cuda.Stream()
    reading = Reading(
        path,
        size,
        torch.empty(size, dtype=torch.uint8, pin_memory=True),
        torch.empty(size, dtype=torch.uint8, device="cuda"),
        side,
        args.threads,
        ThreadPoolExecutor(args.threads, initializer=functools.partial(torch.cuda.set_stream, side)),
        ThreadPoolExecutor(args.threads),
    )
    whole_share = -(-size // args.threads)
    results: dict[str, tuple[float, float]] = {}

    def note(name: str, way: Callable[[int], None]) -> None:
        results[name] = timed(path, args.rounds, way)
        print(f"{name}: {results[name][0]:.2f} ms (min {results[name][1]:.2f})", flush=True)

    print(f"{size / 2**20:.0f} MiB file, {args.threads} threads, medians of {args.rounds} (min)")
    note("one copy of the whole file to the GPU", reading.copy_whole)
    note("reads only, one share per thread", functools.partial(reading.run, piece=whole_share, copy=False))
    for mib in PIECES_MIB:
        note(f"reads only, {mib} MiB pieces", functools.partial(reading.run, piece=mib << 20, copy=False))
    note("one share per thread, then its copy", functools.partial(reading.run, piece=whole_share, copy=True))
    for mib in PIECES_MIB:
        pieces = functools.partial(reading.run, piece=mib << 20, copy=True)
        note(f"{mib} MiB pieces, stream set once", pieces)
        note(f"{mib} MiB pieces, stream entered per piece", functools.partial(pieces, enter_stream=True))
        note(f"{mib} MiB pieces, stream set once, a new event per piece", functools.partial(pieces, new_event=True))

    layout = LoRAStacks(arch, 1, 16, torch.bfloat16, torch.device("cpu"), fused=True).layout
    assert layout is not None
    spec = read_spec(folder, arch, 16)
    arena = PinnedArena(512 << 20)
    for chunk in sorted({2 << 20, CHUNK_BYTES}):
        threads = ThreadLoader(torch.bfloat16, layout)
        loader = DeviceLoader(threads, torch.bfloat16, layout, torch.device("cuda"), arena, args.threads, chunk)
        with path.open("rb") as handle:
            found = loader._plan_of(spec, handle)
        assert found is not None
        plan, start = found

        def loader_read(
            fd: int, loader: DeviceLoader = loader, start: int = start, raw: torch.Tensor = plan.raw
        ) -> None:
            stream = loader._stream
            assert stream is not None
            with torch.cuda.stream(stream):
                loader._read(fd, folder, start, raw)
            stream.synchronize()

        note(f"DeviceLoader._read, {chunk >> 20} MiB chunks", loader_read)
        loader.close()
    arena.close()
    default = results[f"DeviceLoader._read, {CHUNK_BYTES >> 20} MiB chunks"][0]
    reading.stream_set.shutdown()
    reading.plain.shutdown()
    print(f"against DeviceLoader._read's default {CHUNK_BYTES >> 20} MiB chunks, side by side in this run:")
    for name, (median, _) in results.items():
        if "pieces" in name and "reads only" not in name:
            print(f"  {name}: {median / default:.2f}x")


if __name__ == "__main__":
    main()
