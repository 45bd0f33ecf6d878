"""Greedy tokens identical to transformers + peft (the independent reference), base and adapters mixed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from tests.integration.engine.conftest import Collector
from tests.support.hf_reference import chat_prompt_ids, greedy_generate, load_reference_peft
from tests.support.model_files import DEMO_ADAPTERS, demo_adapter_dir
from tests.unit.engine.tiny import write_adapter

NEW_TOKENS = 20
QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
]


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    eng = LLMEngine(
        EngineConfig(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=1024, lora_slots=6, max_lora_rank=16)
    )
    for name in DEMO_ADAPTERS:
        eng.load_adapter(name, str(demo_adapter_dir(name)), wait=True)
    eng.start()
    yield eng
    eng.stop()


def generate_together(engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None]) -> list[list[int]]:
    """Submit every request before any runs, so they share engine steps (one mixed batch)."""
    sinks = [Collector() for _ in prompts]
    params = SamplingParams(max_tokens=NEW_TOKENS)
    for i, (prompt, adapter, sink) in enumerate(zip(prompts, adapters, sinks, strict=True)):
        engine.add_request(f"{adapter}-{i}-{id(sink)}", prompt, params, adapter, sink)
    for sink in sinks:
        sink.wait()
    return [sink.token_ids for sink in sinks]


def test_base_model_matches_transformers(engine: LLMEngine) -> None:
    prompts = [chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert prompts[0] == engine.tokenizer.encode_chat([("user", QUESTIONS[0])])  # same chat template
    ours = generate_together(engine, prompts, [None] * len(prompts))
    assert ours == greedy_generate(prompts, [None] * len(prompts), NEW_TOKENS)


@pytest.mark.parametrize("adapter", DEMO_ADAPTERS)
def test_each_demo_adapter_matches_peft(engine: LLMEngine, adapter: str) -> None:
    prompts = [chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS[:2]]
    ours = generate_together(engine, prompts, [adapter] * 2)
    reference = greedy_generate(prompts, [adapter] * 2, NEW_TOKENS)
    assert ours == reference
    base = greedy_generate(prompts, [None] * 2, NEW_TOKENS)
    assert ours != base, f"{adapter} does not change the model's output"


def test_mixed_batch_base_and_three_adapters_of_two_ranks(engine: LLMEngine) -> None:
    ranks = {name: engine.pool.lookup(name).spec.rank for name in DEMO_ADAPTERS}  # type: ignore[union-attr]
    assert len(set(ranks.values())) >= 2, ranks
    question = [{"role": "user", "content": "Tell me something about the ocean."}]
    rows: list[str | None] = [None, *DEMO_ADAPTERS, None, DEMO_ADAPTERS[0]]
    prompts = [chat_prompt_ids(question)] * len(rows)
    ours = generate_together(engine, prompts, rows)
    assert ours == greedy_generate(prompts, rows, NEW_TOKENS)
    assert len({tuple(t) for t in ours}) >= 4  # base and every adapter answer differently


def test_all_projections_rslora_and_ranks_match_peft(engine: LLMEngine, tmp_path: Path) -> None:
    specs = {
        "all7-r4": dict(
            rank=4, alpha=8, modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        ),
        "mlp-r16-rs": dict(
            rank=16, alpha=4, modules=("gate_proj", "up_proj", "down_proj"), config_overrides={"use_rslora": True}
        ),
    }
    paths = {}
    for seed, (name, spec) in enumerate(specs.items()):
        paths[name] = write_adapter(tmp_path / name, arch=engine.arch, seed=seed + 11, **spec)  # type: ignore[arg-type]
        engine.load_adapter(name, str(paths[name]), wait=True)
    rows: list[str | None] = ["all7-r4", None, "mlp-r16-rs"]
    prompts = [chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    ours = generate_together(engine, prompts, rows)
    reference = greedy_generate(prompts, rows, NEW_TOKENS, model=load_reference_peft(paths))
    assert ours == reference
    for name in specs:
        engine.unload_adapter(name)
