"""Structured outputs on a CUDA GPU (skipped without one): xgrammar's mask kernel gives the CPU's masks, and the
tiny engine's constrained replies follow their grammar under captured graphs, sync and async steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.loader import resolve_model
from engine.sampling import SamplingParams
from engine.structured import StructuredOutputs, mask_logits
from engine.tokenizer import Tokenizer
from tests.support.random_model import write_tiny_llama
from tests.unit.engine.test_engine_logprobs import PROMPT, run_recorded
from tests.unit.engine.test_engine_structured import THREE
from tests.unit.engine.test_structured import _seq

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("structured-gpu"))


def test_masks_on_the_gpu_are_the_cpus(model: Path) -> None:
    structured = StructuredOutputs(Tokenizer(resolve_model(str(model))), 128)

    def order() -> list[object]:
        return [_seq(structured.grammar("grammar", THREE)), _seq(None), _seq(structured.grammar("json_object", ""))]

    logits = torch.randn(3, 128)
    expected = mask_logits(logits, order())  # type: ignore[arg-type]
    on_gpu = mask_logits(logits.cuda(), order())  # type: ignore[arg-type]
    assert torch.equal(on_gpu.cpu(), expected) and not torch.equal(expected, logits)
    assert torch.equal(expected[1], logits[1])


@pytest.mark.parametrize("async_steps", ["off", "on"])
def test_constrained_replies_follow_their_grammar_under_graphs(model: Path, async_steps: str) -> None:
    engine = LLMEngine(
        EngineConfig(model=str(model), device="cuda", dtype="float32", max_num_seqs=4, max_model_len=64,
                     async_steps=async_steps)
    )  # fmt: skip
    try:
        plain = SamplingParams(max_tokens=8)
        alone, _ = run_recorded(engine, {"plain": (PROMPT, None, plain)})
        constrained = {
            "grammar": SamplingParams(max_tokens=8, structured_kind="grammar", structured_spec=THREE),
            "choice": SamplingParams(
                max_tokens=8,
                temperature=1.0,
                seed=3,
                structured_kind="choice",
                structured_spec=json.dumps(["w5w9", "w8"]),
            ),
        }
        mixed, _ = run_recorded(
            engine, {"plain": (PROMPT, None, plain), **{rid: (PROMPT, None, p) for rid, p in constrained.items()}}
        )
        tokens = {rid: [t for o in outputs for t in o.token_ids] for rid, outputs in mixed.items()}
        assert tokens["plain"] == [t for o in alone["plain"] for t in o.token_ids]
        g = tokens["grammar"]
        assert len(g) == 3 and g[0] in (5, 9) and g[1] in (5, 9) and g[2] in (7, 8)
        assert tokens["choice"] in ([5, 9], [8])
        assert all(mixed[rid][-1].finish_reason == "stop" for rid in constrained)
    finally:
        engine.stop()
