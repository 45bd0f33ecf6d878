"""Chunked prefill on the CPU engine: the pause a long prompt puts in other streams, whole against in chunks.

  python bench/chunked_prefill.py [--prompt-tokens 1500] [--budget 256] [--repeats 3]

Four requests decode; when each has a few tokens, a long prompt joins. With a prefill budget that holds
the prompt it is prefilled in one step, and every running stream waits for that step; with a smaller budget
(`--budget`, `max_num_batched_tokens`) it is prefilled over several steps with a decode at each. Printed,
chunked against whole, measured side by side on two engines in one run (alternating, medians): the running
requests' longest gap between two tokens after the join and their time from the join to their last token,
and the long prompt's own time to first token.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput

RUNNING = 4
JOIN_AFTER = 4  # tokens each running request has before the long prompt joins


def one_run(engine: LLMEngine, long_prompt: list[int], tag: str) -> tuple[float, float, float]:
    """The running requests' longest gap between tokens after the join and their time from the join to
    their last token, and the long prompt's TTFT, in s."""
    stamps: dict[int, list[float]] = {i: [] for i in range(RUNNING)}
    joined: list[float] = []
    first: list[float] = []
    short = engine.tokenizer.encode_chat([("user", "Write a long story about the sea.")])
    params = SamplingParams(max_tokens=48, ignore_eos=True)

    def long_sink(out: RequestOutput) -> None:
        if out.token_ids and not first:
            first.append(time.perf_counter())

    def sink(i: int) -> object:
        def record(out: RequestOutput) -> None:
            if out.token_ids:
                stamps[i].append(time.perf_counter())
            if not joined and all(len(s) >= JOIN_AFTER for s in stamps.values()):
                joined.append(time.perf_counter())
                engine.add_request(f"{tag}-long", long_prompt, SamplingParams(max_tokens=2), None, long_sink)

        return record

    for i in range(RUNNING):
        engine.add_request(f"{tag}-r{i}", short, params, None, sink(i))  # type: ignore[arg-type]
    engine.run_until_idle()
    assert joined and first, "the long prompt never joined or never finished"
    gaps = [b - a for s in stamps.values() for a, b in itertools.pairwise(s) if b > joined[0]]
    return max(gaps), max(s[-1] for s in stamps.values()) - joined[0], first[0] - joined[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens of the chunked engine")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not 0 < args.budget < args.prompt_tokens or args.repeats < 1:
        parser.error("needs 0 < --budget < --prompt-tokens and --repeats >= 1")
    max_len = args.prompt_tokens + 64
    engines = {
        name: LLMEngine(
            EngineConfig(
                max_num_seqs=RUNNING + 1,
                max_model_len=max_len,
                max_num_batched_tokens=budget,
                lora_slots=1,
                max_lora_rank=8,
                prefix_caching="off",  # each round repeats the long prompt, whose prefill this times
            )
        )
        for name, budget in (("whole", max(4096, max_len)), ("chunked", args.budget))
    }
    words = " ".join(f"line {i}: the tide is {'high' if i % 3 else 'low'}." for i in range(args.prompt_tokens))
    tokenizer = engines["whole"].tokenizer
    long_prompt = tokenizer.encode(words)[: args.prompt_tokens]
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in engines}
    for rep in range(args.repeats + 1):  # the first round warms up
        for name, engine in engines.items():
            got = one_run(engine, long_prompt, f"{name}{rep}")
            if rep:
                results[name].append(got)
    for engine in engines.values():
        engine.stop()

    def median(name: str, k: int) -> float:
        return statistics.median(r[k] for r in results[name])

    print(f"long prompt {len(long_prompt)} tokens joining {RUNNING} decoding requests; chunks of {args.budget}")
    labels = ("longest gap in the other streams", "the other streams' time to finish", "the long prompt's TTFT")
    for k, label in enumerate(labels):
        whole, chunked = median("whole", k), median("chunked", k)
        print(f"{label}: whole {whole * 1e3:.0f} ms, chunked {chunked * 1e3:.0f} ms (x{chunked / whole:.2f})")


if __name__ == "__main__":
    main()
