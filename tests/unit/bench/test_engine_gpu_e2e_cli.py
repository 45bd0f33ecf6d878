"""bench/engine_gpu_e2e.py's command line refuses counts that leave a figure without samples, before any work."""

from __future__ import annotations

import sys

import pytest

from bench import engine_gpu_e2e


@pytest.mark.parametrize("flag", ["--cold-rounds", "--swaps"])
def test_a_count_below_one_is_refused_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    monkeypatch.setattr(sys, "argv", ["engine_gpu_e2e.py", "--tokenizer", "unused", flag, "0"])
    with pytest.raises(SystemExit) as done:
        engine_gpu_e2e.main()
    assert done.value.code == 2
    assert f"{flag} must be at least 1, got 0" in capsys.readouterr().err
