"""The whole engine on a CUDA GPU: captured decode graphs give the eager path's tokens (skipped without CUDA).

No weights can be downloaded on the GPU machine: the model is a small random Llama saved as a Hugging Face
folder, with the converted SmolLM2 tokenizer taken from $ADAPTERGATE_TOKENIZER or `.gpu/tokenizer`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.loader import load_weights, resolve_model
from engine.logits_processing import process_logits, reference_process
from engine.logprobs import StepLogprobs
from engine.lora import AdapterWeights
from engine.sampling import SamplingParams, make_generator, sample_tokens
from engine.sequence import RequestOutput
from engine.step_forward import InFlight
from engine.step_pacing import ComposePacer
from tests.support.random_model import write_random_llama
from tests.unit.engine.test_engine_logprobs import check_logprobs, run_recorded
from tests.unit.engine.test_engine_prompt_logprobs import check_prompt_logprobs, first_with_prompt_logprobs
from tests.unit.engine.test_logits_processing import EOS, ROWS, InFlightTokens, make_logits, make_seq
from tests.unit.engine.tiny import write_adapter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {"r4-mlp": (4, ("gate_proj", "up_proj", "down_proj")), "r8-qv": (8, ("q_proj", "v_proj")), "r16": (16, ALL7)}


def _tokenizer_dir() -> Path:
    found = Path(os.environ.get("ADAPTERGATE_TOKENIZER", Path(__file__).resolve().parents[2] / ".gpu" / "tokenizer"))
    if not (found / "tokenizer.json").is_file():
        pytest.skip("no tokenizer folder: set ADAPTERGATE_TOKENIZER or copy one to .gpu/tokenizer")
    return found


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("model") / "m", _tokenizer_dir(), layers=4)


@pytest.fixture(scope="module")
def adapter_dirs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    arch, _ = load_weights(resolve_model(str(model_dir)))  # the shapes only; no engine needed
    dirs = {
        name: write_adapter(root / name, arch=arch, rank=r, alpha=2 * r, modules=mods, seed=i)
        for i, (name, (r, mods)) in enumerate(ADAPTERS.items())
    }
    dirs["r16-v2"] = write_adapter(root / "v2", arch=arch, rank=16, alpha=32, modules=ALL7, seed=99)
    return dirs


def _engine(
    model_dir: Path,
    *,
    eager: bool,
    dtype: str = "float32",
    lora_gemm: str = "on",
    prefix_caching: str = "off",
    fold_prompt_tokens: int | None = None,
    adapter_loader: str = "auto",
) -> LLMEngine:
    # Prefix caching off unless asked: these tests share prompts, and a cached start runs the rest of a prompt
    # in the decode graph (or eagerly) instead of in the prefill graph they test.
    config = EngineConfig(
        model=str(model_dir),
        device="cuda",
        dtype=dtype,
        max_num_seqs=8,
        max_model_len=320,
        max_num_batched_tokens=2048,
        lora_slots=4,
        max_lora_rank=16,
        enforce_eager=eager,
        lora_gemm=lora_gemm,
        prefix_caching=prefix_caching,
        adapter_loader=adapter_loader,
        layered_fills="on",
    )
    if fold_prompt_tokens is not None:  # else the engine's default
        config = dataclasses.replace(config, fold_prompt_tokens=fold_prompt_tokens)
    return LLMEngine(config)


def _generate(engine: LLMEngine, requests: list[tuple[list[int], str | None]], tokens: int) -> list[list[int]]:
    out: dict[int, list[int]] = {i: [] for i in range(len(requests))}

    def sink(i: int) -> object:
        return lambda o: out[i].extend(o.token_ids) if isinstance(o, RequestOutput) else None

    for i, (prompt, adapter) in enumerate(requests):
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        engine.add_request(f"r{i}-{engine.steps}", prompt, params, adapter, sink(i))  # type: ignore[arg-type]
    engine.run_until_idle()
    return [out[i] for i in range(len(requests))]


@pytest.fixture(scope="module")
def engines(model_dir: Path, adapter_dirs: dict[str, Path]) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    torch.backends.cuda.matmul.allow_tf32 = False
    pair = (_engine(model_dir, eager=True), _engine(model_dir, eager=False))
    for e in pair:
        for name in ADAPTERS:
            e.load_adapter(name, str(adapter_dirs[name]), wait=True)
    yield pair
    for e in pair:
        e.stop()


def _prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    # Different lengths, so sequences sit at different positions and KV-length buckets.
    return [engine.tokenizer.encode("tell me " * (3 + 7 * i) + "about the sea") for i in range(n)]


def test_graphs_are_captured_for_every_bucket(engines: tuple[LLMEngine, LLMEngine]) -> None:
    _, graphed = engines
    assert graphed.graphs is not None
    # 8 KV rows plus the rows for prompt tokens run as decode rows: max(graph_prompt_rows 32, fold_prompt_tokens
    # 64 by default), so 72.
    assert graphed.graphs.batches == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72]
    assert graphed.graphs.kv_lens == [256, 320]


def test_graph_decode_matches_eager_on_a_mixed_padded_batch(engines: tuple[LLMEngine, LLMEngine]) -> None:
    eager, graphed = engines
    assert graphed.graphs is not None
    names: list[str | None] = [None, "r4-mlp", "r8-qv", "r16", None, "r16"]  # 6 rows: padded to 8
    requests = list(zip(_prompts(eager, 6), names, strict=True))
    assert graphed.prefill_graphs is not None
    before, prefills_before = graphed.graphs.replays, graphed.prefill_graphs.replays
    grouped = graphed.forward.grouped_prompts
    want = _generate(eager, requests, tokens=24)
    got = _generate(graphed, requests, tokens=24)
    assert got == want
    assert graphed.graphs.replays - before >= 20  # decode steps really ran as graphs
    # and every prompt's prefill: 9, 23, 37 and 51 tokens together (120 rows, more than a graph's 72: one
    # eager pass), 65 and 79 as prefill graphs
    assert graphed.forward.grouped_prompts - grouped == 4 and graphed.forward.group_passes >= 1
    assert graphed.prefill_graphs.replays - prefills_before == 2


def test_graph_decode_crosses_a_kv_bucket_and_a_batch_shrinking(engines: tuple[LLMEngine, LLMEngine]) -> None:
    eager, graphed = engines
    prompt = eager.tokenizer.encode("word " * 230)  # decodes from position ~232 across 256 into the 320 bucket
    requests = [(prompt, "r16"), (_prompts(eager, 1)[0], None), (prompt, None)]
    want = _generate(eager, requests, tokens=40)
    got = _generate(graphed, requests, tokens=40)
    assert got == want


def test_hot_swap_under_graphs_serves_new_weights(
    engines: tuple[LLMEngine, LLMEngine], adapter_dirs: dict[str, Path]
) -> None:
    eager, graphed = engines
    for e in (eager, graphed):
        e.load_adapter("swap", str(adapter_dirs["r16"]), wait=True)
    requests: list[tuple[list[int], str | None]] = [(p, "swap") for p in _prompts(eager, 3)]
    before = _generate(graphed, requests, tokens=12)
    for e in (eager, graphed):
        e.load_adapter("swap", str(adapter_dirs["r16-v2"]), wait=True)
    want = _generate(eager, requests, tokens=12)
    got = _generate(graphed, requests, tokens=12)
    assert got == want and got != before


def test_adapters_read_by_the_device_loader_serve_as_the_loader_processes_do(
    model_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    """The device loader (threads read the file, the GPU converts and places it) against the loader processes
    (`adapter_loader="process"`), eager engines: the same tokens from every adapter, before and after a hot
    swap."""
    processes = _engine(model_dir, eager=True, adapter_loader="process")
    device = _engine(model_dir, eager=True, adapter_loader="device")
    try:
        pair = (processes, device)
        for e in pair:
            for name in ADAPTERS:
                e.load_adapter(name, str(adapter_dirs[name]), wait=True)
        requests: list[tuple[list[int], str | None]] = list(zip(_prompts(device, len(ADAPTERS)), ADAPTERS, strict=True))
        assert _generate(device, requests, tokens=8) == _generate(processes, requests, tokens=8)
        for e in pair:
            e.load_adapter("swapped", str(adapter_dirs["r16"]), wait=True)
            e.load_adapter("swapped", str(adapter_dirs["r16-v2"]), wait=True)
        swapped: list[tuple[list[int], str | None]] = [(p, "swapped") for p in _prompts(device, 2)]
        assert _generate(device, swapped, tokens=8) == _generate(processes, swapped, tokens=8)
    finally:
        for e in pair:
            e.stop()


def test_bf16_graphs_run_and_agree_mostly(model_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    eager, graphed = _engine(model_dir, eager=True, dtype="bfloat16"), _engine(model_dir, eager=False, dtype="bfloat16")
    try:
        for e in (eager, graphed):
            e.load_adapter("r16", str(adapter_dirs["r16"]), wait=True)
        requests: list[tuple[list[int], str | None]] = [
            (p, "r16" if i % 2 else None) for i, p in enumerate(_prompts(eager, 4))
        ]
        want, got = _generate(eager, requests, tokens=8), _generate(graphed, requests, tokens=8)
        # bf16 attention over a padded key range may round differently from the eager one: most rows agree
        # on their first decoded tokens (the first token comes from the same eager prefill).
        assert sum(w[:3] == g[:3] for w, g in zip(want, got, strict=True)) >= 3
        assert graphed.graphs is not None and graphed.graphs.replays > 0
    finally:
        eager.stop()
        graphed.stop()


def test_cuda_graphs_and_fused_lora_match_the_cpu_engine(
    model_dir: Path, engines: tuple[LLMEngine, LLMEngine], adapter_dirs: dict[str, Path]
) -> None:
    """CUDA (fused projection groups, triton kernels, graphs) against the CPU's per-projection torch path."""
    _, graphed = engines
    cpu = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            max_num_seqs=8,
            max_model_len=320,
            max_num_batched_tokens=2048,
            lora_slots=4,
            max_lora_rank=16,
        )
    )
    try:
        for name in ADAPTERS:
            cpu.load_adapter(name, str(adapter_dirs[name]), wait=True)
        names: list[str | None] = [None, "r4-mlp", "r8-qv", "r16", "r8-qv"]
        requests = list(zip(_prompts(cpu, 5), names, strict=True))
        assert _generate(graphed, requests, tokens=16) == _generate(cpu, requests, tokens=16)
    finally:
        cpu.stop()


def _join(engine: LLMEngine, prompts: list[list[int]], names: list[str | None]) -> list[list[int]]:
    """Start three requests, decode a few steps, then add three more while those decode."""
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}

    def sink(i: int) -> object:
        return lambda o: out[i].extend(o.token_ids)

    tag = f"join{engine.steps}"
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        if i == 3:  # the first three are decoding by now
            for _ in range(5):
                engine._drain_commands()
                engine.step()
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", prompt, params, name, sink(i))  # type: ignore[arg-type]
    engine.run_until_idle()
    return [out[i] for i in range(len(prompts))]


def test_prompts_joining_running_decodes_match_eager(engines: tuple[LLMEngine, LLMEngine]) -> None:
    """New prompts prefill on a second stream while the running batch decodes in its graph.

    Several rounds: a race between the two streams (they once shared cuBLAS's workspace) showed up in
    some rounds only."""
    eager, graphed = engines
    prompts = _prompts(eager, 6)
    names: list[str | None] = [None, "r16", "r8-qv", "r16", None, "r4-mlp"]
    for _ in range(3):
        assert _join(graphed, prompts, names) == _join(eager, prompts, names)


def test_slots_refilled_beside_steps_in_flight_serve_each_adapters_weights(
    engines: tuple[LLMEngine, LLMEngine], model_dir: Path, tmp_path: Path
) -> None:
    """More adapters than slots, joining while others decode under async steps: a fill or reset waits only for
    the last step that read its slot (`LoRAStacks.mark_read`), so its copies run beside the step in flight.
    Every request still gets the eager engine's tokens (sync steps: nothing in flight as it fills)."""
    eager, graphed = engines
    arch, _ = load_weights(resolve_model(str(model_dir)))
    names = [f"s{i}" for i in range(8)]
    for i, name in enumerate(names):
        path = write_adapter(tmp_path / name, arch=arch, rank=8, alpha=16, modules=ALL7, seed=200 + i)
        for engine in engines:
            engine.load_adapter(name, str(path), wait=True)
    prompts = _prompts(eager, 6)
    was_async, graphed.async_steps = graphed.async_steps, True
    try:
        evictions = graphed.pool.evictions
        for wave in range(3):  # 6 adapters a wave on 4 slots: the joiners' fills evict idle ones
            chosen: list[str | None] = [names[(3 * wave + j) % len(names)] for j in range(6)]
            assert _join(graphed, prompts, chosen) == _join(eager, prompts, chosen), f"wave {wave}"
        assert graphed.pool.evictions - evictions >= 6
    finally:
        graphed.async_steps = was_async
        for engine in engines:
            for name in names:
                engine.unload_adapter(name)


def test_steps_wait_inside_their_graphs_for_each_chunk_of_a_layered_fill(
    engines: tuple[LLMEngine, LLMEngine], model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adapters in host RAM, asked for by requests: their fills are copied layered (`LoRAStacks.layered_fills`)
    and the step starts at once, its graphs waiting for each chunk's gate. Every fill the engine layers is held
    back behind 20 ms of sleep on the copy stream: a graph that did not wait for the gates would read the slot
    before its weights. A lone request on an idle engine runs a prefill graph; one joining three decoding
    requests runs as rows of their decode graph. Every request still gets the eager engine's tokens."""
    eager, graphed = engines
    stacks, copy_stream = graphed.stacks, graphed.stacks.copy_stream
    assert copy_stream is not None and len(stacks.layer_gates) > 1, "4 layers: chunks [0, 1) and [1, 4)"
    arch, _ = load_weights(resolve_model(str(model_dir)))
    names = [f"lf{i}" for i in range(4)]  # each request takes a slot from an idle adapter
    for i, name in enumerate(names):
        path = write_adapter(tmp_path / name, arch=arch, rank=16, alpha=32, modules=ALL7, seed=300 + i)
        for engine in engines:
            engine.load_adapter(name, str(path), wait=True)
    set_lora, can_layer = stacks.set_lora, stacks._can_layer
    held_back: list[int] = []

    def slow_set_lora(slot: int, adapter: AdapterWeights) -> None:
        layered = can_layer(slot, adapter)  # decided once: the stream or last reader may finish meanwhile
        if layered:
            with torch.cuda.stream(copy_stream):
                torch.cuda._sleep(40_000_000)  # about 20 ms at an H100's clock
            held_back.append(slot)
        monkeypatch.setattr(stacks, "_can_layer", lambda slot, adapter: layered)
        set_lora(slot, adapter)
        monkeypatch.setattr(stacks, "_can_layer", can_layer)

    monkeypatch.setattr(stacks, "set_lora", slow_set_lora)
    prompts = _prompts(eager, 6)
    assert graphed.graphs is not None and graphed.prefill_graphs is not None
    layered, prefills = stacks.layered, graphed.prefill_graphs.replays
    try:
        for name in names[:3]:  # alone on an idle engine: a prefill graph
            want = _generate(eager, [(prompts[0], name)], 8)
            torch.cuda.synchronize()
            assert _generate(graphed, [(prompts[0], name)], 8) == want, name
        assert graphed.prefill_graphs.replays - prefills >= 3
        assert len(held_back) == 3 and stacks.layered - layered == 3
        # Three base requests decode; then one on lf3 (about 51 tokens, within the 64 folded) joins their decode
        # graph, the step's only fill.
        folded = graphed.forward.folded_prompts
        chosen: list[str | None] = [None, None, None, names[3], None, None]
        torch.cuda.synchronize()
        assert _join(graphed, prompts, chosen) == _join(eager, prompts, chosen)
        assert graphed.forward.folded_prompts > folded
        assert len(held_back) == 4 and stacks.layered - layered == 4
    finally:
        monkeypatch.undo()
        for engine in engines:
            for name in names:
                engine.unload_adapter(name)


def test_short_prompts_joining_as_decode_rows_match_eager(
    engines: tuple[LLMEngine, LLMEngine], model_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    """`fold_prompt_tokens`: prompts joining running decodes run as rows of the decode graph (the 51- and
    65-token ones; the 79-token one no longer fits beside them and replays its prefill graph), sync and async,
    with the eager engine's tokens. The three that start together (9, 23 and 37 tokens) run as the rows of one
    decode graph of their own."""
    eager, _ = engines
    folding = _engine(model_dir, eager=False, fold_prompt_tokens=160)
    try:
        for name in ADAPTERS:
            folding.load_adapter(name, str(adapter_dirs[name]), wait=True)
        prompts = _prompts(eager, 6)
        names: list[str | None] = [None, "r16", "r8-qv", "r16", None, "r4-mlp"]
        want = _join(eager, prompts, names)
        for steps in (False, True):
            folding.async_steps = steps
            forward = folding.forward
            folded, grouped = forward.folded_prompts, forward.grouped_prompts
            replays = folding.prefill_graphs.replays  # type: ignore[union-attr]
            assert _join(folding, prompts, names) == want
            assert (forward.folded_prompts - folded, forward.grouped_prompts - grouped) == (2, 3)
            assert folding.prefill_graphs.replays - replays == 1  # type: ignore[union-attr]  # the 79-token one
    finally:
        folding.stop()


@pytest.mark.parametrize("one_pass", [True, False])
def test_prompts_arriving_together_run_grouped_and_match_eager(
    engines: tuple[LLMEngine, LLMEngine], one_pass: bool
) -> None:
    """Eight short prompts started together, on adapters and none, fill two decode graphs' rows: one eager pass
    over all of their rows, or a decode graph replay per group (one model read for several prompts either way),
    instead of eight prefill graphs, with the eager engine's tokens."""
    eager, graphed = engines
    prompts = [p[:16] for p in _prompts(eager, 8)]  # 9 and 16 tokens: two groups (57 and 64 of 72 rows)
    names: list[str | None] = [None, "r16", "r8-qv", "r16", None, "r4-mlp", "r16", None]
    requests = list(zip(prompts, names, strict=True))
    forward = graphed.forward
    grouped, passes, replays = forward.grouped_prompts, forward.group_passes, graphed.prefill_graphs.replays  # type: ignore[union-attr]
    forward.one_pass_for_groups = one_pass
    try:
        assert _generate(graphed, requests, 12) == _generate(eager, requests, 12)
    finally:
        forward.one_pass_for_groups = True
    assert forward.grouped_prompts - grouped == 8 and forward.group_passes - passes == int(one_pass)
    assert graphed.prefill_graphs.replays == replays  # type: ignore[union-attr]


def test_prompts_prefilled_in_chunks_beside_graphed_decodes_match_whole_eager_prefills(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    """A prefill budget below the prompts' lengths: chunks run eagerly (attention over the chunks before them,
    LoRA on their rows) while the running requests decode in their graph; the tokens of whole prefills."""
    eager, graphed = engines
    prompts = _prompts(eager, 6)
    names: list[str | None] = [None, "r16", "r8-qv", "r16", None, "r4-mlp"]
    assert max(len(p) for p in prompts) > 3 * 24
    budget = graphed.scheduler.max_num_batched_tokens
    graphed.scheduler.max_num_batched_tokens = 24
    try:
        assert _join(graphed, prompts, names) == _join(eager, prompts, names)
    finally:
        graphed.scheduler.max_num_batched_tokens = budget


def test_prompts_started_from_the_prefix_cache_match_full_prefills(
    engines: tuple[LLMEngine, LLMEngine], model_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    """Prefix caching on CUDA, with graphs and async steps: prompts sharing a start read it from a finished
    request's row or copy it from a running one's, and get the tokens of the uncached eager engine."""
    eager, _ = engines
    cached = _engine(model_dir, eager=False, prefix_caching="on")
    try:
        cached.load_adapter("r16", str(adapter_dirs["r16"]), wait=True)
        system = eager.tokenizer.encode("harbour rules: " + "berth seven opens at six. " * 20)
        prompts = [system + eager.tokenizer.encode(f" question {i} about the tide") for i in range(4)]
        for steps in (False, True):
            cached.async_steps = steps
            for adapter in (None, "r16"):
                first = [(prompts[0], adapter)]
                assert _generate(cached, first, tokens=16) == _generate(eager, first, tokens=16)
                hits = cached.prefix_cache.hit_tokens
                rest = [(p, adapter) for p in prompts[1:]]  # from the finished row, then copies of it
                assert _generate(cached, rest, tokens=16) == _generate(eager, rest, tokens=16)
                assert cached.prefix_cache.hit_tokens - hits >= 3 * (len(system) - 16)
    finally:
        cached.stop()


def test_graphs_that_replay_concurrently_were_captured_on_their_own_streams(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    """cuBLAS's workspace is per stream and baked into a graph: decode and prefill graphs must not share it."""
    _, graphed = engines
    assert graphed.graphs is not None and graphed.prefill_graphs is not None
    streams = {graphed.graphs.capture_stream, graphed.prefill_graphs.capture_stream}
    assert len(streams) == 2
    assert torch.cuda.graphs.graph.default_capture_stream not in streams


def test_async_steps_match_eager(engines: tuple[LLMEngine, LLMEngine]) -> None:
    """Steps launched before the previous step's tokens are read (`async_steps`), with decode graphs and
    prefills on their second stream: the eager engine's tokens, on a mixed batch, across a KV bucket and with
    prompts joining running decodes."""
    eager, graphed = engines
    graphed.async_steps = True
    try:
        names: list[str | None] = [None, "r4-mlp", "r8-qv", "r16", None, "r16"]
        requests = list(zip(_prompts(eager, 6), names, strict=True))
        assert _generate(graphed, requests, tokens=24) == _generate(eager, requests, tokens=24)
        long_prompt = eager.tokenizer.encode("word " * 230)
        requests = [(long_prompt, "r16"), (_prompts(eager, 1)[0], None), (long_prompt, None)]
        assert _generate(graphed, requests, tokens=40) == _generate(eager, requests, tokens=40)
        prompts = _prompts(eager, 6)
        assert _join(graphed, prompts, names) == _join(eager, prompts, names)
    finally:
        graphed.async_steps = False


def test_the_pacer_gets_each_steps_device_time(engines: tuple[LLMEngine, LLMEngine]) -> None:
    """Late composition on a GPU (`compose_late` auto, async steps): the tokens of the eager engine, and device
    times for the pacer's estimates, each shorter than the whole run and than the steps' share of it."""
    eager, graphed = engines
    assert graphed.pacer is not None  # async steps by default where decode steps replay graphs
    pacer = ComposePacer()  # its own, so earlier tests' steps are not among its estimates
    was = graphed.async_steps, graphed.pacer
    graphed.async_steps, graphed.pacer = True, pacer
    try:
        requests = list(zip(_prompts(eager, 4), [None, "r16", None, "r8-qv"], strict=True))
        steps, start = graphed.steps, time.perf_counter()
        got = _generate(graphed, requests, tokens=32)
        wall, steps = time.perf_counter() - start, graphed.steps - steps
        assert got == _generate(eager, requests, tokens=32)
        times = pacer.device_times
        assert times and all(0.0 < t < wall for t in times)
        assert min(times) <= wall / steps  # a decode step's device time is within its share of the wall time
    finally:
        graphed.async_steps, graphed.pacer = was


def test_lora_inside_the_gemms_matches_the_separate_kernels(
    engines: tuple[LLMEngine, LLMEngine], model_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    """`lora_gemm` (on by default): decode projections of one-adapter batches carry their LoRA inside the GEMM,
    replayed from their own graphs; a mix replays the separate kernels. Same tokens as an eager engine that
    runs the base GEMMs and the separate kernels for every batch."""
    _, graphed = engines
    separate = _engine(model_dir, eager=True, lora_gemm="off")
    try:
        for name in ADAPTERS:
            separate.load_adapter(name, str(adapter_dirs[name]), wait=True)
        assert graphed.graphs is not None and any(key.single for key in graphed.graphs.keys)
        prompts = _prompts(graphed, 6)
        one = [(p, "r16") for p in prompts[:3]] + [(prompts[3], None)]
        mixed = list(zip(prompts, [None, "r4-mlp", "r8-qv", "r16", None, "r16"], strict=True))
        for requests in (one, mixed):
            assert _generate(graphed, requests, tokens=24) == _generate(separate, requests, tokens=24)
    finally:
        separate.stop()


def _sync_then_async(
    engine: LLMEngine, requests: dict[str, tuple[list[int], str | None, SamplingParams]]
) -> Iterator[tuple[dict[str, list[RequestOutput]], dict[str, list[torch.Tensor]]]]:
    """`run_recorded` of `requests` with sync steps, then with async ones: each run's outputs and logits rows by
    request id."""
    try:
        for async_steps in (False, True):
            engine.async_steps = async_steps
            outputs, rows = run_recorded(engine, {f"{rid}-{async_steps}": r for rid, r in requests.items()})
            yield (
                {rid: outputs[f"{rid}-{async_steps}"] for rid in requests},
                {rid: rows[f"{rid}-{async_steps}"] for rid in requests},
            )
    finally:
        engine.async_steps = False


def test_logprobs_computed_on_the_device_are_those_of_each_rows_logits(engines: tuple[LLMEngine, LLMEngine]) -> None:
    """Log-probabilities computed on the GPU and copied to page-locked memory beside the tokens, with decode
    graphs and prefills on their own stream, sync and async steps: each token's entry against its own row."""
    _, graphed = engines
    prompts = _prompts(graphed, 4)
    seeded = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.2, seed=5, logprobs=1)
    requests = {
        "greedy": (prompts[0], None, SamplingParams(max_tokens=16, ignore_eos=True, logprobs=5)),
        "adapter": (prompts[1], "r16", SamplingParams(max_tokens=16, ignore_eos=True, logprobs=20)),
        "seeded": (prompts[2], "r8-qv", seeded),
        "none": (prompts[3], None, SamplingParams(max_tokens=16, ignore_eos=True)),
    }
    assert graphed.graphs is not None
    replays = graphed.graphs.replays
    for outputs, rows in _sync_then_async(graphed, requests):
        for rid, (_, _, params) in requests.items():
            entries = check_logprobs(outputs[rid], rows[rid], params.logprobs)
            assert len(entries) == (16 if params.logprobs is not None else 0)
    assert graphed.graphs.replays - replays >= 20  # the decode steps ran as graphs


def test_penalties_bias_and_min_tokens_on_the_device_give_the_same_tokens_sync_and_async(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    """Logit processing on the GPU, with decode graphs and prefills on their own stream: each greedy token is the
    argmax of its raw row processed by the reference (a token in flight counted, with async steps), sync and
    async steps give the same tokens, and log-probabilities stay those of the raw rows."""
    _, graphed = engines
    prompts = _prompts(graphed, 4)
    eos = graphed.tokenizer.eos_token_ids
    assert eos
    penalized = SamplingParams(max_tokens=24, frequency_penalty=1.5, presence_penalty=0.5, logprobs=2)
    requests = {
        "penalized": (prompts[0], None, penalized),
        "repetition": (prompts[1], "r16", SamplingParams(max_tokens=24, repetition_penalty=1.3)),
        # The end token raised by 100: it ends the reply as soon as min_tokens allows.
        "min_tokens": (
            prompts[2],
            "r8-qv",
            SamplingParams(max_tokens=24, min_tokens=9, logit_bias=((min(eos), 100.0),)),
        ),
        "sampled": (
            prompts[3],
            None,
            SamplingParams(max_tokens=24, temperature=1.0, seed=3, min_p=0.1, frequency_penalty=1.0),
        ),
    }
    tokens: dict[bool, dict[str, list[int]]] = {}
    try:
        for async_steps in (False, True):
            graphed.async_steps = async_steps
            outputs, rows = run_recorded(graphed, {f"{rid}-{async_steps}": r for rid, r in requests.items()})
            got = {rid: [t for o in outputs[f"{rid}-{async_steps}"] for t in o.token_ids] for rid in requests}
            for rid, (prompt, _, params) in requests.items():
                for k, (token, row) in enumerate(zip(got[rid], rows[f"{rid}-{async_steps}"], strict=False)):
                    if params.greedy:
                        assert token == int(reference_process(row, params, prompt, got[rid][:k], eos).argmax())
            check_logprobs(outputs[f"penalized-{async_steps}"], rows[f"penalized-{async_steps}"], 2)
            last = outputs[f"min_tokens-{async_steps}"][-1]
            assert (last.finish_reason, last.completion_tokens) == ("stop", 9)
            tokens[async_steps] = got
    finally:
        graphed.async_steps = False
    assert tokens[False] == tokens[True]


def test_processing_a_step_never_waits_for_the_gpu() -> None:
    """A sync while processing would make an async step wait for the forward pass it was launched behind."""
    seqs = [make_seq(p, out[:-1]) if out else make_seq(p, out) for p, out in ROWS]
    in_flight = InFlightTokens(torch.tensor([out[-1] for _, out in ROWS if out], device="cuda"))
    in_flight.rows = {seq: i for i, seq in enumerate(s for s, (_, out) in zip(seqs, ROWS, strict=True) if out)}
    logits = make_logits(len(ROWS))
    want = process_logits(logits, [make_seq(p, out) for p, out in ROWS], EOS)
    on_gpu = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = process_logits(on_gpu, seqs, EOS, in_flight)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got is not None and want is not None and got.rows == want.rows
    torch.testing.assert_close(got.logits.cpu(), want.logits, rtol=1e-6, atol=1e-5)


def test_sampling_logprobs_and_inputs_of_a_step_in_flight_never_wait_for_the_gpu(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    """A blocking upload (`torch.tensor(values, device="cuda")`) waits for all the work queued before it: an
    engine stepping ahead lost its overlap to the sampled rows' cuts, the logprob rows and the decode inputs read
    from the step in flight, each uploaded that way."""
    _, graphed = engines
    cuda = torch.device("cuda")
    params = [
        SamplingParams(max_tokens=4),
        SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9),
        SamplingParams(max_tokens=4, temperature=1.0, top_k=5, min_p=0.05),
        SamplingParams(max_tokens=4, temperature=0.7, seed=3),
    ]
    generators = [make_generator(p, cuda) for p in params]
    logits = make_logits(len(params)).to(cuda)
    seqs = [make_seq(p, [1, 2]) for p in params]
    previous = InFlight.launch(seqs, torch.tensor([5, 6, 7, 8], device=cuda), graphed.forward.readback)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample_tokens(logits, params, generators)
        logprobs = StepLogprobs.compute(logits, tokens, [None, 3, None, 0])
        ids, positions = graphed.forward._decode_inputs(seqs[1:3], previous)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logprobs is not None and logprobs.rows == [1, 3]
    assert isinstance(ids, torch.Tensor) and ids.tolist() == [6, 7] and positions == [6, 6]
    assert tokens[0].item() == logits[0].argmax().item()


def test_prompt_logprobs_under_graphs_are_those_of_the_whole_prompts_logits(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    """Prompts that ask for prompt log-probabilities run eagerly beside graphed decodes and prefill graphs (which
    yield the last position's logits only), sync and async steps: their values are those of one whole-prompt
    forward pass, and the other requests' tokens are the eager engine's."""
    eager, graphed = engines
    prompts = _prompts(graphed, 4)
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    requests = {
        "asking": (prompts[2], None, SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=5)),
        "alone": (prompts[1], None, SamplingParams(max_tokens=0, prompt_logprobs=20)),
        "other": (prompts[0], None, plain),
        "adapter": (prompts[3], "r16", plain),
    }
    want = _generate(eager, [(prompts[0], None), (prompts[3], "r16")], 8)
    assert graphed.prefill_graphs is not None
    replays, grouped = graphed.prefill_graphs.replays, graphed.forward.grouped_prompts
    for outputs, _ in _sync_then_async(graphed, requests):
        for rid, top in (("asking", 5), ("alone", 20)):
            check_prompt_logprobs(graphed, requests[rid][0], first_with_prompt_logprobs(outputs[rid]), top)
        assert outputs["alone"][-1].completion_tokens == 0
        assert [[t for o in outputs[rid] for t in o.token_ids] for rid in ("other", "adapter")] == want
    # The other two prompts (9 and 51 tokens, started together) still ran in graphs: the rows of one decode graph.
    assert graphed.forward.grouped_prompts - grouped == 4 and graphed.prefill_graphs.replays == replays
