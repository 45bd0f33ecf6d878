"""The first joins of a fresh engine process, with and without the start-up warm-up (`EngineConfig.warm_up`).

  PYTHONPATH=. python3 bench/first_joins.py --tokenizer DIR [--pairs 3] [--layers 30] [--device cuda]
      [--joins warm|cold]

One-time costs belong to a process (CUDA loads a kernel's module at its first launch), so every run is a new
process, warm-up on and off in turn. Each run: an engine on a random SmolLM2-shaped model (bf16 on CUDA),
then 16 base requests decoding (steady) and again while 12 requests join, one every 4 steps. Warm joins
(the default): 4 adapters loaded and used once alone before, the joins on those. Cold joins: each join on
an adapter of its own that the process has never loaded, registered on another thread as the server's
handlers do (the adapter path's first costs). It prints the running requests' p99 inter-token latency, steady
and during the joins, and the slowest step during the joins; then, per pair, warm-up on / off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench.engine_gpu_e2e import ALL7, PROMPT, engine_config, p99
from bench.scratch import scratch_dir
from engine.sequence import RequestOutput


def child(model: str, adapters: list[str], device: str, warm_up: str, cold: bool) -> dict[str, float]:
    """One fresh engine's steady and first-join figures (seconds); `cold`: each join on an adapter of
    `adapters` not loaded before, registered on another thread."""
    import torch

    from engine.engine import LLMEngine
    from engine.sampling import SamplingParams

    started = time.perf_counter()
    eng = LLMEngine(engine_config(Path(model), device, warm_up=warm_up))
    start_s = time.perf_counter() - started
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    prompt = eng.tokenizer.encode_chat([("user", PROMPT)])
    for i, path in enumerate([] if cold else adapters):
        eng.load_adapter(f"a{i}", path, wait=True)
        eng.add_request(f"alone{i}", prompt, SamplingParams(max_tokens=2, ignore_eos=True), f"a{i}", lambda o: None)
        eng.run_until_idle()

    def join_cold(request_id: str, name: str, path: str, params: SamplingParams) -> None:
        eng.load_adapter(name, path)
        eng.add_request(request_id, prompt, params, name, lambda o: None)

    def run(tag: str, joins: bool) -> tuple[list[float], float]:
        last: dict[str, float] = {}
        gaps: list[float] = []

        def sink(rid: str) -> Callable[[RequestOutput], None]:
            def record(o: RequestOutput) -> None:
                now = time.perf_counter()
                if o.token_ids and rid in last:
                    gaps.append(now - last[rid])
                last[rid] = now

            return record

        for i in range(16):
            eng.add_request(
                f"{tag}{i}", prompt, SamplingParams(max_tokens=80, ignore_eos=True), None, sink(f"{tag}{i}")
            )
        k, slowest = 0, 0.0
        joiners: list[threading.Thread] = []
        while k == 0 or eng.scheduler.running or eng.scheduler.waiting:
            if joins and k % 4 == 2 and k // 4 < 12:
                params = SamplingParams(max_tokens=4, ignore_eos=True)
                if cold:
                    join = k // 4
                    joiner = threading.Thread(target=join_cold, args=(f"{tag}j{k}", f"c{join}", adapters[join], params))
                    joiner.start()
                    joiners.append(joiner)
                else:
                    eng.add_request(f"{tag}j{k}", prompt, params, f"a{(k // 4) % len(adapters)}", lambda o: None)
            t = time.perf_counter()
            eng._drain_commands()
            eng.step()
            sync()
            if k > 0:  # (the first step admits the 16)
                slowest = max(slowest, time.perf_counter() - t)
            k += 1
        for joiner in joiners:
            joiner.join()
        eng.run_until_idle()
        return gaps, slowest

    steady, _ = run("s", joins=False)
    joined, slowest = run("j", joins=True)
    eng.stop()
    return {"start_s": start_s, "steady_p99": p99(steady), "joins_p99": p99(joined), "slowest_step": slowest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, help="a SmolLM2 tokenizer folder (tokenizer.json)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--joins", choices=("warm", "cold"), default="warm", help="the joins' adapters (module doc)")
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "ADAPTERS", "WARM_UP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, adapters, warm_up = args.child
        print(json.dumps(child(model, adapters.split(","), args.device, warm_up, args.joins == "cold")))
        return
    if args.tokenizer is None or args.pairs < 1:
        ap.error("needs --tokenizer and --pairs >= 1")
    from engine.loader import load_weights, resolve_model
    from tests.support.random_model import write_random_llama
    from tests.unit.engine.tiny import write_adapter

    tmp = scratch_dir("first-joins-")
    model = write_random_llama(tmp / "model", args.tokenizer, args.layers)
    arch, _ = load_weights(resolve_model(str(model)))
    adapters = [
        str(write_adapter(tmp / f"a{i}", arch=arch, rank=16, alpha=16, modules=ALL7, seed=100 + i))
        for i in range(12 if args.joins == "cold" else 4)
    ]
    results: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for pair in range(args.pairs):
        for warm_up in ("on", "off") if pair % 2 == 0 else ("off", "on"):
            command = [sys.executable, __file__, "--device", args.device, "--joins", args.joins]
            command += ["--child", str(model), ",".join(adapters)]
            done = subprocess.run([*command, warm_up], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                sys.exit(f"run with warm-up {warm_up} failed:\n{done.stderr[-3000:]}")
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            results[warm_up].append(figures)
            print(
                f"pair {pair + 1}, warm-up {warm_up}: engine start {figures['start_s']:.1f} s, others' p99 steady "
                f"{figures['steady_p99'] * 1e3:.2f} ms, during the first joins {figures['joins_p99'] * 1e3:.2f} ms "
                f"({figures['joins_p99'] / figures['steady_p99']:.2f}x steady), slowest step "
                f"{figures['slowest_step'] * 1e3:.1f} ms",
                flush=True,
            )
    ratios = [on["joins_p99"] / off["joins_p99"] for on, off in zip(results["on"], results["off"], strict=True)]
    slow = [on["slowest_step"] / off["slowest_step"] for on, off in zip(results["on"], results["off"], strict=True)]
    print(
        f"first joins' others' p99, warm-up on / off, per pair: {', '.join(f'{r:.2f}x' for r in ratios)} "
        f"(median {statistics.median(ratios):.2f}x); slowest step on / off: {', '.join(f'{r:.2f}x' for r in slow)}"
    )


if __name__ == "__main__":
    main()
