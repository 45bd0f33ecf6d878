"""bench/engine_gpu.py's command line runs the sections it names (the GPU work itself is replaced here)."""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import pytest

from bench import engine_gpu


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the sections `main` ran, with no GPU needed."""
    ran: list[str] = []
    device = SimpleNamespace(name="test device", multi_processor_count=1)
    monkeypatch.setattr(engine_gpu.torch.cuda, "get_device_properties", lambda _dev: device)
    monkeypatch.setattr(engine_gpu, "copy_bandwidth", lambda: 1.0)
    monkeypatch.setattr(engine_gpu, "SUMMARY", [])

    def record(name: str):  # type: ignore[no-untyped-def]
        def section(args: argparse.Namespace, *_rest: object) -> dict[int, object]:
            ran.append(name)
            return {}

        return section

    for name in ("section_sweep", "section_kernels", "section_latency", "section_mixed", "section_decode_layer"):
        monkeypatch.setattr(engine_gpu, name, record(name))
    monkeypatch.setattr(engine_gpu, "section_mixed_expand_shapes", lambda *_: None)
    return ran


def _main(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["engine_gpu.py", *argv])
    with pytest.raises(SystemExit) as done:
        engine_gpu.main()
    return int(done.value.code or 0)


def test_sweep_flag_runs_the_sweep_first(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    """--sweep was once parsed and then ignored: nothing ran the sweep."""
    assert _main(monkeypatch, "--sweep", "--only", "a") == 0
    assert calls == ["section_sweep", "section_kernels"]


def test_without_the_flag_no_sweep_runs(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    assert _main(monkeypatch, "--only", "ab") == 0
    assert calls == ["section_kernels", "section_decode_layer"]
