"""Prefix caching on the CPU engine: requests that share a system prompt, and a chat's next turn, with the
cache on against off.

  python bench/prefix_caching.py [--system-tokens 600] [--requests 8] [--repeats 3] [--adapter pirate]
  python bench/prefix_caching.py --device cuda --model FOLDER --adapter none [--max-num-seqs 32]   # a GPU

Shared system prompt: `--requests` requests, each the same system prompt with its own short question, sent
one after another (each waits for the one before, as a tenant's steady traffic does), 8 tokens each. Next
turn: a chat's second turn, its prompt the first turn, the reply and a new question. Printed, cached against
uncached, measured side by side on two engines in one run (alternating, medians): time to first token
(p50 over the requests after the first) and the prompt tokens read from the cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput
from tests.support.model_files import demo_adapter_dir

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def ttft(engine: LLMEngine, request_id: str, prompt: list[int], adapter: str | None) -> tuple[float, str]:
    """One request alone on the engine: its time to first token in s, and its text."""
    first: list[float] = []
    text: list[str] = []

    def sink(out: RequestOutput) -> None:
        if out.token_ids and not first:
            first.append(time.perf_counter())
        text.append(out.text)

    started = time.perf_counter()
    engine.add_request(request_id, prompt, GREEDY, adapter, sink)
    engine.run_until_idle()
    return first[0] - started, "".join(text)


def shared_system(engine: LLMEngine, system: str, requests: int, adapter: str | None, tag: str) -> list[float]:
    """TTFTs of `requests` requests with the same system prompt, after the first (which fills the cache)."""
    times = []
    for i in range(requests):
        prompt = engine.tokenizer.encode_chat([("system", system), ("user", f"{tag}: question {i}, briefly?")])
        took, _ = ttft(engine, f"{tag}-{i}", prompt, adapter)
        if i:
            times.append(took)
    return times


def next_turn(engine: LLMEngine, system: str, adapter: str | None, tag: str) -> float:
    """TTFT of a chat's second turn."""
    turn = [("system", system), ("user", f"{tag}: name a harbour.")]
    _, reply = ttft(engine, f"{tag}-t1", engine.tokenizer.encode_chat(turn), adapter)
    following = engine.tokenizer.encode_chat([*turn, ("assistant", reply), ("user", "And why that one?")])
    return ttft(engine, f"{tag}-t2", following, adapter)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system-tokens", type=int, default=600)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--adapter", default="pirate", help="demo adapter the requests use; 'none' for the base")
    parser.add_argument("--model", default="smollm2", help="EngineConfig.model (the demo adapters fit smollm2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=4,
        help="KV rows; on CUDA also the decode graph's rows, which a prompt's rest after its cached start runs as"
        " when it fits (else eagerly)",
    )
    args = parser.parse_args()
    if args.system_tokens < 32 or args.requests < 2 or args.repeats < 1 or args.max_num_seqs < 1:
        parser.error("needs --system-tokens >= 32, --requests >= 2, --repeats >= 1 and --max-num-seqs >= 1")
    adapter = None if args.adapter == "none" else args.adapter
    engines = {
        name: LLMEngine(
            EngineConfig(
                model=args.model,
                device=args.device,
                max_num_seqs=args.max_num_seqs,
                max_model_len=args.system_tokens + 256,
                lora_slots=1,
                max_lora_rank=16,
                prefix_caching=setting,
            )
        )
        for name, setting in (("uncached", "off"), ("cached", "on"))
    }
    if adapter is not None:
        for engine in engines.values():
            engine.load_adapter(adapter, str(demo_adapter_dir(adapter)), wait=True)
    tokenizer = engines["cached"].tokenizer
    rules = (f"Rule {i}: berth {i % 7} opens at {6 + i % 5}, the pilot boards at buoy {i % 3}." for i in range(400))
    words = " ".join(rules)
    system = tokenizer.decode(tokenizer.encode(words)[: args.system_tokens])
    shared: dict[str, list[float]] = {name: [] for name in engines}
    turns: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(args.repeats + 1):  # the first round warms up
        for name, engine in engines.items():
            # Each round has its own system prompt: the cache holds nothing of it when the round starts.
            round_system = f"Round {rep}. {system}"
            got = shared_system(engine, round_system, args.requests, adapter, f"{name}{rep}")
            turn = next_turn(engine, round_system, adapter, f"{name}{rep}")
            if rep:
                shared[name] += got
                turns[name].append(turn)
    stats = {name: engine.stats() for name, engine in engines.items()}
    for engine in engines.values():
        engine.stop()

    on, off = stats["cached"], stats["uncached"]
    prompt_len = len(tokenizer.encode_chat([("system", f"Round 1. {system}"), ("user", "x: question 1, briefly?")]))
    print(
        f"system prompt of ~{args.system_tokens} tokens (prompts ~{prompt_len} tokens), "
        f"{'adapter ' + adapter if adapter else 'base model'}, {args.model} on {args.device}"
    )
    print(
        f"prompt tokens read from the cache: {on.prefix_cache_hits} of {on.prefix_cache_queries} "
        f"({on.prefix_cache_hits / max(1, on.prefix_cache_queries):.0%}); uncached engine {off.prefix_cache_hits}"
    )
    for label, results in (("shared system prompt, TTFT p50", shared), ("next turn of a chat, TTFT p50", turns)):
        cached, uncached = statistics.median(results["cached"]), statistics.median(results["uncached"])
        print(f"{label}: cached {cached * 1e3:.1f} ms, uncached {uncached * 1e3:.1f} ms (x{cached / uncached:.2f})")


if __name__ == "__main__":
    main()
