"""Supervision of local engine processes (`gateway.engine_process.LocalEngine`) with scripted children."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from gateway import engine_process
from gateway.engine_process import LocalEngine

# A stand-in engine following the ready-file contract; each run counts itself in COUNTER and then acts
# on its run number: 1 serves briefly and dies, 2 hangs without ever becoming ready, 3 serves.
_SCRIPT = """
import json, os, sys, time
counter = sys.argv[1]
run = len(open(counter).read()) + 1 if os.path.exists(counter) else 1
open(counter, "a").write("x")
ready = sys.argv[sys.argv.index("--ready-file") + 1]
if run == 2:
    time.sleep(60)
open(ready + ".tmp", "w").write(json.dumps({"port": 7000 + run, "pid": os.getpid()}))
os.replace(ready + ".tmp", ready)
time.sleep(0.2 if run == 1 else 60)
"""


async def test_a_restart_that_times_out_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_process, "_RESTART_PAUSE_S", 0.05)
    counter = tmp_path / "runs"
    engine = LocalEngine([sys.executable, "-c", _SCRIPT, str(counter)], name="engine-0", start_timeout_s=1.0)
    try:
        assert await engine.start() == "127.0.0.1:7001"
        restarted: asyncio.Queue[str] = asyncio.Queue()
        engine.supervise(restarted.put_nowait)
        # Run 2 is given up on after start_timeout_s; supervision goes on and run 3 serves.
        assert await asyncio.wait_for(restarted.get(), 10) == "127.0.0.1:7003"
        assert counter.read_text() == "xxx"
    finally:
        await engine.stop(timeout_s=2)
