"""The whole engine on a GPU: agreement with the CPU, decode throughput (graphs vs eager), cold start,
others' inter-token latency during loads, 500 adapters on 64 slots under Zipf traffic, hot swap, and late
composition (p: random arrivals' TTFT and steady steps/s with the engine's pacer on and off).

  PYTHONPATH=. python3 bench/engine_gpu_e2e.py --tokenizer DIR [--layers 30] [--only abdeftp]
      [--shape smollm2|llama-7b] [--running 16]

No weights can be downloaded on the GPU machine, so the base model is SmolLM2-135M-shaped (or, with
`--shape llama-7b`, Llama-7B-shaped: the goals' dimensions) with random weights (saved as a Hugging Face
folder) and the tokenizer folder is passed in. Adapters are random PEFT files of the real shapes. Every
figure is a ratio measured in this run; the summary comes last.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.scratch import scratch_dir
from engine import adapter_device_loader, kernels_gemm_lora
from engine.adapter_device_loader import DeviceLoader
from engine.adapter_loader import ProcessLoader
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.loader import resolve_model
from engine.pool import AdapterState, AdapterVersion
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput
from engine.step_pacing import ComposePacer
from engine.tokenizer import Tokenizer
from tests.support.random_model import SHAPES, write_random_llama
from tests.unit.engine.tiny import write_adapter

ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = "Tell me something about the ocean."
SUMMARY: list[str] = []
LOADER = "thread"  # the adapter loader (and GIL switch interval) measured: sections d and f run once per pair
TRACE = False  # --trace: per-step phase timings of the join and Zipf runs (adds a sync per phase)
Request = tuple[str, list[int], SamplingParams, str | None]


def report(line: str) -> None:
    print(line, flush=True)
    SUMMARY.append(line)


def report_loader(line: str) -> None:
    """`report` for a figure of sections d and f, which run once per adapter loader and switch interval."""
    report(f"[{LOADER}] {line}")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_gpu_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def p50(values: list[float]) -> float:
    return statistics.median(values)


def p99(values: list[float]) -> float:
    """Interpolated between the samples (the default 'exclusive' method extrapolates past the largest one
    below 99 samples: the p99 of 1..10 was 10.89)."""
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def drive(engine: LLMEngine, requests: list[Request]) -> dict[str, list[int]]:
    """Submit everything, step until idle; tokens per request id."""
    out: dict[str, list[int]] = {}

    def sink_for(rid: str) -> Callable[[RequestOutput], None]:
        return lambda o: out.setdefault(rid, []).extend(o.token_ids)

    for rid, prompt, params, adapter in requests:
        engine.add_request(rid, prompt, params, adapter, sink_for(rid))
    engine.run_until_idle()
    return out


def send_timed(engine: LLMEngine, rid: str, prompt: list[int], adapter: str | None, first: list[float]) -> None:
    """Submit a request of two tokens; the time its first token came is appended to `first`."""
    engine.add_request(
        rid,
        prompt,
        SamplingParams(max_tokens=2, ignore_eos=True),
        adapter,
        lambda o: first.append(time.perf_counter()) if o.token_ids and not first else None,
    )


def ttft(engine: LLMEngine, rid: str, prompt: list[int], adapter: str | None) -> float:
    """Seconds from submit to the first token, stepping on this thread."""
    first: list[float] = []
    start = time.perf_counter()
    send_timed(engine, rid, prompt, adapter, first)
    while not first:  # a cold adapter: nothing to run until its weights arrive
        engine.run_until_idle()
        if not first:
            time.sleep(0.0002)
    engine.run_until_idle()
    return first[0] - start


def engine_config(model: Path, device: str, **overrides: object) -> EngineConfig:
    """The engine the GPU benchmarks measure (bf16 on CUDA, float32 elsewhere); `overrides` replace any
    setting."""
    settings: dict[str, object] = dict(
        model=str(model),
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        max_num_seqs=32,
        max_model_len=512,
        lora_slots=8,
        max_lora_rank=16,
        # The benchmarks time prefills and loads with prompts they repeat: off, as in the figures of record.
        prefix_caching="off",
    )
    settings.update(overrides)
    return EngineConfig(**settings)  # type: ignore[arg-type]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.tmp = scratch_dir("e2e-")
        self.device: str = args.device
        dtype = torch.bfloat16 if args.shape != "smollm2" else torch.float32  # (a float32 7B would be 27 GB)
        self.model = write_random_llama(
            self.tmp / "model", args.tokenizer, args.layers, dtype=dtype, device=self.device, **SHAPES[args.shape]
        )
        free_gpu_memory()  # the draws' blocks would otherwise shrink the KV cache the engines size from free memory
        self.adapter_seed = 1000
        self.running: int = args.running  # section d's other requests, decoding while adapters load and join

    def engine(self, device: str | None = None, dtype: str | None = None, **overrides: object) -> LLMEngine:
        # Room for (d)'s joiners beside its running requests.
        settings: dict[str, object] = dict(max_num_seqs=max(32, self.running + 8))
        if dtype is not None:
            settings["dtype"] = dtype
        settings.update(overrides)
        return LLMEngine(engine_config(self.model, device or self.device, **settings))

    def adapters(
        self, engine: LLMEngine, prefix: str, count: int, rank: int = 16, modules: tuple[str, ...] = ALL7
    ) -> list[Path]:
        paths = []
        for i in range(count):
            self.adapter_seed += 1
            folder = self.tmp / f"{prefix}{i}"
            paths.append(
                write_adapter(
                    folder,
                    arch=engine.arch,
                    rank=rank,
                    alpha=rank,
                    modules=modules,
                    seed=self.adapter_seed,
                    device=self.device,
                )
            )
        free_gpu_memory()
        return paths


def section_agreement(b: Bench) -> None:
    """CUDA fp32 (graphs + triton LoRA) vs CPU fp32 (torch LoRA): same greedy tokens on a mixed batch."""
    cuda32, cpu32 = b.engine("cuda", "float32"), b.engine("cpu", "float32")
    torch.backends.cuda.matmul.allow_tf32 = False
    specs = {
        "r8-qv": (8, ("q_proj", "v_proj")),
        "r16-all": (16, ALL7),
        "r4-mlp": (4, ("gate_proj", "up_proj", "down_proj")),
    }
    for name, (rank, mods) in specs.items():
        path = b.adapters(cuda32, name, 1, rank=rank, modules=mods)[0]
        for e in (cuda32, cpu32):
            e.load_adapter(name, str(path), wait=True)
    prompt = cuda32.tokenizer.encode_chat([("user", PROMPT)])
    rows: list[str | None] = [None, "r8-qv", "r16-all", "r4-mlp", None, "r16-all"]
    reqs: list[Request] = [(f"m{i}", prompt, SamplingParams(max_tokens=16), a) for i, a in enumerate(rows)]
    got_cuda, got_cpu = drive(cuda32, reqs), drive(cpu32, reqs)
    same = sum(got_cuda[r] == got_cpu[r] for r, *_ in reqs)
    assert cuda32.graphs is not None and cuda32.graphs.replays > 0
    report(
        f"(agree) CUDA fp32 (decode graphs, triton LoRA) vs CPU fp32 (torch LoRA), base + 3 adapters of ranks "
        f"4/8/16: {same}/{len(reqs)} rows token-identical over 16 greedy tokens"
    )
    torch.backends.cuda.matmul.allow_tf32 = True
    cuda32.stop()
    cpu32.stop()


def section_throughput(b: Bench, engines: dict[str, LLMEngine], prompt: list[int]) -> None:
    """(b) decode tokens/s at batch 32: base, one adapter, 8 distinct (greedy, and sampled with temperature
    0.8 and top-p 0.95: the sampling's share of a step); graphs and eager, and each engine of `engines`
    (labelled by its attention backend, async steps, LoRA shrink mode and LoRA GEMM), interleaved."""
    paths = b.adapters(next(iter(engines.values())), "t", 8)
    for eng in engines.values():
        for i, path in enumerate(paths):
            eng.load_adapter(f"t{i}", str(path), wait=True)
    greedy = SamplingParams(max_tokens=64, ignore_eos=True)
    sampled = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.8, top_p=0.95)
    mixes: dict[str, tuple[list[str | None], SamplingParams]] = {
        "base": ([None] * 32, greedy),
        "one adapter": (["t0"] * 32, greedy),
        "8 distinct": ([f"t{i % 8}" for i in range(32)], greedy),
        "8 distinct sampled": ([f"t{i % 8}" for i in range(32)], sampled),
    }
    has_graphs = all(eng.graphs is not None for eng in engines.values())
    modes = ("graphs", "eager") if has_graphs else ("eager",)
    rates: dict[tuple[str, str], list[float]] = {}
    for rep in range(4):
        for label, eng in engines.items():
            graphs = eng.graphs
            for mode in modes:
                eng.graphs = graphs if mode == "graphs" else None
                key = f"{mode}, {label}"
                for name, (adapters, params) in mixes.items():
                    reqs: list[Request] = [
                        (f"tp{rep}{key}{name}{i}", prompt, params, a) for i, a in enumerate(adapters)
                    ]
                    start = time.perf_counter()
                    got = drive(eng, reqs)
                    sync()
                    elapsed = time.perf_counter() - start
                    # The rate counts 32 x 64 tokens: every request must have produced them (a failed one ends early).
                    if len(got) != len(reqs) or any(len(tokens) != 64 for tokens in got.values()):
                        raise AssertionError(f"(b) {key}, {name}: not every request generated 64 tokens")
                    if rep:  # the first round warms up
                        rates.setdefault((key, name), []).append(32 * 64 / elapsed)
            eng.graphs = graphs
    keys = sorted({key for key, _ in rates})
    for key in keys:
        base = p50(rates[(key, "base")])
        report(
            f"(b) decode tok/s, batch 32 x 64 tokens incl. prefill, {key}: "
            + ", ".join(f"{n} {p50(rates[(key, n)]):.0f} ({p50(rates[(key, n)]) / base:.2f}x base)" for n in mixes)
        )
    for label in engines if has_graphs else ():
        for name in mixes:
            ratio = p50(rates[(f"graphs, {label}", name)]) / p50(rates[(f"eager, {label}", name)])
            report(f"(b) graphs / eager, {label}, {name}: {ratio:.2f}x")
    first, *others = engines
    for label in others:
        for mode in modes:
            mine, theirs = f"{mode}, {first}", f"{mode}, {label}"
            ratios = ", ".join(f"{n} {p50(rates[(mine, n)]) / p50(rates[(theirs, n)]):.2f}x" for n in mixes)
            report(f"(b) {mode}, {first} / {label}: {ratios}")


# (d)'s steady decode step, ms, by engine: its settings but layered fills, and its layered_fills
STEADY: dict[tuple[str, str], float] = {}


def steady_step_ms(eng: LLMEngine, prompt: list[int], adapter: str, running: int, steps: int = 40) -> float:
    """Wall time of a decode step, `running` requests on `adapter` all decoding, p50 of 4 blocks of `steps`."""
    for j in range(running):
        params = SamplingParams(max_tokens=8 + 5 * steps, ignore_eos=True)
        eng.add_request(f"steady{eng.steps}-{j}", prompt, params, adapter, lambda _: None)
    for _ in range(8):  # past every prefill
        eng._drain_commands()
        eng.step()
    sync()
    blocks = []
    for _ in range(4):
        start = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        blocks.append((time.perf_counter() - start) / steps * 1e3)
    eng.run_until_idle()
    return p50(blocks)


def section_cold_start(
    b: Bench, eng: LLMEngine, prompt: list[int], layered: tuple[bool, ...] = (True,), rounds: int = 5
) -> None:
    """(d) TTFT with the adapter warm, in host RAM, on disk.

    "Host RAM" adapters are loaded before the timed requests, as a host-tier hit is in service: an adapter
    loaded earlier whose GPU slot went to others. A second host-RAM figure times a request sent the moment
    its adapter's load finished: then the loader's own threads still run their bookkeeping beside the
    slot fill, on the same GIL. With several `layered` modes (`LoRAStacks.layered_fills`), the host-RAM cold
    starts run once per mode, interleaved, each on adapters of its own; the other figures take the first.
    Each figure is the p50 of `rounds` cold starts."""
    if not eng.stacks.layer_gates:  # an engine without gates fills whole whatever it is told
        layered = (False,)
    modes = len(layered)
    paths = b.adapters(eng, "c", 1 + (2 + modes) * rounds)  # warm; then per round: fresh, disk, host per mode
    eng.load_adapter("warm", str(paths[0]), wait=True)
    ttft(eng, "warmup", prompt, "warm")
    warm, fresh, disk = [], [], []
    host: list[list[float]] = [[] for _ in layered]
    fills = [0] * modes
    if TRACE:
        eng.step_trace = []
    for i in range(1, rounds + 1):  # interleaved so drift hits all alike
        # Each round's host-RAM adapters loaded just before it: the arena drops idle images least recently used
        # first, and ones loaded ahead but not yet asked for would go first (at 30 Llama-7B layers, 1 GiB holds 14).
        for m in range(modes):
            eng.load_adapter(f"h{m}-{i}", str(paths[(2 + m) * rounds + i]), wait=True)  # in host memory, in no slot
        time.sleep(0.2)  # let the loaders' threads go idle
        warm_version = eng.pool.lookup("warm")
        assert warm_version is not None and warm_version.state is AdapterState.RESIDENT  # "warm": in a slot
        warm.append(ttft(eng, f"w{i}", prompt, "warm"))
        for m, mode in enumerate(layered):
            version = eng.pool.lookup(f"h{m}-{i}")
            assert version is not None and version.state is AdapterState.HOST  # in host memory, in no slot
            eng.stacks.layered_fills, before = mode, eng.stacks.layered
            host[m].append(ttft(eng, f"hq{m}-{i}", prompt, f"h{m}-{i}"))
            fills[m] += eng.stacks.layered - before
        eng.stacks.layered_fills = layered[0]
        eng.load_adapter(f"f{i}", str(paths[i]), wait=True)
        fresh.append(ttft(eng, f"fq{i}", prompt, f"f{i}"))
        eng.load_adapter(f"d{i}", str(paths[rounds + i]), wait=False)  # registered, still on disk
        disk.append(ttft(eng, f"dq{i}", prompt, f"d{i}"))
    if TRACE:
        print_trace(eng, "cold-start TTFT (warm, host per mode, host just loaded, disk; 2 steps each)")
    host_ms, disk_ms, warm_ms = p50(host[0]) * 1e3, p50(disk) * 1e3, p50(warm) * 1e3
    report_loader(
        f"(d) cold start TTFT p50: warm {warm_ms:.2f} ms, host RAM {host_ms:.2f} ms ({host_ms / warm_ms:.2f}x warm), "
        f"disk {disk_ms:.2f} ms (+{disk_ms - warm_ms:.1f} ms)"
    )
    for m, mode in enumerate(layered):
        report_loader(
            f"(d) host RAM, layered fills {'on' if mode else 'off'}: {p50(host[m]) * 1e3:.2f} ms "
            f"({p50(host[m]) / p50(warm):.2f}x warm; {fills[m]} of {rounds} fills layered)"
        )
    if modes > 1:
        names = " / ".join("on" if mode else "off" for mode in layered[:2])
        report_loader(f"(d) host RAM TTFT, layered fills {names}: {p50(host[0]) / p50(host[1]):.3f}x")
    steady = steady_step_ms(eng, prompt, "warm", b.running)
    STEADY[(LOADER.rsplit(", layered fills", 1)[0], eng.config.layered_fills)] = steady
    report_loader(f"(d) steady decode, {b.running} requests on one adapter: {steady:.3f} ms a step")
    report_loader(
        f"(d) host RAM, sent as its load finished: {p50(fresh) * 1e3:.2f} ms ({p50(fresh) / p50(warm):.2f}x warm)"
    )
    version = eng.pool.lookup("h0-1")
    packed = None if version is None or version.weights is None else version.weights.packed
    if packed is not None and torch.cuda.is_available():  # what one host-RAM cold start has to move
        packed.to("cuda", non_blocking=True)
        sync()
        times = []
        for _ in range(10):
            t = time.perf_counter()
            packed.to("cuda", non_blocking=True)
            sync()
            times.append(time.perf_counter() - t)
        size = packed.numel() * packed.element_size()
        report_loader(
            f"(d) one adapter's slot image: {size / 2**20:.1f} MiB, pinned host->GPU p50 {p50(times) * 1e3:.2f} ms "
            f"({size / p50(times) / 1e9:.1f} GB/s)"
        )


def section_others_during_loads(b: Bench, eng: LLMEngine, prompt: list[int], cold_joins: bool = True) -> None:
    """(d) inter-token latency of `b.running` running base requests (16 by default): steady, while
    warm-adapter requests join, and while cold-adapter requests join (their adapters load from disk
    meanwhile). Cold adapters are registered as their requests arrive, once on the stepping thread itself and
    once on another thread, as the server's gRPC handlers do: the first puts the registration's header check
    (milliseconds of Python) into a gap of every running request, which a server's step loop never runs. Then
    loads alone: 12 adapters registered on another thread (as `adapterctl apply` does) and loading while no
    request for them joins, the goal's "during loads" without a joiner's prefill in the step. Then
    again with the running requests on adapters, as a LoRA gateway's are: requests on those adapters join,
    and cold ones, the latter with and without slot fills ahead (`EngineConfig.adapter_fills_ahead`).
    `cold_joins` False (section j): the warm joins alone."""
    paths = b.adapters(eng, "x", 72)
    for i in range(12):
        eng.load_adapter(f"xw{i}", str(paths[i]), wait=True)
        ttft(eng, f"xwarm{i}", prompt, f"xw{i}")

    def gaps(arrivals: str, tag: str, first_path: int = 12, running_on: list[str] | None = None) -> list[float]:
        """Others' gaps: `b.running` requests (base, or round-robin on the adapters `running_on`) while 12 requests
        join one every 4 steps (`arrivals`: none, warm, cold, cold-elsewhere, or running: on the running
        requests' own adapters), or, for `arrivals` loads, 12 adapters registered one every 4 steps on another
        thread with no request for them."""
        last: dict[str, float] = {}
        out: list[float] = []
        ended_in: list[int] = []  # the loop iteration in which each gap ended (--trace)
        phases: list[list[float]] = []  # per iteration: register+add, drain, step, sync (--trace)

        def sink(rid: str) -> Callable[[RequestOutput], None]:
            def record(o: RequestOutput) -> None:
                now = time.perf_counter()
                if o.token_ids and rid in last:
                    out.append(now - last[rid])
                    ended_in.append(k)
                last[rid] = now

            return record

        def joiner_sink(sent: float) -> Callable[[RequestOutput], None]:
            def record(o: RequestOutput) -> None:
                if o.token_ids and o.completion_tokens == 1:
                    joiner_ttft[tag].append(time.perf_counter() - sent)

            return record

        gc_pauses: list[float] = []
        gc_start = [0.0]
        waited: dict[str, int] = {}  # joiners' iterations spent waiting (--trace)
        joins: list[Future[None]] = []
        loads: list[Future[tuple[float, AdapterVersion]]] = []

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                gc_start[0] = time.perf_counter()
            else:
                gc_pauses.append(time.perf_counter() - gc_start[0])

        if TRACE:
            gc.callbacks.append(on_gc)
        warm_names = list(running_on or []) + ([f"xw{j}" for j in range(12)] if arrivals == "warm" else [])
        back_in_host_ram(eng, warm_names)
        for i in range(b.running):
            rid = f"bg{tag}{i}"
            own = running_on[i % len(running_on)] if running_on else None
            eng.add_request(rid, prompt, SamplingParams(max_tokens=80, ignore_eos=True), own, sink(rid))
        k = 0
        while eng.scheduler.running or eng.scheduler.waiting or k == 0:
            t0 = time.perf_counter()
            if arrivals != "none" and k % 4 == 2 and k // 4 < 12:
                j = k // 4
                name = {"warm": f"xw{j}", "running": f"xw{j % 4}"}.get(arrivals, f"xc{tag}{j}")
                params = SamplingParams(max_tokens=4, ignore_eos=True)
                if arrivals == "loads":  # register on an admin thread; no request joins
                    loads.append(admin.submit(register_only, name, str(paths[first_path + j])))
                elif arrivals == "cold-elsewhere":  # register, then request, on an admin thread
                    sink_to = joiner_sink(time.perf_counter())  # its TTFT includes the registration
                    joins.append(
                        admin.submit(join_cold, name, str(paths[first_path + j]), f"xq{tag}{k}", params, sink_to)
                    )
                else:
                    sent = time.perf_counter()  # a cold joiner's TTFT includes its registration, as elsewhere's
                    if arrivals == "cold":
                        eng.load_adapter(name, str(paths[first_path + j]), wait=False)
                        register_s.append(time.perf_counter() - sent)
                    eng.add_request(f"xq{tag}{k}", prompt, params, name, joiner_sink(sent))
            t1 = time.perf_counter()
            eng._drain_commands()
            t2 = time.perf_counter()
            if TRACE:
                explain_waits(eng, tag, k, waited)
            eng.step()
            t3 = time.perf_counter()
            sync()
            phases.append([t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3])
            k += 1
            if k > 400:
                break
        for join in joins:  # (raises what a registration raised)
            join.result()
        for load in loads:
            registered_at, version = load.result()
            eng.pool.wait_loaded(version, timeout=60)
            if version.settled_at is None:
                raise AssertionError(f"(d) {version.name} loaded with no time of its end")
            load_s.append(version.settled_at - registered_at)
        eng.run_until_idle()
        if eng.scheduler.waiting:  # a request the loop never started (the next phase would run it, unmeasured)
            raise AssertionError(f"(d) phase {tag} ended with {len(eng.scheduler.waiting)} requests never started")
        if TRACE:
            gc.callbacks.remove(on_gc)
        if TRACE and arrivals != "none":  # joins of every kind: their slowest gaps
            print(f"  [gaps {tag}] {len(gc_pauses)} GC runs, longest {max(gc_pauses, default=0) * 1e3:.1f} ms")
            slowest = sorted(range(len(out)), key=lambda i: -out[i])[: max(1, len(out) // 100)]
            by_iteration = {ended_in[i]: i for i in reversed(slowest)}  # one line per iteration, its longest gap
            for i in by_iteration.values():  # a gap spans the previous iteration's end and this one's start
                parts = " ".join(f"{p * 1e3:.1f}" for p in phases[ended_in[i]])
                print(
                    f"  [gaps {tag}] {out[i] * 1e3:.1f} ms ending in iteration {ended_in[i]}: "
                    f"register+add, drain, step, sync ms: {parts}"
                )
        return out

    register_s: list[float] = []
    joiner_ttft: defaultdict[str, list[float]] = defaultdict(list)  # joining requests' own TTFT, by gaps' tag
    admin = ThreadPoolExecutor(max_workers=1, thread_name_prefix="admin")

    load_s: list[float] = []  # loads alone: registration -> load ended

    def register_only(name: str, path: str) -> tuple[float, AdapterVersion]:
        return time.monotonic(), eng.load_adapter(name, path, wait=False)

    def join_cold(
        name: str, path: str, rid: str, params: SamplingParams, sink: Callable[[RequestOutput], None]
    ) -> None:
        t = time.perf_counter()
        eng.load_adapter(name, path, wait=False)
        eng.add_request(rid, prompt, params, name, sink)
        register_s.append(time.perf_counter() - t)

    gaps("none", "warmup")
    folded = eng.forward.folded_prompts
    steady, warm = gaps("none", "s"), gaps("warm", "w")
    on_adapters = [f"xw{j}" for j in range(4)]  # the running requests' adapters, as a LoRA gateway's are
    if not cold_joins:
        steady_lora = gaps("none", "sl", running_on=on_adapters)
        running_lora = gaps("running", "rl", running_on=on_adapters)
        admin.shutdown()
        report_loader(
            f"(d) others' p99 inter-token latency, {b.running} base requests: steady {p99(steady) * 1e3:.2f} ms, "
            f"while 12 warm-adapter requests join {p99(warm) * 1e3:.2f} ms ({p99(warm) / p99(steady):.2f}x); "
            f"their TTFT p50 {p50(joiner_ttft['w']) * 1e3:.2f} ms. On 4 adapters: steady "
            f"{p99(steady_lora) * 1e3:.2f} ms, joins on them {p99(running_lora) * 1e3:.2f} ms "
            f"({p99(running_lora) / p99(steady_lora):.2f}x); their TTFT p50 {p50(joiner_ttft['rl']) * 1e3:.2f} ms. "
            f"Prompts run as decode rows: {eng.forward.folded_prompts - folded}"
        )
        return
    if TRACE:
        eng.step_trace = []
    cold = gaps("cold", "c")
    if TRACE:
        print_trace(eng, "cold joins")
        print(f"  [cold joins] register (validate + submit) on the caller's thread: max {max(register_s) * 1e3:.1f} ms")
    report_loader(
        f"(d) others' inter-token latency p99, {b.running} base requests: steady {p99(steady) * 1e3:.2f} ms; "
        f"while 12 warm-adapter requests join {p99(warm) * 1e3:.2f} ms ({p99(warm) / p99(steady):.2f}x steady); "
        f"while 12 cold-adapter requests "
        f"join and load {p99(cold) * 1e3:.2f} ms ({p99(cold) / p99(steady):.2f}x steady, "
        f"{p99(cold) / p99(warm):.2f}x the warm joins: the loads' own share)"
    )
    report_loader(
        f"(d) the joining requests' own TTFT p50 under this load: warm adapters {p50(joiner_ttft['w']) * 1e3:.2f} ms, "
        f"cold (loading from disk) {p50(joiner_ttft['c']) * 1e3:.2f} ms"
    )
    if TRACE:
        eng.step_trace = []
        register_s.clear()
    elsewhere = gaps("cold-elsewhere", "e", first_path=24)
    if TRACE:
        print_trace(eng, "cold joins registered elsewhere")
        print(f"  [cold joins elsewhere] register + add on the admin thread: max {max(register_s) * 1e3:.1f} ms")
    report_loader(
        f"(d) same cold joins registered on another thread (as by the server's gRPC handlers): p99 "
        f"{p99(elsewhere) * 1e3:.2f} ms ({p99(elsewhere) / p99(steady):.2f}x steady, "
        f"{p99(elsewhere) / p99(warm):.2f}x the warm joins)"
    )
    loads_alone = gaps("loads", "l", first_path=60)
    for j in range(12):  # (the phases after it keep the host tier and arena as before it was added)
        eng.unload_adapter(f"xcl{j}")
    report_loader(
        f"(d) while 12 adapters load from disk with no request for them (registered on another thread): others' "
        f"p99 {p99(loads_alone) * 1e3:.2f} ms ({p99(loads_alone) / p99(steady):.2f}x steady); registration -> load "
        f"ended p50 {p50(load_s) * 1e3:.1f} ms (slowest {max(load_s) * 1e3:.1f})"
    )
    # The same, with the running requests on adapters: the steady step then runs the LoRA kernels already,
    # and a join adds only its own rows and its adapter's load.
    steady_lora, running_lora = (
        gaps("none", "sl", running_on=on_adapters),
        gaps("running", "rl", running_on=on_adapters),
    )
    cold_lora = gaps("cold-elsewhere", "ol", first_path=36, running_on=on_adapters)
    fills_ahead, eng.fills_ahead = eng.fills_ahead, 0
    cold_lora_on_admission = gaps("cold-elsewhere", "oa", first_path=48, running_on=on_adapters)
    eng.fills_ahead = fills_ahead
    admin.shutdown()
    for tag in ("e", "ol", "oa"):
        versions = (eng.pool.lookup(f"xc{tag}{j}") for j in range(12))
        served = [v.requests_served if v is not None else 0 for v in versions]
        if served != [1] * 12:
            raise AssertionError(f"(d) the cold joins registered on another thread did not all run: {served}")
    report_loader(
        f"(d) with the {b.running} running requests on 4 adapters: others' p99 steady "
        f"{p99(steady_lora) * 1e3:.2f} ms; while 12 requests on those adapters join {p99(running_lora) * 1e3:.2f} ms "
        f"({p99(running_lora) / p99(steady_lora):.2f}x steady; their TTFT p50 {p50(joiner_ttft['rl']) * 1e3:.2f} ms); "
        f"while 12 cold-adapter requests join and load, registered on another thread, {p99(cold_lora) * 1e3:.2f} ms "
        f"({p99(cold_lora) / p99(steady_lora):.2f}x steady)"
    )
    report_loader(
        f"(d) those cold joins with slots filled only when a step admits the request (adapter_fills_ahead 0, "
        f"against {fills_ahead}): {p99(cold_lora_on_admission) * 1e3:.2f} ms "
        f"({p99(cold_lora_on_admission) / p99(steady_lora):.2f}x steady; fills ahead / on admission "
        f"{p99(cold_lora) / p99(cold_lora_on_admission):.2f}x); their own TTFT p50 "
        f"{p50(joiner_ttft['ol']) * 1e3:.2f} against {p50(joiner_ttft['oa']) * 1e3:.2f} ms"
    )


SERVED_PHASES = ("steady", "warm joins", "loads alone", "cold joins")
SERVED_DIAGNOSTICS = False  # --served-diagnostics: (s) prints each phase's counters, slowest gaps and arrivals


def section_served_loads(
    b: Bench,
    eng: LLMEngine,
    prompt: list[int],
    rounds: int = 3,
    pacer_modes: tuple[str, ...] = ("on",),
    fill_modes: tuple[bool, ...] = (True,),
) -> None:
    """(s) (d) under the engine's own step loop, as a server runs it: the engine thread steps (with async steps,
    composing each step while the one before runs on the GPU), and everything arrives from this thread, as
    from a server's handlers.

    First, bursts: `b.running` requests sent together to the idle engine, their prompts run three ways in turn
    (one eager pass over all their rows, a decode graph per group, a prefill graph each;
    `StepForward._prompt_groups`), 6 bursts each way; `rounds` 0 stops there.

    Then the phases: `b.running` base requests of 80 tokens decode in each; 12 arrivals come one every 4 steady
    steps' time: none (steady), requests on warm adapters (warm joins), adapters registered with no request
    for them (loads alone), or adapters registered and a request for each (cold joins, loading from disk).
    Each phase starts its running requests afresh, so all meet the same KV lengths, and the phases take turns
    over `rounds` rounds, each round starting from the next phase. Others' gaps are pooled per phase.
    `pacer_modes`: all of it with the engine's late composition on, by kind or off (`pacers_for`), where the
    engine has it (async steps); `fill_modes`: with slot fills waiting for the slot's last step only (True) or
    for all the work queued before them (False; `LoRAStacks.fill_beside_steps`). Each round runs every pair of modes, in
    an order that moves on by one each round.

    Starts the engine's step loop: the engine can only be stopped after this section."""
    eng.start()
    warm_names = [f"sw{i}" for i in range(12)]
    modes = [(p, f) for p in (pacer_modes if eng.pacer is not None else ("off",)) for f in fill_modes]
    paths = b.adapters(eng, "s", 12 + 24 * rounds * len(modes)) if rounds else []  # (0 rounds: bursts only)
    for name, path in zip(warm_names, paths, strict=False):
        eng.load_adapter(name, str(path), wait=True)
    fresh = iter(paths[12:])  # (each adapter loads from disk once)
    original, pacers = eng.pacer, pacers_for(eng, tuple(p for p, _ in modes))

    def phase_run(phase: str, tag: str, interval: float) -> tuple[list[float], list[float], list[float]]:
        """Others' gaps, the joiners' TTFTs and the loads' times (registration -> load ended) of one phase."""
        out: list[float] = []
        ttfts: list[float] = []
        load_s: list[float] = []
        last: dict[str, float] = {}
        ended = threading.Semaphore(0)
        reasons: list[str] = []  # every request's finish reason (80 or 4 tokens: "length")
        all_decoding = threading.Event()  # every running request has its first token

        def gap_sink(rid: str) -> Callable[[RequestOutput], None]:
            def record(o: RequestOutput) -> None:
                now = time.perf_counter()
                if o.token_ids and rid in last:
                    out.append(now - last[rid])
                    gap_at.append(now - began)
                last[rid] = now
                if len(last) == b.running:
                    all_decoding.set()
                if o.finish_reason:
                    reasons.append(o.finish_reason)
                    ended.release()

            return record

        def joiner_sink(sent: float) -> Callable[[RequestOutput], None]:
            def record(o: RequestOutput) -> None:
                if o.token_ids and o.completion_tokens == 1:
                    ttfts.append(time.perf_counter() - sent)
                    firsts.append((time.perf_counter() - began, eng.steps))
                if o.finish_reason:
                    reasons.append(o.finish_reason)
                    ended.release()

            return record

        if phase == "warm joins":
            back_in_host_ram(eng, warm_names)
        before = counters()
        began = time.perf_counter()
        gap_at: list[float] = []  # when each gap in `out` ended, from `began`
        arrivals: list[tuple[float, float, int]] = []  # per arrival: sent, add returned (from `began`), step then
        for i in range(b.running):
            rid = f"sbg{tag}{i}"
            eng.add_request(rid, prompt, SamplingParams(max_tokens=80, ignore_eos=True), None, gap_sink(rid))
        joiners, registered = 0, []
        firsts: list[tuple[float, int]] = []  # joiners' first tokens: when (from `began`), the engine's step count
        # Past the running requests' prefills: arrivals during them would all join one step after them.
        if not all_decoding.wait(timeout=60):
            raise AssertionError(f"(s) {phase}: the running requests did not all start within 60 s")
        start = time.perf_counter() + interval
        for j in range(12 if phase != "steady" else 0):
            time.sleep(max(0.0, start + j * interval - time.perf_counter()))
            sent = time.perf_counter()
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            if phase == "warm joins":
                eng.add_request(f"sq{tag}{j}", prompt, params, warm_names[j], joiner_sink(sent))
                joiners += 1
            else:
                name = f"s{tag}{j}"
                registered.append((time.monotonic(), eng.load_adapter(name, str(next(fresh)), wait=False)))
                if phase == "cold joins":
                    eng.add_request(f"sq{tag}{j}", prompt, params, name, joiner_sink(sent))
                    joiners += 1
            arrivals.append((sent - began, time.perf_counter() - began, eng.steps))
        for _ in range(b.running + joiners):
            if not ended.acquire(timeout=60):
                raise AssertionError(f"(s) {phase}: a request did not end within 60 s")
        if set(reasons) != {"length"}:
            raise AssertionError(f"(s) {phase}: requests ended {sorted(set(reasons))}, not all by length")
        for at, version in registered:
            eng.pool.wait_loaded(version, timeout=60)
            assert version.settled_at is not None
            if phase == "loads alone":
                load_s.append(version.settled_at - at)
            eng.unload_adapter(version.name)  # (its host copy makes room for the next phases' loads)
        if SERVED_DIAGNOSTICS:
            after = counters()
            moved = " ".join(f"{k} {after[k] - before[k]}" for k in after)
            slowest = sorted(range(len(out)), key=lambda i: -out[i])[:64:8]
            print(
                f"  [(s) {phase} {tag}] {time.perf_counter() - began:.3f} s: {moved}; slowest gaps (ms @ ms): "
                + " ".join(f"{out[i] * 1e3:.1f}@{gap_at[i] * 1e3:.0f}" for i in slowest)
                + "; arrivals (sent, added ms, step): "
                + " ".join(f"{a * 1e3:.0f},{b * 1e3:.0f},{k}" for a, b, k in arrivals)
                + "; first tokens (ms, step): "
                + " ".join(f"{t * 1e3:.0f},{k}" for t, k in sorted(firsts))
            )
        return out, ttfts, load_s

    def counters() -> dict[str, int]:
        graphs, prefill_graphs = eng.forward.graphs, eng.forward.prefill_graphs
        return {
            "steps": eng.steps,
            "dry": eng.dry_launches,
            "decode graphs": graphs.replays if graphs is not None else 0,
            "prefill graphs": prefill_graphs.replays if prefill_graphs is not None else 0,
            "eager": eng.forward.eager_runs,
            "folded": eng.forward.folded_prompts,
            "slot misses": eng.pool.slot_misses,
            "fills ahead": eng.pool.fills_ahead,
        }

    def burst(way: str, tag: str) -> list[float]:
        """First-token times of `b.running` requests sent together to the idle engine, their prompts run as
        `way`: "one pass" (prompt groups, more rows than a graph holds in one eager pass), "graphs" (prompt
        groups, a decode graph replay per group) or "prefill graphs" (one each)."""
        forward = eng.forward
        forward.group_prompts, forward.one_pass_for_groups = way != "prefill graphs", way == "one pass"
        firsts: list[float] = []
        ended = threading.Semaphore(0)

        def sink(o: RequestOutput) -> None:
            if o.token_ids and o.completion_tokens == 1:
                firsts.append(time.perf_counter() - sent)
            if o.finish_reason:
                ended.release()

        # The engine thread holds at a command until all are queued, so that one step admits the whole burst
        # (else the first could start with a few, and the rest fold into its decode graph).
        gate = threading.Event()

        def hold() -> None:
            gate.wait(timeout=60)

        eng._commands.put(hold)
        grouped, passes = forward.grouped_prompts, forward.group_passes
        sent = time.perf_counter()
        for i in range(b.running):
            eng.add_request(f"sb{tag}{i}", prompt, SamplingParams(max_tokens=2, ignore_eos=True), None, sink)
        gate.set()
        for _ in range(b.running):
            if not ended.acquire(timeout=60):
                raise AssertionError("(s) a request of a burst did not end within 60 s")
        if forward.graphs is not None and forward.group_prompts:
            if forward.grouped_prompts - grouped < b.running - 1:
                raise AssertionError(f"(s) a burst ran {forward.grouped_prompts - grouped} prompts grouped ({way})")
            if (forward.group_passes - passes > 0) != (way == "one pass"):
                raise AssertionError(f"(s) a burst ran {forward.group_passes - passes} eager group passes ({way})")
        forward.group_prompts, forward.one_pass_for_groups = True, True
        return firsts

    ways = ("one pass", "graphs", "prefill graphs")
    bursts: dict[str, list[list[float]]] = {way: [] for way in ways}
    for r in range(6):
        for i in range(len(ways)):  # each first as often
            way = ways[(r + i) % len(ways)]
            bursts[way].append(burst(way, f"{r}{i}"))
    if eng.forward.graphs is not None:
        first = {way: p50([p50(one) for one in bursts[way]]) for way in ways}
        last = {way: p50([max(one) for one in bursts[way]]) for way in ways}
        base = "prefill graphs"
        report_loader(
            f"(s) {b.running} requests sent together to the idle engine, p50 of 6 bursts each, first token p50 "
            f"(the burst's last): "
            + "; ".join(
                f"{way} {first[way] * 1e3:.1f} ms ({last[way] * 1e3:.1f}), {first[way] / first[base]:.3f}x {base}"
                for way in ways
            )
        )
    if not rounds:
        return

    def use(mode: tuple[str, bool]) -> None:
        paced, beside = mode
        eng.pacer = pacers[paced]  # (read by the engine thread once per step)
        eng.stacks.fill_beside_steps = beside

    gaps = {m: {phase: list[float]() for phase in SERVED_PHASES} for m in modes}
    ttfts = {m: {phase: list[float]() for phase in SERVED_PHASES} for m in modes}
    loads = {m: list[float]() for m in modes}
    per_round: dict[tuple[str, bool], list[dict[str, float]]] = {m: [] for m in modes}
    use(modes[0])
    interval = 4 * p50(phase_run("steady", "w", 0.0)[0])  # a warm-up, and the arrivals' spacing: 4 steady steps
    for r in range(rounds):
        for i in range(len(modes)):
            mode = modes[(r + i) % len(modes)]
            use(mode)
            order = SERVED_PHASES[r % len(SERVED_PHASES) :] + SERVED_PHASES[: r % len(SERVED_PHASES)]
            row: dict[str, float] = {}
            for k, phase in enumerate(order):
                tag = f"{PACER_TAGS[mode[0]]}{mode[1]:d}{r}{k}"  # (in request ids and --served-diagnostics)
                out, own, load_s = phase_run(phase, tag, interval)
                gaps[mode][phase] += out
                ttfts[mode][phase] += own
                loads[mode] += load_s
                row[phase] = p99(out)
            per_round[mode].append(row)
    eng.pacer, eng.stacks.fill_beside_steps = original, True  # the engine's defaults
    for mode in modes:
        paced, beside = mode
        steady = p99(gaps[mode]["steady"])
        label = ", fills " + ("beside the step in flight" if beside else "after all queued work")
        label += "" if original is None else f", compose late {paced}"
        for phase in SERVED_PHASES[1:]:
            rounds_x = ", ".join(f"{row[phase] / row['steady']:.2f}x" for row in per_round[mode])
            their = f"; their TTFT p50 {p50(ttfts[mode][phase]) * 1e3:.2f} ms" if ttfts[mode][phase] else ""
            load = f"; registration -> load ended p50 {p50(loads[mode]) * 1e3:.1f} ms" if phase == "loads alone" else ""
            report_loader(
                f"(s) the engine's own step loop{label}, {b.running} base requests decoding, others' inter-token "
                f"p99 while 12 {phase} arrive: {p99(gaps[mode][phase]) * 1e3:.2f} ms against steady "
                f"{steady * 1e3:.2f} ms ({p99(gaps[mode][phase]) / steady:.2f}x; by round {rounds_x}){their}{load}"
            )


def back_in_host_ram(eng: LLMEngine, names: list[str]) -> None:
    """Load the adapters `names` back into host RAM where the host tier dropped them, and wait: the phases of
    (d) that count them as warm. At Llama-7B dims the 1 GiB arena holds about 26 images, and the cold phases
    before push these out; the running requests of the steady phase on adapters then waited for disk loads
    while its loop counted 400 empty steps, and the joins of the next phase queued behind them (584 ms
    TTFT in the first run of the session after stop 28)."""
    versions = []
    for name in names:
        version = eng.pool.lookup(name)
        if version is None:
            raise AssertionError(f"(d) warm adapter {name} is not registered")
        eng.pool.ready(version)  # starts the load of one no longer in host RAM
        versions.append(version)
    for version in versions:
        eng.pool.wait_loaded(version, timeout=120)


def explain_waits(eng: LLMEngine, tag: str, k: int, waited: dict[str, int]) -> None:
    """Diagnostics (--trace): before iteration `k`'s step, why each joiner still waiting after 3 iterations is
    not admitted; printed once per request."""
    pool = eng.pool
    for seq in eng.scheduler.waiting:
        if not seq.request_id.startswith("xq"):
            continue
        waited[seq.request_id] = waited.get(seq.request_id, 0) + 1
        if waited[seq.request_id] != 3:
            continue
        v = seq.adapter
        holders = ", ".join(f"{h.name}#{h.id}(active {h.active})" if h is not None else "free" for h in pool._slots)
        about = (
            "base"
            if v is None
            else f"{v.name}#{v.id} slot {v.slot} weights {v.weights is not None} loading {v.loading is not None} "
            f"retired {v.retired} current {pool.current(v) is v}"
        )
        print(
            f"  [waits {tag}] {seq.request_id} waiting 3 iterations at {k}: adapter {about}; kv free "
            f"{eng.kv.free_slots}, waiting {len(eng.scheduler.waiting)}, running {len(eng.scheduler.running)}, "
            f"ahead {[s.request_id for s in eng.scheduler.waiting[:3]]}; slots: {holders}"
        )


def print_trace(eng: LLMEngine, label: str) -> None:
    """The slowest steps of `eng.step_trace` by phase (diagnostics; --trace)."""
    trace = eng.step_trace or []
    names = ("schedule", "decode", "prefill", "eager", "sample")
    if not trace:
        return
    mean = [statistics.fmean(t[0][i] if i < len(t[0]) else 0.0 for t in trace) * 1e3 for i in range(5)]
    print(
        f"  [{label}] {len(trace)} steps; mean ms " + " ".join(f"{n} {m:.2f}" for n, m in zip(names, mean, strict=True))
    )
    for phases, (admitted, misses) in sorted(trace, key=lambda t: -sum(t[0]))[:5]:
        ms = " ".join(f"{n} {p * 1e3:.1f}" for n, p in zip(names, phases, strict=True))
        print(f"  [{label}] slow step {sum(phases) * 1e3:.1f} ms: {ms}; admitted {admitted}, slot misses {misses}")
    eng.step_trace = None


def zipf_trace(n: int, adapters: int, s: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** s for i in range(adapters)]
    order = list(range(adapters))
    rng.shuffle(order)  # popularity unrelated to registration order
    return [order[i] for i in rng.choices(range(adapters), weights=weights, k=n)]


def timed_traffic(eng: LLMEngine, prompt: list[int], names: list[str | None], rate: float) -> list[float]:
    """Requests arrive at `rate` per second (fixed spacing) while this thread steps; TTFT of each, from its
    arrival time."""
    first: dict[int, float] = {}
    arrive: dict[int, float] = {}

    def sink(i: int) -> Callable[[RequestOutput], None]:
        def record(o: RequestOutput) -> None:
            if o.token_ids:
                first.setdefault(i, time.perf_counter())

        return record

    start = time.perf_counter()
    nxt = 0
    while nxt < len(names) or eng.scheduler.running or eng.scheduler.waiting or eng._pending:
        now = time.perf_counter()
        while nxt < len(names) and start + nxt / rate <= now:
            i = nxt
            arrive[i] = start + i / rate
            eng.add_request(
                f"z{id(names)}-{i}",
                prompt,
                SamplingParams(max_tokens=8, ignore_eos=True),
                names[i],
                sink(i),
            )
            nxt += 1
        eng._drain_commands()
        eng._reap()
        if eng.scheduler.has_work():
            eng.step()
        else:
            time.sleep(0.0002)
    return [first[i] - arrive[i] for i in range(len(names))]


def section_zipf(b: Bench, prompt: list[int], requests: int, rate: float, pinned_mb: int) -> None:
    """(e) 500 adapters (all in host RAM), 64 GPU slots, Zipf(1.0) popularity: p99 TTFT vs a one-adapter run
    with the same arrivals, and the slot hit rate of our eviction policy vs plain LRU on the same trace.

    The loaders' pinned arena bounds the host tier in bytes (`pinned_mb`): at Llama-7B dims the default 1 GiB
    holds about 80 of these adapters, so the section asks for room for all 500 and reports how many stayed."""
    results: dict[str, tuple[list[float], float]] = {}
    paths: list[Path] = []
    trace = zipf_trace(requests, 500, 1.0, seed=7)
    for policy in ("frequency", "lru"):
        eng = b.engine(
            lora_slots=64,
            host_adapter_cache=512,
            adapter_eviction=policy,
            max_waiting=100_000,
            pinned_adapter_memory_mb=pinned_mb,
        )
        if not paths:
            paths = b.adapters(eng, "z", 500, rank=16, modules=("q_proj", "v_proj"))
        for i, path in enumerate(paths):
            eng.load_adapter(f"z{i}", str(path), wait=True)
        held = sum(v.state in (AdapterState.HOST, AdapterState.RESIDENT) for v in eng.pool.versions())
        print(f"  [zipf {policy}] {held} of 500 adapters in host RAM or a slot (pinned arena {pinned_mb} MiB)")
        timed_traffic(eng, prompt, ["z0"] * 64, rate)  # warm-up
        # Both engines run the one-adapter traffic, so that both policies start the Zipf trace with the same
        # history (z0's many hits would otherwise weigh on one policy only); the figure is the first engine's.
        one_adapter = timed_traffic(eng, prompt, ["z0"] * requests, rate)
        results.setdefault("one adapter", (one_adapter, 1.0))
        hits0, misses0 = eng.pool.slot_hits, eng.pool.slot_misses
        if TRACE:
            eng.step_trace = []
        ttfts = timed_traffic(eng, prompt, [f"z{i}" for i in trace], rate)
        if TRACE:
            print_trace(eng, f"zipf {policy}")
        hits, misses = eng.pool.slot_hits - hits0, eng.pool.slot_misses - misses0
        results[policy] = (ttfts, hits / max(hits + misses, 1))
        eng.stop()
        del eng
        free_gpu_memory()
    one = p99(results["one adapter"][0])
    for policy in ("frequency", "lru"):
        t, hit = results[policy]
        report(
            f"(e) 500 adapters / 64 slots, Zipf 1.0, {requests} requests at {rate:.0f}/s, eviction {policy}: "
            f"p99 TTFT {p99(t) * 1e3:.2f} ms ({p99(t) / one:.2f}x one-adapter {one * 1e3:.2f} ms), "
            f"p50 {p50(t) * 1e3:.2f} ms, slot hit rate {hit:.3f}"
        )
    report(f"(e) hit rate ours / LRU: {results['frequency'][1] / max(results['lru'][1], 1e-9):.2f}x")


class LoadTimeline:
    """--trace: when each task of an engine's loader processes was submitted, ran in its worker (the tasks that
    return their own start and end: `fill_layers`) and was seen done by the engine process; one clock for all
    processes (`time.perf_counter`, CLOCK_MONOTONIC)."""

    def __init__(self, eng: LLMEngine) -> None:
        loader = eng.pool._loader
        if not isinstance(loader, ProcessLoader):
            raise SystemExit("--trace of (f) needs --loaders process")
        self.events: list[tuple[str, float, Future[object]]] = []
        self.done: dict[int, float] = {}
        self.steps: list[tuple[float, float]] = []  # the engine steps run while the load ran
        self.loaded: list[float] = []  # when the pool took each finished load (`AdapterPool.on_loaded`)
        eng.pool.on_loaded.append(lambda: self.loaded.append(time.perf_counter()))
        run = loader._run

        def traced(fn: Callable[..., object], *args: object, worker: int | None = None) -> Future[object]:
            future = run(fn, *args, worker=worker)  # a split load's parts each go to a worker of their own
            self.events.append((fn.__name__, time.perf_counter(), future))
            future.add_done_callback(lambda f: self.done.setdefault(id(f), time.perf_counter()))
            return future

        loader._run = traced  # type: ignore[method-assign,assignment]

    def clear(self) -> None:
        self.events.clear()
        self.done.clear()
        self.steps.clear()
        self.loaded.clear()

    def print(self, swap: int, t0: float, marks: dict[str, float]) -> None:
        """One line per task and mark, in ms from `t0` (the apply)."""

        def ms(t: float | None) -> str:
            return "-" if t is None else f"{(t - t0) * 1e3:.1f}"

        for name, submitted, future in self.events:
            ran = future.result() if future.done() and not future.cancelled() and not future.exception() else None
            inside = f", in worker {ms(ran[0])}-{ms(ran[1])}" if isinstance(ran, tuple) else ""
            seen = self.done.get(id(future))
            print(f"  [swap {swap}] {name}: submitted {ms(submitted)}{inside}, seen done {ms(seen)}")
        print(f"  [swap {swap}] steps while loading: " + " ".join(f"{ms(a)}-{ms(b)}" for a, b in self.steps))
        loaded = {f"pool took load {i}": t for i, t in enumerate(self.loaded)}
        print(f"  [swap {swap}] " + ", ".join(f"{mark} {ms(t)}" for mark, t in {**loaded, **marks}.items()))


PACER_TAGS = {"on": "n", "by-kind": "k", "off": "f"}  # the modes --compose-late takes, and (s)'s short names
COMPOSE_LATE = tuple(PACER_TAGS)


def pacers_for(eng: LLMEngine, modes: tuple[str, ...]) -> dict[str, ComposePacer | None]:
    """The pacer each `--compose-late` mode puts on `eng`: its own where it is of that kind, else a new one of
    its slack; none for off, or where the engine composes no step late (no async steps)."""
    own = eng.pacer
    pacers: dict[str, ComposePacer | None] = {}
    for mode in modes:
        by_kind = mode == "by-kind"
        if own is None or mode == "off":
            pacers[mode] = None
        else:
            pacers[mode] = own if own.by_kind is by_kind else ComposePacer(slack_s=own.slack_s, by_kind=by_kind)
    return pacers


def longest(pacer: ComposePacer, prompts: bool) -> float:
    """The longest composition in `pacer`'s window of steps that took in prompts or only decoded (0 if none)."""
    longest = pacer.longest_composition(prompts)
    return 0.0 if longest is None else longest


def section_hot_swap(
    b: Bench,
    eng: LLMEngine,
    prompt: list[int],
    swaps: int = 9,
    load_ahead: tuple[bool, ...] = (True,),
    compose_late: tuple[str, ...] = ("on",),
) -> None:
    """(f) apply a new version while traffic runs: apply -> switch (staged load) -> first token on it. The
    request timed arrives as the pool switches to the new version (from the loader's thread, as a server's
    next request would under steady traffic). With several `load_ahead` settings (the pool's: the new
    version's load started beside its check, or after it) or `compose_late` ones (the engine's pacer on, by
    kind, or off: `pacers_for`), the swaps take each pair in turn, `swaps` each."""
    if eng.pacer is None:  # no async steps: nothing composes late, and the modes would be one
        compose_late = ("off",)
    modes = [(ahead, late) for ahead in load_ahead for late in compose_late]
    v1, *v2s = b.adapters(eng, "swap", swaps * len(modes) + 1)  # single swaps vary by a step or a collection
    eng.load_adapter("swap", str(v1), wait=True)
    ttft(eng, "sw0", prompt, "swap")
    pacer, pacers = eng.pacer, pacers_for(eng, compose_late)
    # Per setting: apply -> first token, apply -> switch (when the pool took the load and the request arrived)
    # and apply -> load done (the loader's future; the apply's return if it was done by then).
    by_mode: dict[tuple[bool, str], tuple[list[float], list[float], list[float]]] = {m: ([], [], []) for m in modes}
    # Per setting with a pacer, as the timed request arrived: its step estimate, the composition it holds a
    # decode-only step to, and its window's longest composition of a decode-only step and of a prompt step.
    estimated: dict[tuple[bool, str], list[tuple[float, float, float, float]]] = {m: [] for m in modes}
    timeline = LoadTimeline(eng) if TRACE else None
    once = threading.Lock()  # the loader's thread and this one may both see a switch
    for i, v2 in enumerate(v2s):
        mode = modes[i % len(modes)]
        eng.pool.load_ahead = mode[0]
        eng.pacer = pacers[mode[1]]
        totals, switches, loads = by_mode[mode]
        decoding: set[str] = set()  # background requests past their second token
        for j in range(8):  # live traffic on v1
            eng.add_request(
                f"bgs{i}{j}",
                prompt,
                SamplingParams(max_tokens=40, ignore_eos=True),
                "swap",
                lambda o, rid=f"bgs{i}{j}", decoding=decoding: (  # type: ignore[misc]
                    decoding.add(rid) if o.completion_tokens >= 2 else None
                ),
            )
        # The new version is applied while the traffic decodes. Stepped only until the requests were admitted,
        # the first step of the timed loop below waited for their 8 prefills, queued on the GPU by the step
        # before it (about 23 of the 27 ms "staged load" at Llama-7B dims, stop 28's --trace). Before that the
        # command queue was not drained either, and the prefills themselves ran inside the timed loop.
        while len(decoding) < 8:
            eng._drain_commands()
            eng.step()
        if len(eng.scheduler.running) < 8:
            raise AssertionError("(f) the background traffic is not decoding when the new version is applied")
        if timeline is not None:
            timeline.clear()
        old = eng.pool.lookup("swap")
        first: list[float] = []
        arrived: list[float] = []

        def arrive(
            i: int = i,
            old: AdapterVersion | None = old,
            first: list[float] = first,
            arrived: list[float] = arrived,
            mode: tuple[bool, str] = mode,
        ) -> None:
            """The timed request, sent once the pool serves the new version (a loader thread calls this)."""
            with once:
                if arrived or eng.pool.lookup("swap") is old:
                    return
                arrived.append(time.perf_counter())
                paced = eng.pacer
                estimates = paced.estimates(prompts=False) if paced is not None else None
                if paced is not None and estimates is not None:
                    estimated[mode].append((*estimates, longest(paced, False), longest(paced, True)))
                send_timed(eng, f"sw{i}", prompt, "swap", first)

        # Ahead of the engine's own wake-up, so the request is queued when the engine thread wakes.
        eng.pool.on_loaded.insert(0, arrive)
        t0 = time.perf_counter()
        new: AdapterVersion = eng.load_adapter("swap", str(v2), wait=False)
        registered = time.perf_counter()
        loaded: list[float] = []
        loading = new.loading
        if loading is not None:  # (None: loaded already)
            loading.add_done_callback(lambda _, loaded=loaded: loaded.append(time.perf_counter()))  # type: ignore[misc]
        arrive()  # (loaded before the apply returned)
        while not first:  # the old version keeps serving while the new one loads
            eng._drain_commands()
            if eng.scheduler.has_work():
                stepped = time.perf_counter()
                eng.step()
                if timeline is not None and not arrived:
                    timeline.steps.append((stepped, time.perf_counter()))
            else:
                time.sleep(0.0002)
        eng.pool.on_loaded.remove(arrive)
        switched = arrived[0]
        totals.append(first[0] - t0)
        switches.append(switched - t0)
        loads.append((loaded[0] if loaded else registered) - t0)
        if timeline is not None:
            timeline.print(i, t0, {"registered": registered, "switch": switched, "first token": first[0]})
        eng.run_until_idle()
        if new.requests_served < 1:
            raise AssertionError("(f) the request timed after the switch was not served by the new version")
    eng.pacer = pacer
    for (ahead, late), (totals, switches, loads) in by_mode.items():
        label = ""
        if len(load_ahead) > 1:
            label += f", load ahead of the check {'on' if ahead else 'off'}"
        if len(compose_late) > 1:
            label += f", compose late {late}"
        report_loader(
            f"(f) hot swap under load{label}, p50 of {len(totals)}: apply -> first token on the new version "
            f"{p50(totals) * 1e3:.1f} ms, slowest {max(totals) * 1e3:.1f} ms (apply -> switch, i.e. the staged load, "
            f"{p50(switches) * 1e3:.1f} ms; switch -> first token "
            f"{p50([t - w for t, w in zip(totals, switches, strict=True)]) * 1e3:.1f} ms)"
        )
        report_loader(
            f"(f) apply -> load done{label}: p50 {p50(loads) * 1e3:.1f} ms "
            f"(min {min(loads) * 1e3:.1f}, max {max(loads) * 1e3:.1f})"
        )
        if estimated[(ahead, late)]:
            steps, held, decode, prompts = (list(column) for column in zip(*estimated[(ahead, late)], strict=True))
            report_loader(
                f"(f) the pacer's estimates as the timed request arrived{label}, p50: step {p50(steps) * 1e3:.2f} ms "
                f"(shortest {min(steps) * 1e3:.2f}), a decode-only step's composition held to {p50(held) * 1e3:.2f} ms "
                f"(longest {max(held) * 1e3:.2f}); its window's longest composition of a decode-only step "
                f"{p50(decode) * 1e3:.2f} ms, of a step with prompts {p50(prompts) * 1e3:.2f} ms"
            )
    if len(load_ahead) == 2:
        on = [t for m, (ts, _, _) in by_mode.items() if m[0] for t in ts]
        off = [t for m, (ts, _, _) in by_mode.items() if not m[0] for t in ts]
        report_loader(f"(f) load ahead of the check on / off, p50 apply -> first token: {p50(on) / p50(off):.3f}x")
    totals_by = {late: [t for m, (ts, _, _) in by_mode.items() if m[1] == late for t in ts] for late in compose_late}
    for late, base in (("on", "off"), ("by-kind", "off"), ("by-kind", "on")):
        if late in totals_by and base in totals_by:
            ratio = p50(totals_by[late]) / p50(totals_by[base])
            report_loader(f"(f) compose late {late} / {base}, p50 apply -> first token: {ratio:.3f}x")


PROBE_STEPS = 6  # (p): steps an arrival may take to its first token (it arrives within 15 ms)


def section_pacing(
    b: Bench,
    eng: LLMEngine,
    prompt: list[int],
    slacks_ms: list[float],
    rounds: int = 4,
    probes: int = 3,
    by_kind: bool = False,
) -> None:
    """(p) the engine's late composition (its pacer, one per slack of `slacks_ms`, and with `by_kind` one by
    kind per slack too: engine/step_pacing.py) and none, side by side on one
    engine while `b.running` base requests decode: the decode steps per second with nothing arriving (what
    holding the composition back may cost), with how many of those steps the GPU ran dry before
    (`LLMEngine.dry_launches`), and the TTFT of requests that arrive at random moments from another thread (as
    a server's do).

    A decode step's time grows with its requests' KV length, so the modes take turns in short blocks, the same
    requests decoding throughout: `rounds` rounds of a block of steady steps per mode, then `rounds` rounds of
    `probes` arrivals per mode; each round starts from the next mode, so that each comes first as often."""
    if eng.pacer is None:
        report_loader("(p) skipped: the engine composes no step late (async steps off or compose_late off)")
        return
    modes: dict[str, ComposePacer | None] = {"off": None}
    modes.update({f"on, slack {ms:g} ms": ComposePacer(slack_s=ms / 1e3) for ms in slacks_ms})
    if by_kind:
        modes.update({f"by-kind, slack {ms:g} ms": ComposePacer(slack_s=ms / 1e3, by_kind=True) for ms in slacks_ms})
    original = eng.pacer
    block, warm = 6, 2  # steady steps timed per turn, and steps before them (the mode's pacer measures them)
    # Steps a request lives through: per turn, a warm-up before the steady block and another before the
    # arrivals, and at most `PROBE_STEPS` steps an arrival (checked as it runs).
    tokens = len(modes) * rounds * (block + 2 * warm + probes * PROBE_STEPS) + 16
    if len(prompt) + tokens > eng.max_model_len:
        raise SystemExit(f"(p) needs {len(prompt) + tokens} tokens a request; lower --pacing-rounds")
    done: list[str] = []
    for j in range(b.running):
        eng.add_request(
            f"pbg{j}",
            prompt,
            SamplingParams(max_tokens=tokens, ignore_eos=True),
            None,
            lambda o, j=j: done.append(f"pbg{j}") if o.finish_reason else None,  # type: ignore[misc]
        )
    for _ in range(4):  # their prefills
        eng._drain_commands()
        eng.step()
    seconds = dict.fromkeys(modes, 0.0)
    dry = dict.fromkeys(modes, 0)  # steady steps launched after the device had finished the one before
    held = dict.fromkeys(modes, 0)  # steady compositions the pacer held back
    turns = list(modes.items())

    def all_decoding() -> None:
        if done:
            raise AssertionError(f"(p) background requests ended before the section did: {done[:4]}")

    def in_turn(r: int) -> list[tuple[str, ComposePacer | None]]:
        """The modes in round `r`'s order (checked first: every background request still decodes)."""
        all_decoding()
        return turns[r % len(turns) :] + turns[: r % len(turns)]

    for r in range(rounds):
        for m, pacer in in_turn(r):
            eng.pacer = pacer
            for _ in range(warm):
                eng.step()
            start, dry_before = time.perf_counter(), eng.dry_launches
            waits_before = pacer.waits if pacer is not None else 0
            for _ in range(block):
                eng.step()
            seconds[m] += time.perf_counter() - start
            dry[m] += eng.dry_launches - dry_before
            held[m] += (pacer.waits if pacer is not None else 0) - waits_before
    ttfts: dict[str, list[float]] = {m: [] for m in modes}
    rng = random.Random(7)
    for r in range(rounds):
        for m, pacer in in_turn(r):
            eng.pacer = pacer
            for _ in range(warm):
                eng.step()
            for k in range(probes):
                arrived: list[float] = []
                first: list[float] = []

                def send(rid: str = f"pp{r}{m}{k}", arrived: list[float] = arrived, first: list[float] = first) -> None:
                    arrived.append(time.perf_counter())
                    send_timed(eng, rid, prompt, None, first)

                timer = threading.Timer(rng.uniform(0.0, 0.015), send)
                timer.start()
                for _ in range(PROBE_STEPS):
                    eng._drain_commands()
                    eng.step()
                    if first:
                        break
                timer.join()
                if not first:  # (a request that failed in the timer's thread also ends here)
                    raise AssertionError(f"(p) an arrival had no token after {PROBE_STEPS} steps ({m})")
                ttfts[m].append(first[0] - arrived[0])
    eng.pacer = original
    all_decoding()
    eng.run_until_idle()

    def p90(values: list[float]) -> float:
        return statistics.quantiles(values, n=10, method="inclusive")[8]

    steps = rounds * block
    off_ttft, off_rate = p50(ttfts["off"]), steps / seconds["off"]
    for m, pacer in modes.items():
        estimate = ""
        if pacer is not None and (estimates := pacer.estimates(prompts=False)) is not None:
            step, composition = estimates
            estimate = f"; its last estimates: step {step * 1e3:.2f} ms, composition {composition * 1e3:.2f} ms"
        rate = steps / seconds[m]
        report_loader(
            f"(p) compose late {m}, while {b.running} decode: decode steps/s with nothing arriving {rate:.1f} "
            f"({rate / off_rate:.3f}x off; {steps} steps in {rounds} turns, {dry[m]} launched after the device had "
            f"finished the one before, {held[m]} composed after a wait); TTFT of a request arriving at a random "
            f"moment p50 {p50(ttfts[m]) * 1e3:.2f} ms (p90 {p90(ttfts[m]) * 1e3:.2f}; {p50(ttfts[m]) / off_ttft:.3f}x "
            f"off; {len(ttfts[m])} arrivals){estimate}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="the random base model's dimensions")
    ap.add_argument("--running", type=int, default=16, help="section d's running requests (the goals: 64)")
    ap.add_argument(
        "--only",
        default="abdef",
        help="sections: a(gree) b d e f p(acing) s(erved: (d) under the engine's own loop); t: (d)'s cold-start "
        "TTFT alone; j: (d)'s warm joins alone",
    )
    ap.add_argument("--zipf-requests", type=int, default=1500)
    ap.add_argument("--zipf-rate", type=float, default=150.0)
    ap.add_argument("--swaps", type=int, default=9, help="(f)'s hot swaps (a traced one takes longer each)")
    ap.add_argument(
        "--load-ahead",
        default="on",
        help="(f): the pool's load_ahead, e.g. on,off: the swaps alternate between them, --swaps of each",
    )
    ap.add_argument(
        "--zipf-pinned-mb",
        type=int,
        default=8192,
        help="section e's pinned arena (MiB): room for all 500 adapters in host RAM at Llama-7B dims",
    )
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (no figures)")
    ap.add_argument(
        "--loaders",
        default="process,thread",
        help="adapter loaders to compare in sections d and f (process, thread, device; device-host: the device "
        "loader with no device image kept for first fills; device:MiB, device-host:MiB: its read chunks' size)",
    )
    ap.add_argument(
        "--switch-intervals",
        default="0",
        help="GIL switch intervals (ms; 0 = Python's 5 ms, the engine default) for d and f",
    )
    ap.add_argument(
        "--pinned-mb",
        default="1024",
        help="shared pinned arenas of the process and device loaders (MiB; 0 = none, 1024 the default) for d and f",
    )
    ap.add_argument(
        "--loader-workers",
        default="0",
        help="loader processes, each load split over all of them (0 = the engine's default; 1 = unsplit), or the "
        "device loader's reading threads, for d and f",
    )
    ap.add_argument(
        "--fold-prompt-tokens",
        default=str(EngineConfig().fold_prompt_tokens),
        help="fold_prompt_tokens of the engines sections d, j, t and f compare (short joins as decode rows; "
        "default: the engine's)",
    )
    ap.add_argument(
        "--lora-gemm-row-tile",
        default=str(kernels_gemm_lora.MAX_BLOCK_M),
        help="largest row tile of the one-adapter LoRA GEMM for the engines sections d, j, t and f compare "
        "(64: a step of 65-128 rows in two tiles, as before; default: the engine's)",
    )
    ap.add_argument(
        "--lora-gemm-loads",
        default=EngineConfig().lora_gemm,
        help="lora_gemm of the engines sections d, j, t and f compare (on: steps of 2-8 adapters run the "
        "few-adapter GEMM; single: one-adapter steps only; default: the engine's)",
    )
    ap.add_argument(
        "--compose-late",
        default="on",
        help="(f): the engine's late composition (its pacer: on, by-kind or off), e.g. on,by-kind,off: the swaps "
        "take them in turn, --swaps of each ((p) compares pacers of --pacer-slack-ms, by kind too where by-kind is "
        "listed, with none; (s) runs once per mode)",
    )
    ap.add_argument(
        "--pacer-slack-ms",
        default=str(ComposePacer().slack_s * 1e3),
        help="(p): the pacer's slack (ms) of each pacer compared with none, e.g. 0.5,1.5 (default: the engine's)",
    )
    ap.add_argument(
        "--pacing-rounds",
        type=int,
        default=4,
        help="(p): turns of each mode, steady and arriving (tokens within max_model_len)",
    )
    ap.add_argument("--trace", action="store_true", help="print the slowest steps' phases (diagnostics)")
    ap.add_argument(
        "--served-rounds",
        type=int,
        default=3,
        help="(s): rounds of its four phases, per pair of modes (0: its bursts only)",
    )
    ap.add_argument(
        "--fills-beside-steps",
        default="on",
        help="(s): slot fills wait for the slot's last step only (on) or all queued work (off), e.g. on,off",
    )
    ap.add_argument(
        "--layered-fills",
        default="on,off",
        help="(d): host-RAM cold starts with slot fills copied layered (on) or whole (off), e.g. on,off",
    )
    ap.add_argument("--cold-rounds", type=int, default=5, help="(d): cold starts of each kind (the p50's samples)")
    ap.add_argument(
        "--layered-fill-engines",
        default="on",
        help="layered_fills of the engines sections d, t, j, f and s run on (off: no gates in any step), e.g. on,off",
    )
    ap.add_argument(
        "--served-diagnostics",
        action="store_true",
        help="(s): each phase's step counters, slowest gaps, arrivals and first tokens",
    )
    ap.add_argument(
        "--async-steps",
        default="auto",
        help="async_steps of the engines section b compares, beside each attention backend",
    )
    ap.add_argument(
        "--fold-lora-shrinks",
        default="on,off",
        help="fold_lora_shrinks of the engines section b compares, beside each attention backend and async mode",
    )
    ap.add_argument(
        "--lora-gemm",
        default="on,off",
        help="lora_gemm of the engines section b compares, beside each of the axes above",
    )
    ap.add_argument(
        "--attention-backend",
        default="triton",
        help="decode attention of the engines section b compares (the first engine is the ratios' reference)",
    )
    args = ap.parse_args()
    for flag, count in (("--swaps", args.swaps), ("--cold-rounds", args.cold_rounds)):
        if count < 1:
            ap.error(f"{flag} must be at least 1, got {count}")
    for flag, value in (
        ("--load-ahead", args.load_ahead),
        ("--fills-beside-steps", args.fills_beside_steps),
        ("--layered-fills", args.layered_fills),
        ("--layered-fill-engines", args.layered_fill_engines),
    ):
        if not set(value.split(",")) <= {"on", "off"}:
            ap.error(f"{flag} takes on and off, comma-separated, got {value!r}")
    if not set(args.compose_late.split(",")) <= set(COMPOSE_LATE):
        ap.error(f"--compose-late takes {', '.join(COMPOSE_LATE)}, comma-separated, got {args.compose_late!r}")
    global TRACE, LOADER, SERVED_DIAGNOSTICS
    TRACE = args.trace
    SERVED_DIAGNOSTICS = args.served_diagnostics
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, {args.shape} x {args.layers} layers", flush=True)
    b = Bench(args)
    if "a" in args.only and args.device == "cuda":
        section_agreement(b)
    if "b" in args.only:
        attentions = args.attention_backend.split(",") if args.device == "cuda" else ["torch"]
        engines = {
            f"{attention} attention, async steps {steps}, folded shrinks {fold}, LoRA GEMM {gemm}": b.engine(
                attention_backend=attention, async_steps=steps, fold_lora_shrinks=fold, lora_gemm=gemm
            )
            for attention in attentions
            for steps in args.async_steps.split(",")
            for fold in args.fold_lora_shrinks.split(",")
            for gemm in args.lora_gemm.split(",")
        }
        prompt = next(iter(engines.values())).tokenizer.encode_chat([("user", PROMPT)])
        section_throughput(b, engines, prompt)
        for eng in engines.values():
            eng.stop()
        del engines, eng
        free_gpu_memory()
    prompt = Tokenizer(resolve_model(str(b.model))).encode_chat([("user", PROMPT)])
    # Cold starts, loads under traffic and hot swap, once per adapter loader, side by side in this run.
    configs = [
        (loader, float(ms), int(mb), int(workers), fold, int(row_tile), gemm, layered)
        for loader in args.loaders.split(",")
        for ms in args.switch_intervals.split(",")
        for mb in (args.pinned_mb.split(",") if loader != "thread" else ["0"])  # threads use no arena
        for workers in (args.loader_workers.split(",") if loader != "thread" else ["0"])
        for fold in args.fold_prompt_tokens.split(",")
        for row_tile in args.lora_gemm_row_tile.split(",")
        for gemm in args.lora_gemm_loads.split(",")
        for layered in args.layered_fill_engines.split(",")
    ]
    if not {"d", "f", "t", "j", "p", "s"}.intersection(args.only):
        configs = []
    default_chunk = adapter_device_loader.CHUNK_BYTES
    for loader_chunk, switch_ms, pinned_mb, workers, fold, row_tile, gemm, layered in configs:
        loader, _, chunk_mb = loader_chunk.partition(":")
        if chunk_mb and loader not in ("device", "device-host"):
            raise SystemExit(f"--loaders {loader_chunk}: only the device loader reads in chunks")
        # (read as the engine makes its device loader, with as many chunks as the ring's bytes hold)
        adapter_device_loader.CHUNK_BYTES = int(chunk_mb) << 20 if chunk_mb else default_chunk
        arena = f", shared arena {pinned_mb} MiB" if loader != "thread" else ""
        resolved = EngineConfig(adapter_loader_workers=workers)
        split = {
            "process": f", {resolved.loader_workers()} workers",
            "device": f", {resolved.reader_threads()} reading threads",
            "device-host": f", {resolved.reader_threads()} reading threads, no device images",
        }.get(loader, "")
        if loader in ("device", "device-host"):
            split += f", {adapter_device_loader.CHUNK_BYTES >> 20} MiB chunks"
        LOADER = (
            f"{loader} loader, GIL switch {switch_ms or 5:g} ms{arena}{split}, prompts folded up to {fold}, "
            f"LoRA GEMM row tile up to {row_tile}, lora_gemm {gemm}, layered fills {layered}"
        )
        kernels_gemm_lora.MAX_BLOCK_M = row_tile  # read as the engine captures its graphs
        eng = b.engine(
            fold_prompt_tokens=int(fold),
            adapter_loader="device" if loader == "device-host" else loader,
            gil_switch_interval_ms=switch_ms,
            pinned_adapter_memory_mb=pinned_mb,
            adapter_loader_workers=workers,
            lora_gemm=gemm,
            layered_fills=layered,
        )
        if loader == "device-host":  # the device loader, its first fills from the host image as any other's
            device_loader = eng.pool._loader
            assert isinstance(device_loader, DeviceLoader)
            device_loader.keep_device_image = False
        if {"d", "t"}.intersection(args.only):  # (an engine without gates fills whole whatever it is told)
            fill_modes = tuple(m == "on" for m in args.layered_fills.split(","))
            section_cold_start(b, eng, prompt, fill_modes, args.cold_rounds)
        if "d" in args.only:
            section_others_during_loads(b, eng, prompt)
        elif "j" in args.only:
            section_others_during_loads(b, eng, prompt, cold_joins=False)
        if "p" in args.only:
            slacks = [float(ms) for ms in args.pacer_slack_ms.split(",")]
            kinds = "by-kind" in args.compose_late.split(",")
            section_pacing(b, eng, prompt, slacks, args.pacing_rounds, by_kind=kinds)
        if "f" in args.only:
            section_hot_swap(
                b,
                eng,
                prompt,
                args.swaps,
                tuple(m == "on" for m in args.load_ahead.split(",")),
                tuple(args.compose_late.split(",")),
            )
        if "s" in args.only:  # (starts the engine's step loop: last)
            paced = tuple(args.compose_late.split(","))
            beside = tuple(m == "on" for m in args.fills_beside_steps.split(","))
            section_served_loads(b, eng, prompt, args.served_rounds, paced, beside)
        eng.stop()
        del eng
        free_gpu_memory()
    for settings, layered in STEADY:
        if layered == "on" and (settings, "off") in STEADY:
            ratio = STEADY[(settings, "on")] / STEADY[(settings, "off")]
            report(f"[{settings}] (d) steady decode step, engine with layered fills' gates / without: {ratio:.3f}x")
    adapter_device_loader.CHUNK_BYTES = default_chunk  # (e)'s engines read as the engine's default does
    if "e" in args.only:
        section_zipf(b, prompt, args.zipf_requests, args.zipf_rate, args.zipf_pinned_mb)
    print("\n== summary ==")
    print("\n".join(SUMMARY))


if __name__ == "__main__":
    main()
