"""What a loader part's time goes to: one adapter split over loader processes, each part done several ways.

  PYTHONPATH=. python3 bench/loader_parts.py [--workers 8] [--rounds 10]

The adapter: all 32 layers of a Llama-7B-shaped PEFT adapter, rank 16 on all seven projections (an fp32 file of
153 MiB, in the page cache). `--workers` one-process executors (as `ProcessLoader`'s) each take one contiguous
share of the layers, into one shared arena (page-locked where CUDA is present), all submitted at once. Each
round times every variant of a part, in turn:

- the engine's (`load_layers_into`): the file memory-mapped, packed into a bf16 image, checked finite;
- the same, each layer checked right after it is packed (while it is still in the CPU's caches);
- the same without the finite check;
- each tensor read with `os.preadv` straight into its place in an fp32 image (no conversion), checked after;
- the same, each run of tensors checked right after it is read;
- the same without the check.

It prints, per variant, the median time of a load (submit to the last part's end), of a part inside its worker,
and of the spread of the parts' starts, then each variant's load against the engine's, as a ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.adapter_loading import ALL7, LLAMA_7B_16
from bench.scratch import scratch_dir
from engine.adapter_loader import layer_parts
from engine.adapters import (
    _KEY,
    WEIGHTS_FILE,
    AdapterSpec,
    _float_dtype,
    _mapped_layers,
    all_finite,
    load_adapter,
    load_layers_into,
    pair_tensors,
    read_spec,
)
from engine.lora import LayerCopies, LoRAStacks, SlotLayout, image_groups, member_places
from engine.pinned_arena import PinnedArena, attach, map_arena
from tests.unit.engine.tiny import write_adapter

ENGINE = "engine: map, pack bf16, check"
VARIANTS = (
    ENGINE,
    "engine's, each layer checked as packed",
    "engine's, no check",
    "preadv into fp32, checked after",
    "preadv into fp32, each run checked as read",
    "preadv into fp32, no check",
)
ARCH = dataclasses.replace(LLAMA_7B_16, num_layers=32)


@dataclasses.dataclass(frozen=True)
class Job:
    """What every part needs, sent once to each worker."""

    spec: AdapterSpec
    layout: SlotLayout
    arena: str


_job: Job | None = None


def _start_worker(job: Job) -> None:
    global _job
    torch.set_num_threads(1)
    map_arena(job.arena)
    _job = job


def part(variant: str, layers: range) -> tuple[float, float]:
    """In a worker: `layers` of the adapter, done as `variant`; the part's start and end."""
    assert _job is not None
    spec, layout = _job.spec, _job.layout
    groups = image_groups(spec.modules)
    start = time.perf_counter()
    if variant.startswith("engine"):
        image = attach(_job.arena, 0, layout.image_size(groups, spec.rank), torch.bfloat16)
        if variant == ENGINE:
            load_layers_into(spec, torch.bfloat16, layout, image, layers)
        else:
            tensors = pair_tensors(spec.path, _mapped_layers(spec.path, layout.num_layers, layers))
            if "each layer" in variant:
                for layer in layers:
                    spans = LayerCopies.of(layout, image, groups, spec.rank, tensors, range(layer, layer + 1)).run()
                    if not all(all_finite(span) for span in spans):
                        raise ValueError("not finite")
            else:
                LayerCopies.of(layout, image, groups, spec.rank, tensors, layers).run()
    else:
        image = attach(_job.arena, 0, layout.image_size(groups, spec.rank), torch.float32)
        read_into(spec, layout, image, layers, check="checked after" if "after" in variant else variant)
    return start, time.perf_counter()


def read_into(spec: AdapterSpec, layout: SlotLayout, image: torch.Tensor, layers: range, check: str) -> None:
    """Each tensor of `layers` read straight into its place in `image` (the file's dtype), one `preadv` per
    run of tensors that lie back to back in the file."""
    from safetensors import safe_open

    places: dict[tuple[int, str, str], torch.Tensor] = {}
    groups = image_groups(spec.modules)
    for layer, module, a, b in member_places(layout, groups, layout.images(image, groups, spec.rank), layers):
        places[(layer, module, "A")], places[(layer, module, "B")] = a, b
    path = spec.path / WEIGHTS_FILE
    with safe_open(str(path), framework="pt") as f:
        entries = [(name, f.get_slice(name)) for name in f.offset_keys()]
    shapes = [(name, _float_dtype(spec.path, name, s.get_dtype()), s.get_shape()) for name, s in entries]
    sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in shapes]
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = os.fstat(fd).st_size - sum(sizes)
        buffer = image.view(torch.uint8).numpy().data
        base = image.data_ptr()
        runs: list[tuple[int, int, list[memoryview], list[torch.Tensor]]] = []
        for (name, _, _), size in zip(shapes, sizes, strict=True):
            match = _KEY.match(name)
            assert match is not None
            if int(match[1]) in layers:
                place = places[(int(match[1]), match[2], match[3])]
                at = place.data_ptr() - base
                if runs and runs[-1][0] + runs[-1][1] == offset:
                    start, length, buffers, tensors = runs[-1]
                    runs[-1] = (start, length + size, [*buffers, buffer[at : at + size]], [*tensors, place])
                else:
                    runs.append((offset, size, [buffer[at : at + size]], [place]))
            offset += size
        finite = True
        for start, length, buffers, tensors in runs:
            if os.preadv(fd, buffers, start) != length:
                raise EOFError(f"{path} ended early")
            if "each run" in check:
                finite &= all(all_finite(t) for t in tensors)
        if check == "checked after":
            finite &= all(all_finite(t) for run in runs for t in run[3])
        if not finite:
            raise ValueError("not finite")
    finally:
        os.close(fd)


def check_image(spec: AdapterSpec, layout: SlotLayout, arena: PinnedArena) -> None:
    """The fp32 image the preadv parts wrote is the engine's packing of the file, bit for bit."""
    expected = load_adapter(spec, torch.float32, pin=False, layout=layout).packed
    assert expected is not None
    written = attach(arena.name, 0, expected.numel(), torch.float32)
    if not torch.equal(written, expected):
        raise AssertionError("the parts read into the fp32 image are not the file's tensors in their places")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU draws the 160 MB of weights faster
    folder = write_adapter(
        scratch_dir("loader-parts-") / "a", arch=ARCH, rank=16, alpha=16, modules=ALL7, seed=9, device=device
    )
    spec = read_spec(folder, ARCH, 16)
    layout = LoRAStacks(ARCH, 1, 16, torch.bfloat16, torch.device("cpu"), fused=True).layout
    assert layout is not None
    fp32_bytes = layout.image_size(image_groups(spec.modules), 16) * 4
    arena = PinnedArena(fp32_bytes + (8 << 20), pin=torch.cuda.is_available())
    job = Job(spec, layout, arena.name)
    spawn = multiprocessing.get_context("spawn")
    workers = [
        ProcessPoolExecutor(1, mp_context=spawn, initializer=_start_worker, initargs=(job,))
        for _ in range(args.workers)
    ]
    shares = layer_parts(ARCH.num_layers, args.workers)
    loads: dict[str, list[float]] = {v: [] for v in VARIANTS}
    inside: dict[str, list[float]] = {v: [] for v in VARIANTS}
    spread: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for round_ in range(args.rounds + 1):  # the first round starts the workers, untimed
            for variant in VARIANTS:
                start = time.perf_counter()
                futures = [w.submit(part, variant, layers) for w, layers in zip(workers, shares, strict=False)]
                parts = [future.result() for future in futures]
                took = time.perf_counter() - start
                if not round_ and variant == VARIANTS[-1]:
                    check_image(spec, layout, arena)
                if round_:
                    loads[variant].append(took * 1e3)
                    inside[variant].append(statistics.median(end - begin for begin, end in parts) * 1e3)
                    spread[variant].append((max(b for b, _ in parts) - min(b for b, _ in parts)) * 1e3)
    finally:
        for w in workers:
            w.shutdown()
        arena.close()
    print(f"{args.workers} processes, {len(shares)} parts, {os.cpu_count()} cores; medians of {args.rounds} rounds")
    for variant in VARIANTS:
        print(
            f"{variant:44s} load {statistics.median(loads[variant]):6.2f} ms; part in its worker "
            f"{statistics.median(inside[variant]):6.2f} ms; starts spread {statistics.median(spread[variant]):5.2f} ms"
        )
    engine = statistics.median(loads[ENGINE])
    for variant in VARIANTS[1:]:
        print(f"{variant} / the engine's: {statistics.median(loads[variant]) / engine:.3f}x")


if __name__ == "__main__":
    main()
