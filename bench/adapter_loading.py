"""How much adapter loads stall the engine's step loop: loader threads vs loader processes, side by side.

  python bench/adapter_loading.py [--adapters 8] [--rounds 3]

The step loop is stood in for by a loop of short torch calls on the main thread, about what a GPU engine's
Python step loop does between graph replays. Each round runs it idle, then while `--adapters`
SmolLM2-135M-shaped adapters (rank 16 on all seven projections, fp32 files of ~20 MB) load through the
engine's `ThreadLoader`, its `ProcessLoader` handing results back, and its `ProcessLoader` writing into a
shared arena (a GPU engine's default), packed into the slot layout like a GPU engine's loads. It prints the
longest and p99 gap between loop iterations in each phase; the ratios in the summary compare phases of the
same rounds.

Then the time of one load on its own (what a hot swap waits for), into the shared arena: split over
`--workers` loader processes by layers (the engine's way) against one process doing the whole adapter,
alternating, side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from gateway_rest import percentile  # a sibling script (bench/ is this script's sys.path entry)

from engine.adapter_loader import AdapterLoader, ProcessLoader, ThreadLoader
from engine.adapters import read_spec
from engine.config import EngineConfig, ModelArch
from engine.lora import LoRAStacks
from engine.pinned_arena import PinnedArena
from tests.unit.engine.tiny import write_adapter

SMOLLM2 = ModelArch("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e5, 1e-5, 2048, True, False)
ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="loading-"))
    layout = LoRAStacks(SMOLLM2, 1, 16, torch.bfloat16, torch.device("cpu"), fused=True).layout
    # The arena is page-locked only where a GPU engine would pin it.
    arena = PinnedArena(512 << 20, pin=torch.cuda.is_available())
    loaders: dict[str, AdapterLoader] = {
        "threads": ThreadLoader(torch.bfloat16, layout),
        "processes": ProcessLoader(torch.bfloat16, layout),
        "shared": ProcessLoader(torch.bfloat16, layout, args.workers, arena),
    }
    phases = ("idle", *loaders)
    seed = 0

    def specs(n: int) -> list:  # type: ignore[type-arg]
        nonlocal seed
        out = []
        for _ in range(n):
            seed += 1
            folder = write_adapter(tmp / f"a{seed}", arch=SMOLLM2, rank=16, alpha=16, modules=ALL7, seed=seed)
            out.append(read_spec(folder, SMOLLM2, 16))
        return out

    def load_all(loader: AdapterLoader, batch: list) -> None:  # type: ignore[type-arg]
        for future in [loader.submit(s) for s in batch]:
            image = future.result().packed
            if image is not None:
                arena.give_back(image)  # (False for images outside the arena)

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
    med = statistics.median
    print("\n== summary ==")
    longest = ", ".join(f"{phase} {med(worst[phase]) * 1e3:.1f} ms" for phase in phases)
    ratios = ", ".join(
        f"{phase}/threads {med(worst[phase]) / med(worst['threads']):.2f}x "
        f"(p99 {med(p99s[phase]) / med(p99s['threads']):.2f}x)"
        for phase in ("processes", "shared")
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


if __name__ == "__main__":
    main()
