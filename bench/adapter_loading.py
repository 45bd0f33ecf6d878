"""How much adapter loads stall the engine's step loop: loader threads vs loader processes, side by side.

  python bench/adapter_loading.py [--adapters 8] [--rounds 3]

The step loop is stood in for by a loop of short torch calls on the main thread, about what a GPU engine's
Python step loop does between graph replays. Each round runs it idle, then while `--adapters`
SmolLM2-135M-shaped adapters (rank 16 on all seven projections, fp32 files of ~20 MB) load through the
engine's `ThreadLoader`, its `ProcessLoader` handing results back, its `ProcessLoader` writing into a
shared arena (`--adapter-loader process` on a GPU), and its `DeviceLoader` (a GPU engine's default: threads
of this process read the files, the GPU converts and places them; without a GPU the CPU does), packed into
the slot layout like a GPU engine's loads.
It prints the longest and p99 gap between loop iterations in each phase; the ratios in the summary compare
phases of the same rounds.

Then the time of one load on its own (what a hot swap waits for), into the shared arena: split over
`--workers` loader processes by layers (the engine's way with `--adapter-loader process`) against one process
doing the whole adapter, alternating, side by side.

Last, one load at a time into extents that no loader process has written before (as the host tier of a
running engine fills its arena before any extent comes back): loader processes that mapped the arena with its
page tables filled as they started (the engine's way since stop 28) against ones that map it lazily and take a
page fault at each first write (before), alternating. `--fault-shape llama-7b` loads 16 Llama-7B-shaped layers
(the goals' dimensions, 40 MB slot images) instead of SmolLM2's 30.

Then one load of all 32 layers of a Llama-7B adapter split over `--workers` processes, each with a queue of
its own (the engine's way since stop 33) against one queue that all of them share (before), alternating: the
time of the load and the spread of its parts' starts inside the workers (`--dispatch-only` runs just this).

And the packing of one loader part on one core: 4 of a 32-layer Llama-7B adapter's layers (what each of 8
processes packs), B kept as the file stores it ([out, rank], the engine's image layout since stop 32) against
B turned rank-major on the CPU (the layout before), alternating.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.percentiles import percentile  # (not from gateway_rest: it imports grpc)
from bench.scratch import scratch_dir
from engine.adapter_device_loader import DeviceLoader
from engine.adapter_loader import AdapterLoader, ProcessLoader, ThreadLoader, _started, _worker_init, fill_layers
from engine.adapters import _mapped_layers, pair_tensors, read_spec
from engine.config import EngineConfig, ModelArch
from engine.lora import PROJECTION_GROUPS, LayerCopies, LoRAStacks, SlotLayout, image_groups
from engine.pinned_arena import PinnedArena
from tests.unit.engine.tiny import write_adapter

SMOLLM2 = ModelArch("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e5, 1e-5, 2048, True, False)
LLAMA_7B_16 = ModelArch("llama", 49152, 4096, 11008, 16, 32, 32, 128, 1e4, 1e-5, 2048, False, False)
ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_7b_adapter_file() -> tuple[ModelArch, Path]:
    """All 32 layers of a Llama-7B-shaped PEFT adapter (rank 16 on all seven projections, fp32: 153 MiB), drawn
    on the GPU and written to a temporary folder: its architecture and the folder. The upload benches read its
    weights file once first, so that it sits in the page cache as a new version's file does."""
    arch = dataclasses.replace(LLAMA_7B_16, num_layers=32)
    folder = write_adapter(
        scratch_dir("loading-") / "a", arch=arch, rank=16, alpha=16, modules=ALL7, seed=9, device="cuda"
    )
    return arch, folder


def gaps_while(work: threading.Thread | None, seconds: float) -> list[float]:
    """Gaps between iterations of a loop of small torch calls, while `work` runs (or for `seconds`)."""
    x = torch.randn(64, 64)
    gaps: list[float] = []
    last = time.perf_counter()
    if work is not None:
        work.start()
    end = time.perf_counter() + seconds
    while (work.is_alive() if work is not None else time.perf_counter() < end) or len(gaps) < 10:
        for _ in range(20):
            x = torch.tanh(x @ x)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    return gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=EngineConfig().loader_workers(), help="default: the engine's")
    ap.add_argument("--single-loads", type=int, default=20, help="loads timed one at a time, per loader")
    ap.add_argument("--fault-loads", type=int, default=10, help="loads into new extents, per loader")
    ap.add_argument("--fault-shape", choices=("smollm2", "llama-7b"), default="smollm2")
    ap.add_argument("--pack-rounds", type=int, default=20, help="packings of one loader part timed, per layout")
    ap.add_argument("--pack-only", action="store_true", help="only the packing of one loader part")
    ap.add_argument("--dispatch-loads", type=int, default=12, help="split loads timed, per queue layout")
    ap.add_argument("--dispatch-only", action="store_true", help="only the split loads, per-worker vs shared queue")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = scratch_dir("loading-")
    if args.pack_only:
        report_packing(args, pack_b_layouts(tmp, args.pack_rounds))
        return
    if args.dispatch_only:
        report_dispatch(args, split_loads_by_queue(args, tmp))
        return
    layout = LoRAStacks(SMOLLM2, 1, 16, torch.bfloat16, torch.device("cpu"), fused=True).layout
    assert layout is not None
    # The arena is page-locked only where a GPU engine would pin it.
    arena = PinnedArena(512 << 20, pin=torch.cuda.is_available())
    loaders: dict[str, AdapterLoader] = {
        "threads": ThreadLoader(torch.bfloat16, layout),
        "processes": ProcessLoader(torch.bfloat16, layout),
        "shared": ProcessLoader(torch.bfloat16, layout, args.workers, arena),
        # Threads of this process read the files; the GPU (or, without one, the CPU) converts and places them.
        "device": DeviceLoader(
            ThreadLoader(torch.bfloat16, layout),
            torch.bfloat16,
            layout,
            torch.device("cuda" if torch.cuda.is_available() else "cpu"),
            arena,
            EngineConfig().reader_threads(),
        ),
    }
    phases = ("idle", *loaders)
    seed = 0

    def specs(n: int, arch: ModelArch = SMOLLM2) -> list:  # type: ignore[type-arg]
        nonlocal seed
        out = []
        for _ in range(n):
            seed += 1
            folder = write_adapter(tmp / f"a{seed}", arch=arch, rank=16, alpha=16, modules=ALL7, seed=seed)
            out.append(read_spec(folder, arch, 16))
        return out

    def load_all(loader: AdapterLoader, batch: list) -> None:  # type: ignore[type-arg]
        for future in [loader.submit(s) for s in batch]:
            future.result().give_back_host_image(arena)  # (False for images outside the arena)

    for loader in loaders.values():  # start workers, first imports
        load_all(loader, specs(2))
    worst: dict[str, list[float]] = {phase: [] for phase in phases}
    p99s: dict[str, list[float]] = {phase: [] for phase in phases}
    for _ in range(args.rounds):
        for phase in phases:
            batch = specs(args.adapters)
            work = None
            if phase != "idle":
                work = threading.Thread(target=load_all, args=(loaders[phase], batch))
            gaps = sorted(gaps_while(work, seconds=0.5))
            worst[phase].append(gaps[-1])
            p99s[phase].append(percentile(gaps, 0.99))
            print(
                f"{phase:9s}: longest gap {gaps[-1] * 1e3:7.2f} ms, p99 {p99s[phase][-1] * 1e3:6.2f} ms, "
                f"median {statistics.median(gaps) * 1e3:.2f} ms",
                flush=True,
            )
    whole = ProcessLoader(torch.bfloat16, layout, 1, arena)
    load_all(whole, specs(2))
    single: dict[str, list[float]] = {"split": [], "whole": []}
    for spec in specs(args.single_loads):  # the same file for both, alternating: one in the page cache
        for name, loader in (("split", loaders["shared"]), ("whole", whole)):
            start = time.perf_counter()
            load_all(loader, [spec])
            single[name].append(time.perf_counter() - start)
    whole.close()
    for loader in loaders.values():
        loader.close()
    arena.close()
    faults = loads_into_new_extents(args, specs)
    packing = pack_b_layouts(tmp, args.pack_rounds)
    med = statistics.median
    print("\n== summary ==")
    longest = ", ".join(f"{phase} {med(worst[phase]) * 1e3:.1f} ms" for phase in phases)
    ratios = ", ".join(
        f"{phase}/threads {med(worst[phase]) / med(worst['threads']):.2f}x "
        f"(p99 {med(p99s[phase]) / med(p99s['threads']):.2f}x)"
        for phase in ("processes", "shared", "device")
    )
    print(
        f"step-loop stall while {args.adapters} adapters load (median of {args.rounds} rounds): longest gap {longest}"
    )
    print(f"  {ratios}")
    split, one = med(single["split"]), med(single["whole"])
    print(
        f"one load on its own (median of {args.single_loads}): split over {args.workers} processes by layers "
        f"{split * 1e3:.1f} ms, one process {one * 1e3:.1f} ms: {split / one:.2f}x"
    )
    populated, lazy = med(faults["populated"]), med(faults["lazy"])
    print(
        f"one {args.fault_shape} load into new extents (median of {args.fault_loads}, {args.workers} processes): "
        f"arena mapped populated {populated * 1e3:.1f} ms, lazily {lazy * 1e3:.1f} ms: {populated / lazy:.2f}x"
    )
    report_packing(args, packing)
    report_dispatch(args, split_loads_by_queue(args, tmp))


def report_dispatch(args: argparse.Namespace, times: dict[str, tuple[list[float], list[float]]]) -> None:
    med = statistics.median
    (own, own_spread), (shared, shared_spread) = times["own queues"], times["shared queue"]
    print(
        f"one load of 32 Llama-7B layers split over {args.workers} processes (median of {args.dispatch_loads}): "
        f"a queue per worker {med(own) * 1e3:.1f} ms, one shared queue {med(shared) * 1e3:.1f} ms: "
        f"{med(own) / med(shared):.2f}x; the parts' starts spread over {med(own_spread) * 1e3:.1f} against "
        f"{med(shared_spread) * 1e3:.1f} ms"
    )


class SharedQueueLoader(ProcessLoader):
    """The dispatch of stops 19-32, for comparison: `workers` processes of one executor, sharing its queue."""

    def __init__(self, dtype: torch.dtype, layout: SlotLayout, workers: int, arena: PinnedArena) -> None:
        super().__init__(dtype, layout, 0, arena)
        self._workers = workers
        self._shared = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
            initargs=(arena.name, True),
        )
        for _ in range(workers):
            self._shared.submit(_started)

    def _run(self, fn: Callable[..., object], *args: object, worker: int | None = None) -> Future[object]:  # type: ignore[override]
        return self._shared.submit(fn, *args)

    def _least_busy(self) -> list[int]:
        return list(range(self._workers))

    def close(self) -> None:
        self._shared.shutdown(wait=False, cancel_futures=True)


def split_loads_by_queue(args: argparse.Namespace, tmp: Path) -> dict[str, tuple[list[float], list[float]]]:
    """Per queue layout: seconds per load of one 32-layer Llama-7B adapter split over `args.workers` processes,
    and the spread of its parts' starts inside the workers (`fill_layers` returns its start); alternating,
    the same file for both."""
    arch = dataclasses.replace(LLAMA_7B_16, num_layers=32)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU draws the 160 MB of weights faster
    folder = write_adapter(tmp / "dispatch", arch=arch, rank=16, alpha=16, modules=ALL7, seed=9, device=device)
    spec = read_spec(folder, arch, 16)
    layout = LoRAStacks(arch, 1, 16, torch.bfloat16, torch.device("cpu"), fused=True).layout
    assert layout is not None
    image_bytes = layout.image_size(image_groups(spec.modules), 16) * 2
    arena = PinnedArena(image_bytes + (8 << 20), pin=torch.cuda.is_available())
    loaders: dict[str, ProcessLoader] = {
        "own queues": ProcessLoader(torch.bfloat16, layout, args.workers, arena),
        "shared queue": SharedQueueLoader(torch.bfloat16, layout, args.workers, arena),
    }
    parts: list[Future[object]] = []
    for loader in loaders.values():
        run = loader._run

        def traced(fn: Callable[..., object], *a: object, run=run, **kw: object) -> Future[object]:  # type: ignore[no-untyped-def]
            future = run(fn, *a, **kw)
            if fn is fill_layers:
                parts.append(future)
            return future

        loader._run = traced  # type: ignore[method-assign,assignment]
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in loaders}
    for i in range(args.dispatch_loads + 1):  # the first load of each warms its workers up, untimed
        for name, loader in loaders.items():
            parts.clear()
            start = time.perf_counter()
            weights = loader.submit(spec).result()
            took = time.perf_counter() - start
            assert weights.give_back_host_image(arena)
            starts = [part.result()[0] for part in parts]  # type: ignore[index]
            if i:
                times[name][0].append(took)
                times[name][1].append(max(starts) - min(starts))
    for loader in loaders.values():
        loader.close()
    arena.close()
    return times


def report_packing(args: argparse.Namespace, packing: dict[str, list[float]]) -> None:
    out_major, rank_major = statistics.median(packing["out-major"]), statistics.median(packing["rank-major"])
    print(
        f"packing 4 of 32 Llama-7B layers on one core (median of {args.pack_rounds}): B out-major (the engine's) "
        f"{out_major * 1e3:.2f} ms, rank-major (before) {rank_major * 1e3:.2f} ms: {out_major / rank_major:.2f}x"
    )


def _pack_rank_major(
    layout: SlotLayout,
    image: torch.Tensor,
    groups: tuple[str, ...],
    rank: int,
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    layers: range,
) -> None:
    """The packing of stops 19-31, for comparison: each B converted, then copied transposed into a rank-major
    image ([layers, rank, out] per group)."""
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for group, (a_img, b_out_major) in zip(groups, layout.images(image, groups, rank), strict=True):
        b_img = b_out_major.view(layout.num_layers, rank, -1)  # the same span, read rank-major
        for layer in layers:
            n0 = 0
            for i, (module, width) in enumerate(zip(PROJECTION_GROUPS[group], layout.group_slices[group], strict=True)):
                a, b = tensors[(layer, module)]
                dst += [a_img[layer, i], b_img[layer, :, n0 : n0 + width].t()]
                src += [a, b.to(image.dtype)]
                n0 += width
    torch._foreach_copy_(dst, src)


def pack_b_layouts(tmp: Path, rounds: int) -> dict[str, list[float]]:
    """Seconds to pack one loader part (4 of 32 Llama-7B layers, rank 16, all seven projections, from the file's
    memory map into bf16) with B out-major (`LayerCopies`) and rank-major (`_pack_rank_major`), alternating."""
    arch = dataclasses.replace(LLAMA_7B_16, num_layers=32)
    folder = write_adapter(tmp / "pack", arch=arch, rank=16, alpha=16, modules=ALL7, seed=7)
    layout = LoRAStacks(arch, 1, 16, torch.bfloat16, torch.device("cpu"), fused=True).layout
    assert layout is not None
    groups = image_groups(ALL7)
    image = torch.empty(layout.image_size(groups, 16), dtype=torch.bfloat16)
    layers = range(4, 8)
    tensors = pair_tensors(folder, _mapped_layers(folder, arch.num_layers, layers))
    packers: dict[str, Callable[[], object]] = {
        "out-major": lambda: LayerCopies.of(layout, image, groups, 16, tensors, layers).run(),
        "rank-major": lambda: _pack_rank_major(layout, image, groups, 16, tensors, layers),
    }
    times: dict[str, list[float]] = {name: [] for name in packers}
    for i in range(rounds + 1):  # the first round warms the page cache and the allocator, untimed
        for name, pack in packers.items():
            start = time.perf_counter()
            pack()
            if i:
                times[name].append(time.perf_counter() - start)
    return times


def loads_into_new_extents(args: argparse.Namespace, specs: Callable[..., list]) -> dict[str, list[float]]:  # type: ignore[type-arg]
    """Seconds per load, each into an extent no loader process wrote before, by workers that mapped the arena
    populated at start and by workers that map it lazily; alternating, the same file for both."""
    arch = LLAMA_7B_16 if args.fault_shape == "llama-7b" else SMOLLM2
    layout = LoRAStacks(arch, 1, 16, torch.bfloat16, torch.device("cpu"), fused=True).layout
    assert layout is not None
    batch = specs(args.fault_loads + 1, arch)
    image_bytes = layout.image_size(image_groups(batch[0].modules), 16) * 2
    arena = PinnedArena(2 * len(batch) * (image_bytes + (1 << 20)), pin=torch.cuda.is_available())
    # Every page of the segment exists first, as a pinned arena's do: only the mapping's page tables differ.
    everything = arena.take(arena.pages * arena.page_bytes, torch.uint8)
    assert everything is not None
    everything.fill_(0)
    arena.give_back(everything)
    loaders = {
        "populated": ProcessLoader(torch.bfloat16, layout, args.workers, arena),
        "lazy": ProcessLoader(torch.bfloat16, layout, args.workers, arena, populate_arena=False),
    }
    times: dict[str, list[float]] = {name: [] for name in loaders}
    for i, spec in enumerate(batch):  # the first load of each warms its workers up, untimed
        for name, loader in loaders.items():
            start = time.perf_counter()
            loader.submit(spec).result()  # its extent is kept: the next load's is new
            if i:
                times[name].append(time.perf_counter() - start)
    for loader in loaders.values():
        loader.close()
    arena.close()
    return times


if __name__ == "__main__":
    main()
