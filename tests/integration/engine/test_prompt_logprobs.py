"""Prompt log-probabilities (vLLM's `prompt_logprobs`) of the real engine (SmolLM2) against transformers + peft
(the independent reference): base and adapter, a prompt prefilled in chunks, beside other requests, and after
the same prompt (which the prefix cache would otherwise serve)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.logprobs import PromptLogprob
from engine.sampling import SamplingParams
from tests.integration.engine.conftest import Collector, run
from tests.support.hf_reference import BASE_ADAPTER, chat_prompt_ids, load_reference_model, load_reference_peft
from tests.support.model_files import DEMO_ADAPTERS, demo_adapter_dir

QUESTION = "Give me three tips for staying healthy, and explain why each of them matters."


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    # A prefill budget of 16 tokens: the prompt below (about 40) is prefilled in chunks over several steps.
    eng = LLMEngine(
        EngineConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=16, lora_slots=2, max_lora_rank=16)
    )
    eng.load_adapter("pirate", str(demo_adapter_dir("pirate")), wait=True)
    eng.start()
    yield eng
    eng.stop()


@torch.no_grad()
def reference(ids: list[int], adapter: str | None) -> torch.Tensor:
    """log_softmax of the reference model's logits at every position of `ids` (row q: token q + 1's)."""
    if adapter is None:
        logits = load_reference_model()[0](torch.tensor([ids])).logits
    else:
        peft = load_reference_peft({name: demo_adapter_dir(name) for name in DEMO_ADAPTERS})
        logits = peft(input_ids=torch.tensor([ids]), adapter_names=[adapter or BASE_ADAPTER]).logits
    return torch.log_softmax(logits[0].float(), dim=-1)


def check(got: tuple[PromptLogprob, ...] | None, ids: list[int], adapter: str | None, top: int) -> None:
    want = reference(ids, adapter)
    assert got is not None and len(got) == len(ids) - 1
    for q, entry in enumerate(got):
        row, token = want[q], ids[q + 1]
        assert entry.logprob == pytest.approx(float(row[token]), abs=2e-3)
        assert abs(entry.rank - int((row >= row[token]).sum())) <= int(((row - row[token]).abs() < 2e-3).sum())
        best = row.topk(top)
        assert [v for _, v in entry.top] == pytest.approx(best.values.tolist(), abs=2e-3)
        for i, v in entry.top:  # each listed token has the reference's value (near-ties may swap places)
            assert v == pytest.approx(float(row[i]), abs=2e-3)


@pytest.mark.parametrize("adapter", [None, "pirate"])
def test_chunked_prompt_logprobs_match_transformers_beside_other_requests(
    engine: LLMEngine, adapter: str | None
) -> None:
    ids = chat_prompt_ids([{"role": "user", "content": QUESTION}])
    assert len(ids) > 2 * engine.config.max_num_batched_tokens

    def others(name: str) -> list[Collector]:
        return [run(engine, f"{name}-{adapter}-{i}", ids[: 10 + i], SamplingParams(max_tokens=12)) for i in range(2)]

    first = others("alone")
    alone = [(o.wait(), o.token_ids)[1] for o in first]
    beside = others("beside")  # submitted with the request below: they share its steps
    asking = run(engine, f"asking-{adapter}", ids, SamplingParams(max_tokens=4, prompt_logprobs=5), adapter)
    asking.wait()
    assert [(o.wait(), o.token_ids)[1] for o in beside] == alone  # their tokens do not change
    check(asking.outputs[0].prompt_logprobs, ids, adapter, 5)
    assert all(o.prompt_logprobs is None for o in asking.outputs[1:])


def test_a_prompt_the_prefix_cache_holds_still_gets_every_prompt_logprob(engine: LLMEngine) -> None:
    ids = chat_prompt_ids([{"role": "user", "content": QUESTION + " Be brief."}])
    run(engine, "warm", ids, SamplingParams(max_tokens=1)).wait()
    assert run(engine, "cached", ids, SamplingParams(max_tokens=1)).wait().cached_tokens > 0
    scored = run(engine, "scored", ids, SamplingParams(max_tokens=0, prompt_logprobs=2))
    last = scored.wait()
    assert (last.cached_tokens, last.completion_tokens, last.token_ids, last.finish_reason) == (0, 0, (), "length")
    check(scored.outputs[0].prompt_logprobs, ids, None, 2)
