"""What a slot fill costs the engine's thread to issue, and the copy stream to run: whole against layered
(`LoRAStacks.layered_fills`), side by side in one run, on CUDA.

A fill is issued by the thread that launches the step after it, so its issue time delays that step. Fills of
a rank-16 adapter of all seven projections at Llama-7B dims into 8-slot stacks, 4 slots in turn, each round
one layered and one whole fill; medians over the rounds after the first of each slot.

    PYTHONPATH=. python3 bench/slot_fill_issue.py [--layers 16,32] [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from engine_layer_gpu import llama_7b, random_adapter  # a sibling script

from engine.lora import LoRAStacks

SLOTS_IN_TURN = 4


def measure(layers: int, rounds: int) -> None:
    arch = llama_7b(layers)
    made = time.perf_counter()
    cuda = torch.device("cuda")
    stacks = LoRAStacks(arch, slots=8, max_rank=16, dtype=torch.bfloat16, device=cuda, layered_fills=True)
    made_ms = (time.perf_counter() - made) * 1e3
    adapters = [stacks.pack(random_adapter(arch, seed)) for seed in range(SLOTS_IN_TURN)]
    copy_stream = stacks.copy_stream
    assert copy_stream is not None
    rows: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    firsts: dict[bool, list[float]] = {True: [], False: []}
    for rnd in range(rounds):
        for layered in (True, False):
            stacks.layered_fills = layered
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(copy_stream)
            start.synchronize()  # a layered fill needs the copy stream idle: an event still pending keeps it whole
            t0, before = time.perf_counter(), stacks.layered
            stacks.set_lora(rnd % SLOTS_IN_TURN, adapters[rnd % SLOTS_IN_TURN])
            issue = (time.perf_counter() - t0) * 1e3
            end.record(copy_stream)
            torch.cuda.synchronize()
            assert (stacks.layered > before) == layered
            if rnd < SLOTS_IN_TURN:  # each slot's first fill of each kind makes its views (and graphs)
                firsts[layered].append(issue)
            else:
                rows[layered].append((issue, start.elapsed_time(end)))
    print(f"{layers} layers ({made_ms:.0f} ms to make the stacks):")
    issue_p50 = {layered: statistics.median(r[0] for r in rows[layered]) for layered in rows}
    for layered in (True, False):
        copy = statistics.median(r[1] for r in rows[layered])
        first = max(firsts[layered])
        kind = "layered" if layered else "whole  "
        print(
            f"  {kind}: issue p50 {issue_p50[layered]:.3f} ms (a slot's first: up to {first:.3f}), "
            f"copy stream p50 {copy:.3f} ms"
        )
    print(f"  issue time, layered / whole: {issue_p50[True] / issue_p50[False]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="16,32", help="comma-separated layer counts")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for layers in (int(n) for n in args.layers.split(",")):
        measure(layers, args.rounds)


if __name__ == "__main__":
    main()
