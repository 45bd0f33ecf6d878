"""bench/fairness.py's command line: a run too short to measure is a usage error, not an IndexError."""

from __future__ import annotations

import sys

import pytest

from bench import fairness


def test_seconds_shorter_than_the_warm_up_and_one_window_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["fairness.py", "--seconds", "5"])
    with pytest.raises(SystemExit) as exit_:
        fairness.main()
    assert exit_.value.code == 2
    assert "--seconds must be at least 20" in capsys.readouterr().err
