"""Where a decode step's time goes with the engine's pacer (late composition) on and off: the GPU's busy time
per step against the step period, from the kernels torch's profiler records, and the idle gaps between them.

  PYTHONPATH=. python3 bench/pacing_gaps.py --tokenizer DIR [--layers 32] [--running 64] [--steps 20]
      [--slack-ms 0.5]

One engine on a random Llama-7B-shaped model (bf16), `--running` base requests decoding; the pacer on and off in
turn, twice each, `--steps` profiled steps per turn. Per turn it prints the wall time per step (the step()
calls), the GPU's period per step (the span of its kernels), its busy time per step (the union of the kernels'
intervals), and the gaps between kernels longer than 50 us: how many, their total per step, the longest.
Stop 39's first (p) measured the pacer's steady steps 0.81-0.97x the rate without it, with at most one step
of 240 launched after the step before it had ended; this separates a GPU idling between kernels from kernels
running longer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.profiler import ProfilerActivity, profile

from bench.engine_gpu_e2e import PROMPT, Bench
from bench.scratch import scratch_dir
from engine.engine import LLMEngine
from engine.loader import resolve_model
from engine.sampling import SamplingParams
from engine.step_pacing import ComposePacer
from engine.tokenizer import Tokenizer

GAP_US = 50.0


def kernel_intervals(trace: Path) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every GPU kernel and memory copy in a chrome trace, sorted."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    return sorted(spans)


def busy_and_gaps(spans: list[tuple[float, float]]) -> tuple[float, float, list[float]]:
    """The span from the first start to the last end, the union of the intervals, and the idle gaps."""
    if not spans:
        raise SystemExit("the profile recorded no GPU kernels")
    busy, gaps = 0.0, []
    start, end = spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return max(e for _, e in spans) - spans[0][0], busy, gaps


def profiled_turn(eng: LLMEngine, steps: int, folder: Path, label: str) -> str:
    for _ in range(6):  # the pacer measures steps and compositions first
        eng.step()
    dry = eng.dry_launches
    trace = folder / f"{label}.json"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    dry = eng.dry_launches - dry
    prof.export_chrome_trace(str(trace))
    span, busy, gaps = busy_and_gaps(kernel_intervals(trace))
    long = [g for g in gaps if g > GAP_US]
    trace.unlink()
    return (
        f"{label}: wall {wall / steps * 1e3:.2f} ms a step, GPU period {span / steps / 1e3:.2f} ms, busy "
        f"{busy / steps / 1e3:.2f} ms ({busy / span:.3f} of the span); gaps over {GAP_US:g} us: {len(long)}, "
        f"{sum(long) / steps / 1e3:.3f} ms a step, longest {max(long, default=0.0) / 1e3:.3f} ms; {dry} of the "
        f"{steps} steps launched after the device had finished the one before"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--running", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--slack-ms", type=float, default=ComposePacer().slack_s * 1e3)
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, llama-7b x {args.layers} layers, {args.running} decoding")
    bench_args = argparse.Namespace(
        device="cuda", shape="llama-7b", tokenizer=args.tokenizer, layers=args.layers, running=args.running
    )
    b = Bench(bench_args)
    eng = b.engine()
    prompt = Tokenizer(resolve_model(str(b.model))).encode_chat([("user", PROMPT)])
    for i in range(args.running):
        eng.add_request(f"g{i}", prompt, SamplingParams(max_tokens=400, ignore_eos=True), None, lambda o: None)
    eng._drain_commands()
    for _ in range(8):
        eng.step()
    pacer = ComposePacer(slack_s=args.slack_ms / 1e3)
    folder = scratch_dir("gaps-")
    for turn in range(2):
        for late in (True, False):
            eng.pacer = pacer if late else None
            label = f"turn {turn}, pacer {'on, slack ' + format(args.slack_ms, 'g') + ' ms' if late else 'off'}"
            print(profiled_turn(eng, args.steps, folder, label), flush=True)
            if late and (estimates := pacer.estimates()) is not None:
                print(
                    f"  pacer estimates: step {estimates[0] * 1e3:.2f} ms, composition {estimates[1] * 1e3:.2f} ms; "
                    f"held back {pacer.waits} in all",
                    flush=True,
                )
    eng.stop()


if __name__ == "__main__":
    main()
