"""`gateway.server.run` stops when asked, also while its engines are still starting."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from gateway import __main__ as gateway_main
from gateway.config import from_dict
from gateway.server import run
from policy.static import StaticPolicy


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_stop_while_engines_start_ends_at_once_and_stops_them(tmp_path: Path) -> None:
    pid_file = tmp_path / "engine.pid"
    # An engine that never becomes ready (a model load that takes minutes); it records its pid.
    script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    config = from_dict(
        {
            "engines": {"local": {"command": [sys.executable, "-c", script], "start_timeout_s": 60}},
            "registry": {"path": ":memory:", "seed_demo_adapters": False},
        }
    )
    stop = asyncio.Event()
    serving = asyncio.ensure_future(run(config, policy=StaticPolicy(), protocols=lambda gateway: [], stop=stop))
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            break
        await asyncio.sleep(0.05)
    pid = int(pid_file.read_text())
    stop.set()  # what SIGTERM does
    started = time.monotonic()
    try:
        assert await asyncio.wait_for(asyncio.shield(serving), 10) == 0
    finally:
        if not serving.done():
            serving.cancel()
            with pytest.raises(asyncio.CancelledError):
                await serving
    assert time.monotonic() - started < 10
    assert _gone(pid)


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["/nonexistent/engine"], "adaptergate: engine engine-0: cannot run '/nonexistent/engine'"),
        ([sys.executable, "-c", "raise SystemExit(3)"], "adaptergate: engine engine-0 exited with status 3"),
    ],
)
def test_engine_that_cannot_start_ends_serve_with_a_message(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
    message: str,
) -> None:
    # Process-wide logging and tracing set-up is not what this test is about; keep pytest's in place.
    monkeypatch.setattr(gateway_main, "setup_logging", lambda level, fmt: None)
    monkeypatch.setattr(gateway_main, "setup_tracing", lambda mode: None)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"engines": {"local": {"command": command}}, "registry": {"path": ":memory:"}}))
    assert gateway_main.main(["serve", "--config", str(path)]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["folder", "not-sqlite"])
def test_a_registry_path_that_cannot_be_opened_is_a_config_error(tmp_path: Path, kind: str) -> None:
    # Once a sqlite3 traceback after the engines had started.
    from gateway.config import ConfigError
    from gateway.server import _open_registry

    path = tmp_path / "registry.db"
    if kind == "folder":
        path.mkdir()
    else:
        path.write_text("this is not a database\n" * 100)
    config = from_dict({"registry": {"path": str(path), "seed_demo_adapters": False}})
    with pytest.raises(ConfigError, match=r"registry\.path: cannot open"):
        _open_registry(config)
