"""CPU engine throughput, every figure a ratio measured side by side in one run.

  python bench/engine_cpu.py [--tokens 32] [--repeats 3]

Prints tokens/s at batch 1, 8 and 32 (base model); a batch of 8 requests on 8 distinct adapters vs the same
batch on one adapter vs base only; and our engine vs transformers + peft `generate` (per-row
`adapter_names`) on the same mixed batch. Configurations are interleaved and repeated; medians are reported.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.scratch import scratch_dir
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.loader import packaged_smollm2
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput
from tests.unit.engine.tiny import write_adapter

PROMPT = "Write a short poem about the sea."
ADAPTER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def engine_tokens_per_s(engine: LLMEngine, adapters: list[str | None], tokens: int) -> float:
    """Submit one request per entry of `adapters` at once; generated tokens / wall time."""
    prompt = engine.tokenizer.encode_chat([("user", PROMPT)])
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    finished: list[RequestOutput] = []

    def sink(out: RequestOutput) -> None:
        if out.finish_reason is not None:
            finished.append(out)

    # Stepped on this (main) thread, as the engine process does: torch's CPU kernels are slower when
    # called from a secondary thread.
    start = time.perf_counter()
    for i, adapter in enumerate(adapters):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params, adapter, sink)
    engine.run_until_idle()
    assert len(finished) == len(adapters) and all(o.completion_tokens == tokens for o in finished)
    return len(adapters) * tokens / (time.perf_counter() - start)


def hf_tokens_per_s(model: torch.nn.Module, tokenizer: object, adapters: list[str], tokens: int) -> float:
    text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids  # type: ignore[operator]
    batch = ids.repeat(len(adapters), 1)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            input_ids=batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            adapter_names=adapters,
            pad_token_id=2,
        )
    assert out.shape[1] - batch.shape[1] == tokens
    return len(adapters) * tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}"
    )

    tmp = scratch_dir("bench-adapters-")
    # Prefix caching off: every run repeats its prompts, which transformers + peft prefill each time.
    engine = LLMEngine(
        EngineConfig(
            max_num_seqs=32,
            max_model_len=256,
            max_num_batched_tokens=4096,
            lora_slots=8,
            max_lora_rank=16,
            prefix_caching="off",
        )
    )
    paths = {}
    for i in range(8):
        paths[f"a{i}"] = write_adapter(
            tmp / f"a{i}", arch=engine.arch, rank=16, alpha=16, modules=ADAPTER_MODULES, seed=i
        )
        engine.load_adapter(f"a{i}", str(paths[f"a{i}"]), wait=True)
    distinct: list[str | None] = [f"a{i}" for i in range(8)]
    configs: dict[str, list[str | None]] = {
        "base, batch 1": [None],
        "base, batch 8": [None] * 8,
        "base, batch 32": [None] * 32,
        "8 requests, one adapter": ["a0"] * 8,
        "8 requests, 8 distinct adapters": distinct,
    }
    engine_tokens_per_s(engine, distinct, 4)  # warm-up: every adapter resident, allocator warm

    hf = None
    if not args.skip_hf:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = packaged_smollm2()
        base = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        peft_model = PeftModel.from_pretrained(base, str(paths["a0"]), adapter_name="a0").eval()
        for i in range(1, 8):
            peft_model.load_adapter(str(paths[f"a{i}"]), adapter_name=f"a{i}")
        hf = (peft_model, tok)
        hf_tokens_per_s(peft_model, tok, [f"a{i}" for i in range(8)], 4)

    results: dict[str, list[float]] = {name: [] for name in configs}
    results["transformers+peft, 8 distinct adapters"] = []
    for _ in range(args.repeats):
        for name, adapters in configs.items():
            results[name].append(engine_tokens_per_s(engine, adapters, args.tokens))
        if hf is not None:
            results["transformers+peft, 8 distinct adapters"].append(
                hf_tokens_per_s(hf[0], hf[1], [f"a{i}" for i in range(8)], args.tokens)
            )

    med = {name: statistics.median(v) for name, v in results.items() if v}
    print(f"\n{args.tokens} new tokens per request, median of {args.repeats} interleaved runs (SmolLM2-135M, fp32)")
    for name, value in med.items():
        print(f"  {name:42s} {value:8.1f} tok/s")
    print("\nfigures:")
    print(f"  batch 8 / batch 1 (base)                    {med['base, batch 8'] / med['base, batch 1']:.2f}x")
    print(f"  batch 32 / batch 1 (base)                   {med['base, batch 32'] / med['base, batch 1']:.2f}x")
    one = med["8 requests, one adapter"]
    print(
        f"  8 distinct adapters / one adapter           {med['8 requests, 8 distinct adapters'] / one:.2f}x"
        "  (goal >= 0.85x)"
    )
    vs_base = med["8 requests, 8 distinct adapters"] / med["base, batch 8"]
    print(f"  8 distinct adapters / base only             {vs_base:.2f}x")
    if "transformers+peft, 8 distinct adapters" in med:
        ratio = med["8 requests, 8 distinct adapters"] / med["transformers+peft, 8 distinct adapters"]
        print(f"  ours / transformers+peft (8 distinct)       {ratio:.2f}x  (goal >= 1.2x)")


if __name__ == "__main__":
    main()
