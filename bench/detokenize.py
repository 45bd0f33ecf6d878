"""Engine-thread cost of turning each sampled token into text, side by side in one run.

  python bench/detokenize.py [--lengths 256,1024,4096] [--batch 64]

For completions of each length (the shipped SmolLM2 tokenizer, mixed-script text): the mean cost of one
token with the engine's streaming decoder (`engine.tokenizer.IncrementalDecoder`, tokenizers'
DecodeStream) against decoding the whole completion again (what the engine did before). The decode step
of a batch pays this once per request: the figure times `--batch` is engine-thread time per step, during
which a GPU waits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.loader import resolve_model
from engine.tokenizer import IncrementalDecoder, Tokenizer

TEXT = "The sea is vast, 深い海 🌊 and full of life: naïve café, “quoted” — done. "


def streaming(tokenizer: Tokenizer, ids: list[int]) -> float:
    """Mean seconds per token through the engine's decoder."""
    decoder = IncrementalDecoder(tokenizer)
    start = time.perf_counter()
    for t in ids:
        decoder.push(t)
    return (time.perf_counter() - start) / len(ids)


def redecoding(tokenizer: Tokenizer, ids: list[int], samples: int = 64) -> float:
    """Mean seconds per token when each token decodes the completion so far (timed at `samples` evenly
    spaced lengths: their mean is the mean over all lengths)."""
    lengths = [max(1, round(len(ids) * (i + 0.5) / samples)) for i in range(samples)]
    start = time.perf_counter()
    for n in lengths:
        tokenizer.decode(ids[:n])
    return (time.perf_counter() - start) / samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tokenizer = Tokenizer(resolve_model("smollm2"))
    for length in (int(n) for n in args.lengths.split(",")):
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer.encode(TEXT)
        ids = ids[:length]
        stream, redecode = [], []
        for _ in range(args.repeats):  # interleaved, medians reported
            stream.append(streaming(tokenizer, ids))
            redecode.append(redecoding(tokenizer, ids))
        s, r = statistics.median(stream), statistics.median(redecode)
        print(
            f"completions of {length:5d} tokens: streaming {s * 1e6:6.1f} us/token, "
            f"re-decoding {r * 1e6:7.1f} us/token "
            f"(x{r / s:.0f}); per decode step of {args.batch} requests {s * args.batch * 1e3:.2f} ms vs "
            f"{r * args.batch * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
