"""bench/engine_gpu_e2e.py's command line refuses counts that leave a figure without samples, and modes it does
not know, before any work; each --compose-late mode gets its pacer."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import cast

import pytest

from bench import engine_gpu_e2e
from engine.engine import LLMEngine
from engine.step_pacing import ComposePacer


@pytest.mark.parametrize("flag", ["--cold-rounds", "--swaps"])
def test_a_count_below_one_is_refused_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    monkeypatch.setattr(sys, "argv", ["engine_gpu_e2e.py", "--tokenizer", "unused", flag, "0"])
    with pytest.raises(SystemExit) as done:
        engine_gpu_e2e.main()
    assert done.value.code == 2
    assert f"{flag} must be at least 1, got 0" in capsys.readouterr().err


def test_a_compose_late_mode_it_does_not_know_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["engine_gpu_e2e.py", "--tokenizer", "unused", "--compose-late", "on,later"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as done:
        engine_gpu_e2e.main()
    assert done.value.code == 2
    assert "--compose-late takes on, by-kind, off, comma-separated, got 'on,later'" in capsys.readouterr().err


def test_each_compose_late_mode_gets_its_pacer() -> None:
    own = ComposePacer(slack_s=0.002)
    engine = cast(LLMEngine, SimpleNamespace(pacer=own))
    pacers = engine_gpu_e2e.pacers_for(engine, ("on", "by-kind", "off"))
    assert pacers["on"] is own and pacers["off"] is None
    kind = pacers["by-kind"]
    assert kind is not None and kind.by_kind and kind.slack_s == 0.002
    unpaced = cast(LLMEngine, SimpleNamespace(pacer=None))  # no async steps: nothing composes late
    assert engine_gpu_e2e.pacers_for(unpaced, ("on", "by-kind")) == {"on": None, "by-kind": None}


def test_longest_composition_of_each_kind() -> None:
    pacer = ComposePacer()
    assert engine_gpu_e2e.longest(pacer, prompts=True) == 0.0
    for seconds, prompts in ((0.003, True), (0.001, False), (0.002, False)):
        pacer.composed(seconds, prompts)
    assert (engine_gpu_e2e.longest(pacer, False), engine_gpu_e2e.longest(pacer, True)) == (0.002, 0.003)
