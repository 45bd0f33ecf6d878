"""Sampling one decode step's tokens: rows drawn together and read back once (`engine.sampling.sample`)
against each row drawn and read back alone (`sample_one_by_one`, what the engine did before), side by side.

  python bench/sampling.py [--device cuda] [--batch 64] [--vocab 49152]

On a GPU every read-back waits for the device: the old way waited once per sampled row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from engine.sampling import SamplingParams, make_generator, sample, sample_one_by_one

Sampler = Callable[[torch.Tensor, list[SamplingParams], list[torch.Generator | None]], list[int]]


def mixes(batch: int) -> dict[str, list[SamplingParams]]:
    chat = {"temperature": 0.8, "top_p": 0.95}
    return {
        "greedy": [SamplingParams(max_tokens=1) for _ in range(batch)],
        "temperature 0.8, top-p 0.95": [SamplingParams(max_tokens=1, **chat) for _ in range(batch)],  # type: ignore[arg-type]
        "the same, seeded": [SamplingParams(max_tokens=1, seed=i, **chat) for i in range(batch)],  # type: ignore[arg-type]
        "half greedy, half top-k 40": [
            SamplingParams(max_tokens=1, temperature=0.0 if i % 2 else 1.0, top_k=40) for i in range(batch)
        ],
    }


def per_call(fn: Sampler, logits: torch.Tensor, params: list[SamplingParams], device: torch.device) -> float:
    generators = [make_generator(p, device) for p in params]
    fn(logits, params, generators)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        fn(logits, params, generators)
    return (time.perf_counter() - start) / 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    logits = torch.randn(args.batch, args.vocab, device=device) * 4
    print(f"device {device}, batch {args.batch}, vocab {args.vocab}; ms per decode step, medians of {args.repeats}")
    for name, params in mixes(args.batch).items():
        together, alone = [], []
        for _ in range(args.repeats):  # interleaved
            together.append(per_call(sample, logits, params, device))
            alone.append(per_call(sample_one_by_one, logits, params, device))
        t, a = statistics.median(together), statistics.median(alone)
        print(f"  {name:28s} together {t * 1e3:7.3f}  one by one {a * 1e3:7.3f}  (x{a / t:.1f})")


if __name__ == "__main__":
    main()
