"""The engine's late composition (`EngineConfig.compose_late`) through its step loop on a tiny CPU model with
async steps: what ends the wait before a step's composition, and what the pacer is told.

A CPU step is done once launched, so these tests stand in for a step that runs on a device for a while
(`InFlight.done` patched, the pacer given that step's time). tests/gpu/test_engine_gpu.py checks the device
times a GPU engine's pacer gets."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import engine.engine as engine_module
from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput, SeqStatus
from engine.step_forward import InFlight
from engine.step_pacing import ComposePacer
from tests.support.random_model import write_tiny_llama
from tests.unit.engine.test_engine_logprobs import tiny_engine
from tests.unit.engine.test_step_pacing import Clock, Flight

PROMPT = [5, 17, 33, 2, 90, 41, 7]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("pacing-model"))


@pytest.fixture
def engine(model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LLMEngine]:
    eng = tiny_engine(model, "on", compose_late="on")
    monkeypatch.setattr(InFlight, "done", lambda self: False)  # a step still running on the device
    yield eng
    eng.stop()


def pace(eng: LLMEngine, step_seconds: float) -> ComposePacer:
    pacer = ComposePacer(slack_s=0.0)
    pacer.ran(Flight(Clock(), seconds=step_seconds))
    pacer.composed(0.0)
    eng.pacer = pacer
    return pacer


def add(eng: LLMEngine, request_id: str, outputs: list[RequestOutput]) -> None:
    eng.add_request(request_id, PROMPT, PARAMS, None, outputs.append)


def test_the_pacer_runs_with_async_steps_unless_off(model: Path) -> None:
    for steps, late, paced in (
        ("on", "auto", True),
        ("on", "on", True),
        ("on", "by-kind", True),
        ("on", "off", False),
        ("off", "on", False),
    ):
        eng = tiny_engine(model, steps, compose_late=late)
        assert (eng.pacer is not None) is paced, (steps, late)
        assert eng.pacer is None or eng.pacer.by_kind is (late == "by-kind")
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


def started_step(engine: LLMEngine, outputs: list[RequestOutput], step_seconds: float) -> ComposePacer:
    """One request's prefill in flight, then a pacer that expects each step to take `step_seconds`."""
    add(engine, "first", outputs)
    engine._drain_commands()
    engine.step()
    return pace(engine, step_seconds)


def test_a_finished_load_ends_the_wait(engine: LLMEngine) -> None:
    outputs: list[RequestOutput] = []
    pacer = started_step(engine, outputs, step_seconds=30.0)
    waker = threading.Timer(0.05, engine._wake)  # what `AdapterPool.on_loaded` calls: no command queued
    waker.start()
    start = time.perf_counter()
    engine.step()
    waker.join()
    assert (pacer.waits, pacer.woken) == (1, 1) and time.perf_counter() - start < 20.0


def test_a_command_queued_before_the_step_ends_the_wait_at_once(engine: LLMEngine) -> None:
    outputs: list[RequestOutput] = []
    pacer = started_step(engine, outputs, step_seconds=30.0)
    ran: list[bool] = []
    engine._commands.put(lambda: ran.append(True))  # queued, its wake-up already taken (cleared by the wait)
    start = time.perf_counter()
    engine.step()
    assert ran == [True] and (pacer.waits, pacer.woken) == (1, 1) and time.perf_counter() - start < 20.0


def test_a_traced_step_is_not_held_back(engine: LLMEngine) -> None:
    outputs: list[RequestOutput] = []
    pacer = started_step(engine, outputs, step_seconds=30.0)
    engine.step_trace = []
    start = time.perf_counter()
    engine.step()
    assert pacer.waits == 0 and time.perf_counter() - start < 20.0 and len(engine.step_trace) == 1


def test_the_step_in_flight_starts_when_the_tokens_before_it_are_read(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not after they are handed on: the handling of a step's tokens runs while the next step runs."""
    outputs: list[RequestOutput] = []
    started_step(engine, outputs, step_seconds=0.0)  # no wait: composed at once
    add(engine, "second", outputs)
    engine._drain_commands()
    engine.step()  # both decoding from here
    read_at: list[float] = []
    read = InFlight.read

    def timed_read(flight: InFlight) -> list[int]:
        tokens = read(flight)
        read_at.append(time.perf_counter())
        return tokens

    append = engine._append

    def slow_append(*args: object, **kwargs: object) -> None:
        time.sleep(0.02)
        append(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(InFlight, "read", timed_read)
    monkeypatch.setattr(engine, "_append", slow_append)
    engine.step()
    assert len(read_at) == 1 and engine._inflight_since == pytest.approx(read_at[0], abs=0.005)  # not 40 ms later


@pytest.mark.parametrize("ended", [False, True], ids=["queued-ahead", "queued-late"])
def test_only_a_step_queued_before_the_device_ran_dry_is_timed(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, ended: bool
) -> None:
    """A step queued after the one before it had ended would count the device's wait for the engine thread."""
    outputs: list[RequestOutput] = []
    started_step(engine, outputs, step_seconds=0.0)
    event = object()
    monkeypatch.setattr(engine_module, "step_start_event", lambda device: event)
    monkeypatch.setattr(InFlight, "done", lambda self: ended)
    launches: list[object] = []
    launch = InFlight.launch

    def recorded(*args: object) -> InFlight:
        launches.append(args[-1])
        return launch(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(InFlight, "launch", recorded)
    engine.step()
    assert launches == [None if ended else event]


def test_a_launch_after_the_step_before_ended_is_dry_and_starts_at_once(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs: list[RequestOutput] = []
    started_step(engine, outputs, step_seconds=0.0)
    engine.step()  # decoding
    monkeypatch.setattr(InFlight, "done", lambda self: True)  # the device had finished it when this step launched
    read_at: list[float] = []
    read = InFlight.read

    def timed_read(flight: InFlight) -> list[int]:
        read_at.append(time.perf_counter())
        return read(flight)

    monkeypatch.setattr(InFlight, "read", timed_read)
    dry = engine.dry_launches
    engine.step()
    assert engine.dry_launches == dry + 1
    assert engine._inflight_since < read_at[0]  # from its launch, not from the read that did not wait


def test_a_composition_that_read_the_step_before_first_is_timed_from_that_read(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose rows need the tokens in flight reads them before composing (a constrained request): the
    wait for the device is no part of the composition the pacer estimates from."""
    outputs: list[RequestOutput] = []
    started_step(engine, outputs, step_seconds=0.0)
    engine.step()
    monkeypatch.setattr(InFlight, "rows", property(lambda self: {}))  # no row's token in flight: read first
    read = InFlight.read

    def slow_read(flight: InFlight) -> list[int]:
        time.sleep(0.05)  # the device still running it
        return read(flight)

    monkeypatch.setattr(InFlight, "read", slow_read)
    pacer = ComposePacer()
    engine.pacer = pacer
    engine.step()
    assert len(pacer.compose_times) == 1 and pacer.compose_times[0] < 0.04


def eager_beside_graphs(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, launches_s: float) -> None:
    """The engine's next steps run an eager pass beside graphs whose launches take `launches_s`, as
    `StepForward` notes where graphs hold the other rows (`eager_started`; the CPU forward has no graphs)."""
    logits = engine.forward.logits

    def eager(*args: object, **kwargs: object) -> object:
        started = time.perf_counter()
        time.sleep(launches_s)
        result = logits(*args, **kwargs)  # type: ignore[arg-type]
        engine.forward.eager_started = started
        return result

    monkeypatch.setattr(engine.forward, "logits", eager)


def test_a_step_with_an_eager_pass_is_composed_up_to_that_pass(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst's prompts in one eager pass take the engine thread milliseconds of launches: timed to their
    end, the step set the longest composition of the pacer's window, and every next deadline fell at its
    step's start (stop 43: a hot swap's first request then waited a step more, as without the pacer)."""
    outputs: list[RequestOutput] = []
    started_step(engine, outputs, step_seconds=0.0)
    pacer = ComposePacer()
    engine.pacer = pacer
    eager_beside_graphs(engine, monkeypatch, launches_s=0.2)
    engine.step()
    assert len(pacer.compose_times) == 1 and pacer.compose_times[0] < 0.15


def test_an_eager_steps_early_end_is_no_step_time(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device runs an eager pass as it is launched, before the step's start the engine notes: seen done
    early, it would enter the estimates as a step far shorter than any, the next deadlines at their start."""
    outputs: list[RequestOutput] = []
    pacer = started_step(engine, outputs, step_seconds=30.0)
    logits = engine.forward.logits
    eager_beside_graphs(engine, monkeypatch, launches_s=0.0)
    engine._commands.put(lambda: None)  # (ends the wait for the step in flight at once)
    engine.step()  # the eager step, in flight
    monkeypatch.setattr(engine.forward, "logits", logits)
    monkeypatch.setattr(InFlight, "done", lambda self: True)  # seen done before the deadline
    engine.step()
    assert pacer.device_times == (30.0,) and pacer.waits == 2


def timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def test_by_kind_decode_steps_are_held_to_decode_compositions(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`compose_late` by-kind: a step with no prompt work in sight waits for the decode-only compositions'
    margin, not a prompt step's; a step that took in a prompt is recorded as such, however long it composed."""
    outputs: list[RequestOutput] = []
    started_step(engine, outputs, step_seconds=0.0)
    pacer = ComposePacer(slack_s=0.0, by_kind=True)
    pacer.ran(Flight(Clock(), seconds=0.3))
    pacer.composed(0.25, prompts=True)
    engine.pacer = pacer
    assert timed_step(engine) < 0.2  # no decode composition known yet: held to the prompt step's 0.25 s
    assert timed_step(engine) >= 0.2  # held to the decode step's just before
    logits = engine.forward.logits

    def slow_prompts(running: object, prefills: dict[object, int], *args: object) -> object:
        if prefills:
            time.sleep(0.2)  # a prompt step that composes long
        return logits(running, prefills, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.forward, "logits", slow_prompts)
    add(engine, "second", outputs)  # (ends the wait at once)
    engine.step()  # its prefill
    assert max(pacer.compose_times) >= 0.2
    assert timed_step(engine) >= 0.2  # the decode steps' margin is still theirs
    monkeypatch.setattr(engine.scheduler, "prompts_next", lambda: True)  # a long prompt's next chunk, say
    assert timed_step(engine) < 0.2  # held to the longest composition, a prompt step's
    engine.pacer = None
    engine.run_until_idle()
