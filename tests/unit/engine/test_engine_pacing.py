"""The engine's late composition (`EngineConfig.compose_late`) through its step loop on a tiny CPU model with
async steps: a request that arrives while the next step waits to be composed joins that very step.

A CPU step is done once launched, so these tests stand in for a step that runs on a device for a while
(`InFlight.done` patched, the pacer given that step's time); tests/gpu times real steps."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput, SeqStatus
from engine.step_forward import InFlight
from engine.step_pacing import ComposePacer
from tests.support.random_model import write_tiny_llama
from tests.unit.engine.test_engine_logprobs import tiny_engine

PROMPT = [5, 17, 33, 2, 90, 41, 7]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("pacing-model"))


class Timed:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def done(self) -> bool:
        return True

    def device_seconds(self) -> float:
        return self.seconds


@pytest.fixture
def engine(model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LLMEngine]:
    eng = tiny_engine(model, "on", compose_late="on")
    monkeypatch.setattr(InFlight, "done", lambda self: False)  # a step still running on the device
    yield eng
    eng.stop()


def pace(eng: LLMEngine, step_seconds: float) -> ComposePacer:
    pacer = ComposePacer(slack_s=0.0)
    pacer.ran(Timed(step_seconds))
    pacer.composed(0.0)
    eng.pacer = pacer
    return pacer


def add(eng: LLMEngine, request_id: str, outputs: list[RequestOutput]) -> None:
    eng.add_request(request_id, PROMPT, PARAMS, None, outputs.append)


def test_the_pacer_runs_with_async_steps_unless_off(model: Path) -> None:
    for steps, late, paced in (("on", "auto", True), ("on", "on", True), ("on", "off", False), ("off", "on", False)):
        eng = tiny_engine(model, steps, compose_late=late)
        assert (eng.pacer is not None) is paced, (steps, late)
        eng.stop()


def test_a_request_arriving_during_the_wait_joins_the_step_composed_then(engine: LLMEngine) -> None:
    outputs: list[RequestOutput] = []
    add(engine, "first", outputs)
    engine._drain_commands()
    engine.step()  # the first request's prefill, in flight
    pacer = pace(engine, step_seconds=30.0)
    arrival = threading.Timer(0.05, add, (engine, "second", outputs))
    arrival.start()
    start = time.perf_counter()
    engine.step()  # waits for the step in flight to near its end, or for an arrival
    waited = time.perf_counter() - start
    arrival.join()
    second = next(s for s in engine.scheduler.running if s.request_id == "second")
    assert second.status is SeqStatus.RUNNING and second.prefilled == len(PROMPT)  # prefilled in that step
    assert (pacer.waits, pacer.woken) == (1, 1)
    assert 0.04 < waited < 20.0
    engine.pacer = None  # the rest without waits
    engine.run_until_idle()
    assert [o.finish_reason for o in outputs if o.finish_reason] == ["length", "length"]


def test_without_an_arrival_the_step_is_composed_at_the_deadline(engine: LLMEngine) -> None:
    outputs: list[RequestOutput] = []
    add(engine, "only", outputs)
    engine._drain_commands()
    engine.step()
    pacer = pace(engine, step_seconds=0.2)
    start = time.perf_counter()
    engine.step()
    assert time.perf_counter() - start >= 0.15  # (the clock of the step's start is read after its launch)
    assert (pacer.waits, pacer.woken) == (1, 0)
    engine.pacer = None
    engine.run_until_idle()
    assert sum(len(o.token_ids) for o in outputs) == PARAMS.max_tokens and outputs[-1].finish_reason == "length"
