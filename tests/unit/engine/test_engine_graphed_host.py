"""The whole engine step loop through its graphed path on the CPU: a tiny random model's `LLMEngine` given a
`StepForward` with decode and prefill graphs (captured through `replays`, which reruns a graph's forward from
its static buffers at each replay) and a prefill stream stood in for (`HostStream`), against the plain eager
engine, token for token and each row's logits within 1e-4, through one script of requests joining and ending,
aborts, stop strings, end tokens, hot swaps and fills ahead, sync and async steps.

What the CPU cannot show: the kernels (triton attention, shrink/expand, the LoRA GEMM: stood in for by their
torch definitions), real stream concurrency and the memory a captured graph bakes in (tests/gpu run those).
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.engine as engine_module
from engine import cuda_graphs, kernels, kernels_gemm_lora, kernels_gemm_lora_few
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.lora import LoRAStacks
from engine.lora_plan import SegmentPlan
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput, Sequence
from engine.step_forward import StepForward
from engine.step_pacing import ComposePacer
from engine.warm_up import warm_up
from tests.support.random_model import write_tiny_llama
from tests.unit.engine.conftest import HostStream
from tests.unit.engine.test_engine_prompt_logprobs import check_prompt_logprobs, first_with_prompt_logprobs
from tests.unit.engine.tiny import write_adapter

MAX_LEN = 300  # KV-length buckets 256 and 300; prefill buckets 16 to 256
MAX_SEQS = 6  # batch buckets 1, 2, 4, 6


@dataclass(frozen=True, slots=True)
class Request:
    rid: str
    length: int  # prompt tokens (a fixed pseudo-random prompt of this length)
    params: SamplingParams
    adapter: str | None = None
    shared: int = 0  # tokens of a start the prompt shares with others of the same `shared` (before `length`)


@dataclass(frozen=True, slots=True)
class Swap:
    """Register `name` anew from the adapter file `source` (a hot swap when `name` exists)."""

    name: str
    source: int


@dataclass(frozen=True, slots=True)
class Abort:
    rid: str


Event = Request | Swap | Abort


def greedy(max_tokens: int, *stop: str) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, stop=stop)


def seeded(max_tokens: int, seed: int, temperature: float = 1.3, top_p: float = 1.0, top_k: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


# Events before the step of their index. Requests join while others run; prompts span every prefill bucket,
# and past the largest (eager); the 250-token prompt decodes across the 256-key bucket and the 280-token one
# up to the context length; 'a' is swapped while requests for it wait (KV slots full) and others run on it;
# four adapters share three LoRA slots.
SCRIPT: dict[int, list[Event]] = {
    0: [
        Swap("a", 0),
        Swap("b", 1),
        Swap("c", 2),
        Swap("d", 3),
        Request("r0", 5, greedy(40)),
        Request("r1", 20, seeded(30, seed=1, top_p=0.9), "a"),
        Request("r2", 250, greedy(24), "b"),
        Request("r3", 16, greedy(30, "w7"), "a"),
    ],
    3: [
        Request("r4", 270, seeded(20, seed=4, top_k=20), "c"),
        Request("r5", 100, seeded(12, seed=5)),
        Request("r6", 33, greedy(50), "b"),
        Request("e0", 9, seeded(60, seed=7, temperature=4.0), "b"),  # ends with the end token
    ],
    5: [Request("r7", 8, greedy(20), "a"), Request("r8", 64, seeded(25, seed=8, temperature=2.0), "c")],
    6: [Swap("a", 3), Request("r9", 1, greedy(10, "w1"), "a")],
    8: [Abort("r6"), Abort("r0")],
    12: [
        Request("r10", 280, greedy(40)),
        Request("r11", 128, seeded(30, seed=11, temperature=2.0), "b"),
        Request("r12", 2, greedy(16), "a"),
        Request("r13", 17, seeded(40, seed=13, temperature=2.5), "d"),
    ],
    15: [Swap("d", 1)],
    20: [Abort("r2")],
    30: [Request(f"s{i}", 3 + 9 * i, seeded(14, seed=20 + i, temperature=1.5), "abcd"[i % 4]) for i in range(6)],
    33: [Abort("s2")],
    # Alone at the end: base rows only, then one adapter beside base rows, whose longest row reads exactly
    # the 256 keys of the smallest KV-length bucket, then one more.
    100: [Request("t0", 7, greedy(6)), Request("t1", 40, seeded(6, seed=30))],
    106: [Request("t3", 251, greedy(8), "b")],
    110: [Request("u0", 12, greedy(6), "c"), Request("u1", 3, seeded(8, seed=31), "c"), Request("t2", 5, greedy(4))],
    # Prompts sharing a 40-token start (prefix caching): the rest of each prompt after the first runs as rows
    # of the decode graph, read from p0's finished row or copied from a running one's; on 'a' nothing is shared
    # with the base rows.
    130: [Request("p0", 5, greedy(4), shared=40)],
    140: [
        Request("p1", 3, seeded(10, seed=40), shared=40),
        Request("p2", 7, greedy(6), "a", shared=40),
        Request("p3", 2, greedy(12), shared=40),
    ],
    145: [Request("p4", 9, greedy(5), shared=40), Request("p5", 4, greedy(5), "a", shared=40)],
}


Summary = tuple[list[int], str, str | None]


@dataclass
class Outputs:
    """What one request received."""

    outputs: list[RequestOutput] = field(default_factory=list)

    def __call__(self, out: RequestOutput) -> None:
        self.outputs.append(out)

    @property
    def summary(self) -> Summary:
        return [t for o in self.outputs for t in o.token_ids], "".join(o.text for o in self.outputs), self.end

    @property
    def end(self) -> str | None:
        return self.outputs[-1].finish_reason if self.outputs else None


def prompt(length: int, shared: int = 0) -> list[int]:
    """A fixed pseudo-random prompt of `length` tokens after `shared` tokens of a start others share."""
    gen = torch.Generator().manual_seed(length + 1000 * shared)
    start = torch.randint(2, 128, (shared,), generator=torch.Generator().manual_seed(-shared)).tolist()
    return start + torch.randint(2, 128, (length,), generator=gen).tolist()


@dataclass
class Run:
    """A script's run: each request's outputs, and the logits of each of its rows by (step, request)."""

    outputs: dict[str, Summary]
    logits: dict[tuple[int, str], torch.Tensor]
    swapped: list[tuple[str, str]]  # (waiting, running) requests on an adapter at its hot swap


def drive(engine: LLMEngine, files: list[Path], script: dict[int, list[Event]]) -> Run:
    """The engine's loop by hand, with the script's events before their steps."""
    sinks: dict[str, Outputs] = {}
    logits: dict[tuple[int, str], torch.Tensor] = {}
    swapped: list[tuple[str, str]] = []
    forward = engine.forward.logits

    def recorded(*args: Any, **kwargs: Any) -> tuple[list[Sequence], torch.Tensor]:
        order, rows = forward(*args, **kwargs)
        for seq, row in zip(order, rows, strict=True):
            logits[(step, seq.request_id)] = row.clone()
        return order, rows

    engine.forward.logits = recorded  # type: ignore[method-assign]
    for step in range(400):
        for event in script.get(step, []):
            if isinstance(event, Request):
                sinks[event.rid] = Outputs()
                tokens = prompt(event.length, event.shared)
                engine.add_request(event.rid, tokens, event.params, event.adapter, sinks[event.rid])
            elif isinstance(event, Swap):
                on = {s.adapter.name: s.request_id for s in engine.scheduler.running if s.adapter is not None}
                wanted = [s.request_id for s in engine.scheduler.waiting if s.adapter and s.adapter.name == event.name]
                swapped += [(rid, on[event.name]) for rid in wanted if event.name in on]
                engine.load_adapter(event.name, str(files[event.source]), wait=True)
            else:
                engine.abort(event.rid)
        engine._drain_commands()
        engine._reap()
        if engine.scheduler.has_work():
            engine.step()
        elif step > max(script):
            break
    assert all(sink.end is not None for sink in sinks.values()), "a request never ended"
    return Run({rid: sink.summary for rid, sink in sinks.items()}, logits, swapped)


def new_engine(
    model: Path,
    *,
    fused: bool,
    async_steps: str,
    lora_gemm: str,
    fills_ahead: int,
    fold_prompt_tokens: int = 0,
    graph_prompt_rows: int = EngineConfig().graph_prompt_rows,
) -> LLMEngine:
    config = EngineConfig(
        model=str(model),
        device="cpu",
        dtype="float32",
        max_num_seqs=MAX_SEQS,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=2 * MAX_LEN,
        max_waiting=32,
        lora_slots=3,
        max_lora_rank=8,
        host_adapter_cache=8,  # every adapter stays in host memory: no load runs between steps
        adapter_eviction="lru",
        adapter_loader="thread",
        adapter_fills_ahead=fills_ahead,
        async_steps=async_steps,
        lora_gemm=lora_gemm,
        fold_prompt_tokens=fold_prompt_tokens,
        graph_prompt_rows=graph_prompt_rows,
    )
    if not fused:
        return LLMEngine(config)
    # Captured graphs read fused stacks (`LoRABatch.static`), which the engine makes on CUDA only.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "LoRAStacks", functools.partial(LoRAStacks, fused=True))
        return LLMEngine(config)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matrices: a second intra-op thread only adds waits (the more so on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("graphed-model"))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("graphed-adapters")
    shapes = [(4, ("q_proj", "v_proj")), (8, ("o_proj", "down_proj")), (2, ("gate_proj", "up_proj", "k_proj"))]
    return [
        write_adapter(root / f"a{i}", rank=shapes[i % 3][0], modules=shapes[i % 3][1], alpha=64.0, seed=i)
        for i in range(4)
    ]


@pytest.fixture(scope="module")
def expected(model: Path, files: list[Path]) -> dict[str, Run]:
    """The script's outputs on the plain eager CPU engine, by `async_steps` (an abort ends a request before
    it receives the token in flight, so async steps give it one token fewer)."""
    runs: dict[str, Run] = {}
    for async_steps in ("off", "on"):
        engine = new_engine(model, fused=False, async_steps=async_steps, lora_gemm="off", fills_ahead=0)
        try:
            runs[async_steps] = drive(engine, files, SCRIPT)
        finally:
            engine.stop()
    return runs


@pytest.fixture
def checked_plans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """`kernels.lora_apply` checking, before it runs, that the plan a graph's kernels would read (the CPU path
    reads `token_slots` instead) groups exactly its rows by slot. The number of plans checked."""
    checked: list[int] = []
    apply = kernels.lora_apply

    def lora_apply(*args: torch.Tensor, plan: SegmentPlan | None = None, **kwargs: object) -> None:
        if plan is not None:
            slots, order = args[6].tolist(), plan.token_order.tolist()
            covered: list[int] = []
            for slot, start, length, first in plan.chunks[: int(plan.num_real[0])].tolist():
                rows = order[start : start + length]
                assert first == rows[0] and {slots[t] for t in rows} == {slot}, "a chunk of another slot's rows"
                covered += rows
            assert sorted(covered) == [t for t, s in enumerate(slots) if s >= 0], "the plan misses LoRA rows"
            checked.append(len(slots))
        apply(*args, plan=plan, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels, "lora_apply", lora_apply)
    return checked


@pytest.fixture
def gemm_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """`gemm_lora` stood in for by its torch definition, with the kernel's contract: every LoRA row of a tile
    takes the adapter of its largest slot (the caller promises one adapter per batch). The rows of each call."""
    rows: list[int] = []

    def gemm_lora(*args: torch.Tensor | None, slice_sizes: list[int], **_: object) -> torch.Tensor:
        x, w, bias, a, b, ranks, scalings, token_slots = args
        assert x is not None and token_slots is not None
        rows.append(x.shape[0])
        top = torch.full_like(token_slots, int(token_slots.max()))
        slots = torch.where(token_slots >= 0, top, token_slots)
        return kernels_gemm_lora.reference_gemm_lora(x, w, bias, a, b, ranks, scalings, slots, slice_sizes=slice_sizes)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels_gemm_lora, "gemm_lora", gemm_lora)
    return rows


@pytest.fixture
def few_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """`gemm_lora_few` stood in for by its torch definition (rows of unlisted adapters get no delta). The rows
    of each call."""
    rows: list[int] = []

    def gemm_lora_few(*args: torch.Tensor | None, slice_sizes: list[int], **_: object) -> torch.Tensor:
        x, w, bias, a, b, ranks, scalings, token_slots, listed = args[:9]
        assert x is not None and listed is not None
        rows.append(x.shape[0])
        return kernels_gemm_lora_few.reference_gemm_lora_few(
            x,
            w,
            bias,
            a,
            b,
            ranks,
            scalings,
            token_slots,
            listed,
            slice_sizes=slice_sizes,  # type: ignore[arg-type]
        )

    monkeypatch.setattr(kernels_gemm_lora_few, "gemm_lora_few", gemm_lora_few)
    return rows


def graph(engine: LLMEngine, prefill_stream: HostStream) -> None:
    """Give `engine` the graphed forward it gets on CUDA (`LLMEngine.__init__`)."""
    rows = cuda_graphs.decode_graph_rows(engine.kv.total, engine.config)
    decode = cuda_graphs.DecodeGraphs(engine.model, engine.kv, engine.stacks, rows, None)
    decode.capture_all()
    prefill = cuda_graphs.PrefillGraphs(engine.model, engine.kv, engine.stacks, None)
    prefill.capture_all()
    engine.forward = StepForward(
        engine.model,
        engine.kv,
        engine.stacks,
        engine.device,
        decode,
        prefill,
        prefill_stream,
        engine.config.fold_prompt_tokens,  # type: ignore[arg-type]
    )


def check_streams(log: list[object]) -> None:
    """Prefill graphs replay on the prefill stream, which first waits for the main one; decode graphs replay
    on the main stream, which waits for the prefill stream before the step's logits are read."""
    stream, joined, last_wait = "main", True, ""
    for entry in log:
        if entry == "on prefill":
            assert stream == "main" and last_wait == "prefill waits main", "prefills start before the stream waits"
            stream = "prefill"
        elif entry == "off prefill":
            stream = "main"
        elif isinstance(entry, tuple):  # a prefill graph's key
            assert stream == "prefill", f"prefill graph {entry} replayed on the main stream"
            joined = False
        elif isinstance(entry, cuda_graphs.GraphKey):
            assert stream == "main", f"decode graph {entry} replayed on the prefill stream"
        elif entry == "main waits prefill":
            joined = True
        if isinstance(entry, str) and "waits" in entry:
            last_wait = entry
        if entry == "prefill waits main":
            assert joined, "a step's prefills were never joined to the main stream"
    assert joined


# Engine options, and which graph families the forward gets (benchmarks drop either at any time).
VARIANTS: dict[str, tuple[dict[str, Any], tuple[bool, bool]]] = {
    "sync": (dict(async_steps="off", lora_gemm="off", fills_ahead=0), (True, True)),
    "async": (dict(async_steps="on", lora_gemm="off", fills_ahead=2), (True, True)),
    "sync-lora-gemm": (dict(async_steps="off", lora_gemm="on", fills_ahead=2), (True, True)),
    "sync-lora-gemm-single": (dict(async_steps="off", lora_gemm="single", fills_ahead=2), (True, True)),
    "async-lora-gemm": (dict(async_steps="on", lora_gemm="on", fills_ahead=0), (True, True)),
    "async-decode-graphs-only": (dict(async_steps="on", lora_gemm="on", fills_ahead=2), (True, False)),
    "sync-prefill-graphs-only": (dict(async_steps="off", lora_gemm="off", fills_ahead=2), (False, True)),
    # Decode graphs of MAX_SEQS rows: a prompt's rest longer than the rows left beside the decoding ones runs
    # eagerly.
    "sync-no-prompt-rows": (dict(async_steps="off", lora_gemm="off", fills_ahead=0, graph_prompt_rows=0), (True, True)),
    # Prompts of up to 16 tokens joining while others decode run as decode rows.
    "sync-fold-prompts": (dict(async_steps="off", lora_gemm="off", fills_ahead=0, fold_prompt_tokens=16), (True, True)),
    "async-fold-prompts-lora-gemm": (
        dict(async_steps="on", lora_gemm="on", fills_ahead=2, fold_prompt_tokens=16),
        (True, True),
    ),
}

# The decode graphs' batch buckets the script replays: rests of prompts after their cached start (up to 16
# tokens here) run in the graphs' prompt rows (`graph_prompt_rows`), and folded prompts beside decoding rows
# reach the 24-row bucket.
BUCKETS_USED = {variant: {1, 2, 4, 8, 16} for variant in VARIANTS} | {
    "sync-no-prompt-rows": {1, 2, 4, 6},
    "sync-fold-prompts": {1, 2, 4, 8, 16, 24},
    "async-fold-prompts-lora-gemm": {1, 2, 4, 8, 16, 24},
}


def test_the_script_exercises_every_ending(expected: dict[str, Run]) -> None:
    ran = expected["off"].outputs
    assert expected["off"].swapped, "no hot swap while requests for the adapter waited and others ran on it"
    assert ran["r0"][0][:-1] == expected["on"].outputs["r0"][0]  # aborted: without the token in flight
    ends = collections.Counter(end for _, _, end in ran.values())
    assert set(ends) == {"length", "stop", "abort"}, ends
    stop_strings = {e.rid for events in SCRIPT.values() for e in events if isinstance(e, Request) and e.params.stop}
    by_string = [rid for rid in stop_strings if ran[rid][2] == "stop"]
    by_end_token = [rid for rid, (_, _, end) in ran.items() if end == "stop" and rid not in stop_strings]
    assert by_string and by_end_token, (by_string, by_end_token)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_graphed_steps_give_the_eager_engines_tokens(
    variant: str,
    model: Path,
    files: list[Path],
    expected: dict[str, Run],
    replays: list[object],
    prefill_stream: HostStream,
    gemm_rows: list[int],
    few_rows: list[int],
    checked_plans: list[int],
) -> None:
    options, (decode_graphs, prefill_graphs) = VARIANTS[variant]
    engine = new_engine(model, fused=True, **options)
    try:
        graph(engine, prefill_stream)
        decode, prefill = engine.graphs, engine.prefill_graphs
        engine.graphs = decode if decode_graphs else None
        engine.prefill_graphs = prefill if prefill_graphs else None
        del replays[:]  # the captures' warm-ups
        got = drive(engine, files, SCRIPT)
    finally:
        engine.stop()
    want = expected[options["async_steps"]]
    for rid, summary in want.outputs.items():
        assert got.outputs[rid] == summary, f"{variant}: {rid}"
    assert got.logits.keys() == want.logits.keys()
    for key, row in want.logits.items():
        where = f"{variant} {key}: "
        torch.testing.assert_close(got.logits[key], row, rtol=1e-4, atol=1e-4, msg=where.__add__)
    check_streams(replays)
    assert decode is not None and prefill is not None
    keys = collections.Counter(key for key in replays if isinstance(key, cuda_graphs.GraphKey))
    assert decode.replays == sum(keys.values())
    if decode_graphs:
        assert {k.batch for k in keys} == BUCKETS_USED[variant] and {k.kv_len for k in keys} == {256, MAX_LEN}
        # Steps of 2 or 3 adapters (of 3 slots) take the few-adapter GEMM graphs where lora_gemm is on.
        gemm, few = options["lora_gemm"] != "off", options["lora_gemm"] == "on"
        kinds = {(False, False, False), (True, False, few), *([(True, True, False)] if gemm else [])}
        assert {(k.lora, k.single, k.few) for k in keys} == kinds
        assert bool(gemm_rows) == gemm and bool(few_rows) == few and checked_plans
    prompts = collections.Counter(key for key in replays if isinstance(key, tuple))
    assert prefill.replays == sum(prompts.values())
    if prefill_graphs:
        assert {n for n, _ in prompts} == {16, 32, 64, 128, 256} and {lora for _, lora in prompts} == {True, False}
    assert bool(keys) == decode_graphs and bool(prompts) == prefill_graphs
    assert engine.prefix_cache.hit_tokens >= 4 * 40, "the shared starts were not read from the prefix cache"
    assert (engine.forward.folded_rows > 0) == decode_graphs  # the rests of those prompts, in decode graphs
    assert (engine.forward.folded_prompts > 0) == bool(options.get("fold_prompt_tokens"))  # short joins too
    # Short prompts that started together with no room beside decoding rows: decode graphs of their own.
    assert (engine.forward.grouped_prompts > 0) == bool(options.get("fold_prompt_tokens"))


def test_the_warm_up_replays_prefill_graphs_and_leaves_the_counters_as_they_were(
    model: Path, replays: list[object], prefill_stream: HostStream
) -> None:
    """The warm-up's two starting prompts replay prefill graphs, as a lone request's does, though prompt groups
    would take them; and the forward's counters read as before it."""
    engine = new_engine(model, fused=True, async_steps="on", lora_gemm="off", fills_ahead=0, fold_prompt_tokens=16)
    try:
        graph(engine, prefill_stream)
        forward = engine.forward
        assert engine.prefill_graphs is not None
        before = (forward.grouped_prompts, forward.eager_runs, forward.folded_prompts, engine.prefill_graphs.replays)
        warm_up(engine)
        assert (forward.grouped_prompts, forward.eager_runs, forward.folded_prompts) == before[:3]
        assert engine.prefill_graphs.replays - before[3] == 2 and forward.group_prompts
    finally:
        engine.stop()


@pytest.mark.parametrize("async_steps", ["off", "on"])
def test_prompts_asking_for_prompt_logprobs_run_eagerly_beside_prefill_graphs(
    async_steps: str, model: Path, request: pytest.FixtureRequest
) -> None:
    """A prefill graph yields its prompt's last position's logits only: a prompt that asks for every position's
    runs eagerly (and gets the whole prompt's values), the others beside it still as graphs, token for token
    the eager engine's."""
    requests = {
        "plain": (prompt(20), SamplingParams(max_tokens=6)),
        "asking": (prompt(24), SamplingParams(max_tokens=6, prompt_logprobs=4)),
        "scored": (prompt(30), SamplingParams(max_tokens=0, prompt_logprobs=1)),
    }
    engines = [
        new_engine(model, fused=graphed, async_steps=async_steps, lora_gemm="off", fills_ahead=0)
        for graphed in (False, True)
    ]
    # Only now (the engines made, their tokenizers loaded): the stand-ins for CUDA's streams and graph capture.
    replays: list[object] = request.getfixturevalue("replays")
    graph(engines[1], request.getfixturevalue("prefill_stream"))
    del replays[:]
    outputs: list[dict[str, Outputs]] = []
    try:
        for engine in engines:
            sinks = {rid: Outputs() for rid in requests}
            for rid, (ids, params) in requests.items():
                engine.add_request(rid, ids, params, None, sinks[rid])
            engine.run_until_idle()
            for rid, top in (("asking", 4), ("scored", 1)):
                check_prompt_logprobs(engine, requests[rid][0], first_with_prompt_logprobs(sinks[rid].outputs), top)
            outputs.append(sinks)
    finally:
        for engine in engines:
            engine.stop()
    assert [key for key in replays if isinstance(key, tuple)] == [(32, False)]  # "plain"'s prefill graph only
    eager, graphed = ({rid: o.summary for rid, o in sinks.items()} for sinks in outputs)
    assert graphed == eager and graphed["scored"] == ([], "", "length")


def test_a_burst_run_in_one_eager_pass_is_composed_up_to_that_pass(
    model: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short prompts arriving together beyond a graph's rows run as one eager pass (`StepForward._group_pass`):
    on a GPU, milliseconds of launches on the engine thread. Timed as the step's composition, they moved every
    deadline of the pacer's window to its step's start (stop 43: a hot swap's first request then waited a step
    more); the step is composed up to the pass."""
    engine = new_engine(
        model, fused=True, async_steps="on", lora_gemm="off", fills_ahead=0, fold_prompt_tokens=5, graph_prompt_rows=0
    )
    try:
        request.getfixturevalue("replays")  # (the engine made, its tokenizer loaded: the stand-ins for CUDA's)
        graph(engine, request.getfixturevalue("prefill_stream"))  # graphs of up to 6 + 5 rows: 16 rows in one pass
        pacer = ComposePacer(window=64)
        engine.pacer = pacer
        forward = engine.forward
        group_pass = forward._group_pass

        def slow_launches(*args: Any) -> torch.Tensor:
            time.sleep(0.2)  # (far above a tiny CPU step's composition, even on a loaded machine)
            return group_pass(*args)

        monkeypatch.setattr(forward, "_group_pass", slow_launches)
        for i, length in enumerate((3, 4, 5, 4)):
            engine.add_request(f"b{i}", prompt(length), greedy(3), None, lambda out: None)
        steps = engine.steps
        engine.run_until_idle()
        assert forward.group_passes == 1 and engine.steps - steps == 3 and len(pacer.compose_times) == 3
        assert max(pacer.compose_times) < 0.15
    finally:
        engine.stop()
