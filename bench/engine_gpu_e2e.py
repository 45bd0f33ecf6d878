"""The whole engine on a GPU: CUDA vs CPU agreement, cold-start TTFT, others' step time during loads, hot swap.

  PYTHONPATH=. python3 bench/engine_gpu_e2e.py --tokenizer DIR [--layers 30]

No weights can be downloaded on the GPU machine, so the base model is SmolLM2-135M-shaped with random
weights (saved as a Hugging Face folder) and the tokenizer folder is passed in. Adapters are random PEFT
files of the real shapes. Every figure is a ratio measured in this run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.torch import save_file

from engine.config import EngineConfig, ModelArch
from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput
from tests.unit.engine.tiny import write_adapter

ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_model(folder: Path, tokenizer: Path, layers: int) -> None:
    cfg = dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    gen = torch.Generator().manual_seed(0)
    h, i, kv = 576, 1536, 192
    state = {
        "model.embed_tokens.weight": torch.randn(49152, h, generator=gen) * 0.05,
        "model.norm.weight": torch.ones(h),
    }
    shapes = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    for layer in range(layers):
        p = f"model.layers.{layer}."
        state[p + "input_layernorm.weight"] = torch.ones(h)
        state[p + "post_attention_layernorm.weight"] = torch.ones(h)
        for name, shape in shapes.items():
            state[p + name + ".weight"] = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    for f in tokenizer.iterdir():
        shutil.copy(f, folder / f.name)


def drive(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams, str | None]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}

    def sink_for(rid: str):  # type: ignore[no-untyped-def]
        def sink(o: RequestOutput) -> None:
            out.setdefault(rid, []).extend(o.token_ids)

        return sink

    for rid, prompt, params, adapter in requests:
        engine.add_request(rid, prompt, params, adapter, sink_for(rid))
    engine.run_until_idle()
    return out


def ttft(engine: LLMEngine, rid: str, prompt: list[int], adapter: str | None) -> float:
    """Seconds from submit to the first token, stepping on this thread."""
    first: list[float] = []
    start = time.perf_counter()
    engine.add_request(
        rid,
        prompt,
        SamplingParams(max_tokens=2, ignore_eos=True),
        adapter,
        lambda o: first.append(time.perf_counter()) if o.token_ids and not first else None,
    )
    while not first:  # a cold adapter: nothing to run until its weights arrive
        engine.run_until_idle()
        if not first:
            time.sleep(0.0005)
    engine.run_until_idle()
    return first[0] - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="e2e-"))
    random_model(tmp / "model", args.tokenizer, args.layers)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")

    def engine(device: str, dtype: str, slots: int = 8) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=str(tmp / "model"),
                device=device,
                dtype=dtype,
                max_num_seqs=32,
                max_model_len=512,
                lora_slots=slots,
                max_lora_rank=16,
            )
        )

    cuda32, cpu32 = engine("cuda", "float32"), engine("cpu", "float32")
    torch.backends.cuda.matmul.allow_tf32 = False
    arch: ModelArch = cuda32.arch
    specs = {
        "r8-qv": (8, ("q_proj", "v_proj")),
        "r16-all": (16, ALL7),
        "r4-mlp": (4, ("gate_proj", "up_proj", "down_proj")),
    }
    for seed, (name, (rank, mods)) in enumerate(specs.items()):
        path = write_adapter(tmp / name, arch=arch, rank=rank, alpha=2 * rank, modules=mods, seed=seed)
        for e in (cuda32, cpu32):
            e.load_adapter(name, str(path), wait=True)
    prompt = cuda32.tokenizer.encode_chat([("user", "Tell me something about the ocean.")])
    rows: list[str | None] = [None, "r8-qv", "r16-all", "r4-mlp", None, "r16-all"]
    reqs = [(f"m{i}", prompt, SamplingParams(max_tokens=16), a) for i, a in enumerate(rows)]
    got_cuda, got_cpu = drive(cuda32, reqs), drive(cpu32, reqs)
    same = sum(got_cuda[r] == got_cpu[r] for r, *_ in reqs)
    print(
        f"CUDA fp32 (triton LoRA) vs CPU fp32 (torch LoRA), mixed batch base + 3 adapters of ranks 4/8/16: "
        f"{same}/{len(reqs)} rows token-identical over 16 greedy tokens"
    )
    del cuda32, cpu32

    eng = engine("cuda", "bfloat16", slots=8)
    paths = [write_adapter(tmp / f"c{i}", arch=arch, rank=16, alpha=16, modules=ALL7, seed=100 + i) for i in range(40)]
    eng.load_adapter("warm", str(paths[0]), wait=True)
    ttft(eng, "warmup", prompt, "warm")
    warm = [ttft(eng, f"w{i}", prompt, "warm") for i in range(5)]
    host, disk = [], []
    for i in range(1, 6):
        eng.load_adapter(f"h{i}", str(paths[i]), wait=True)  # in host memory, not in a slot
        host.append(ttft(eng, f"hq{i}", prompt, f"h{i}"))
    for i in range(6, 11):
        eng.load_adapter(f"d{i}", str(paths[i]), wait=False)  # registered, still on disk
        disk.append(ttft(eng, f"dq{i}", prompt, f"d{i}"))
    p50 = statistics.median
    print(
        f"cold start TTFT p50: warm {p50(warm) * 1e3:.2f} ms, host RAM {p50(host) * 1e3:.2f} ms "
        f"({p50(host) / p50(warm):.2f}x warm), disk {p50(disk) * 1e3:.2f} ms (+{(p50(disk) - p50(warm)) * 1e3:.1f} ms)"
    )

    # Others' step time: 16 base requests decoding; steady vs while cold adapters load and join.
    def steps_while(cold: bool) -> list[float]:
        for i in range(16):
            eng.add_request(
                f"bg{cold}{i}", prompt, SamplingParams(max_tokens=60, ignore_eos=True), None, lambda o: None
            )
        eng._drain_commands()
        times, k = [], 0
        while eng.scheduler.running or eng.scheduler.waiting:
            if cold and k % 4 == 0 and k // 4 < 12:
                name = f"x{k}"
                eng.load_adapter(name, str(paths[11 + k // 4]), wait=False)
                eng.add_request(f"xq{k}", prompt, SamplingParams(max_tokens=4, ignore_eos=True), name, lambda o: None)
                eng._drain_commands()
            t = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            k += 1
        return times[1:]

    steps_while(False)  # warm-up: the first batch of 16 compiles the prefill-shaped triton kernels
    steady, loading = steps_while(False), steps_while(True)
    q = lambda v: statistics.quantiles(v, n=100)[98]  # noqa: E731
    print(
        f"others' step time p99: steady {q(steady) * 1e3:.2f} ms, during cold loads {q(loading) * 1e3:.2f} ms "
        f"({q(loading) / q(steady):.2f}x; step = one token for every running request)"
    )

    # Decode throughput of the whole engine (eager, bf16): 32 requests of 64 tokens, interleaved repeats.
    for i in range(8):
        eng.load_adapter(f"t{i}", str(paths[20 + i]), wait=True, pin=False)
    mixes: dict[str, list[str | None]] = {
        "base": [None] * 32,
        "one adapter": ["t0"] * 32,
        "8 distinct adapters": [f"t{i % 8}" for i in range(32)],
    }
    rates: dict[str, list[float]] = {name: [] for name in mixes}
    for rep in range(3):
        for name, adapters in mixes.items():
            reqs = [
                (f"tp{rep}{name}{i}", prompt, SamplingParams(max_tokens=64, ignore_eos=True), a)
                for i, a in enumerate(adapters)
            ]
            start = time.perf_counter()
            drive(eng, reqs)
            torch.cuda.synchronize()
            rates[name].append(32 * 64 / (time.perf_counter() - start))
    base_rate = p50(rates["base"])
    print(
        "decode tok/s, batch 32 x 64 tokens (median of 3): "
        + ", ".join(f"{name} {p50(v):.0f} ({p50(v) / base_rate:.2f}x base)" for name, v in rates.items())
    )

    eng.load_adapter("swap", str(paths[30]), wait=True)
    ttft(eng, "sw0", prompt, "swap")
    t0 = time.perf_counter()
    eng.load_adapter("swap", str(paths[31]), wait=False)  # apply v2 while v1 is registered
    new = eng.pool.lookup("swap")
    first = ttft(eng, "sw1", prompt, "swap")
    assert eng.pool.lookup("swap") is new
    print(
        f"hot swap: apply -> first token on the new version {(time.perf_counter() - t0) * 1e3:.2f} ms "
        f"(TTFT of that request {first * 1e3:.2f} ms; warm TTFT {p50(warm) * 1e3:.2f} ms)"
    )


if __name__ == "__main__":
    main()
