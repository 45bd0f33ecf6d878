"""`bench.scratch.scratch_dir`: a benchmark's files go when it ends, also when `timeout` ends it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from bench.scratch import scratch_dir
    folder = scratch_dir("scratch-test-")
    (folder / "model.bin").write_bytes(b"x" * 1024)
    print(folder, flush=True)
    if sys.argv[1] == "wait":
        time.sleep(60)
    """
)


def _start(mode: str) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[3]
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_the_folder_goes_when_the_script_ends() -> None:
    proc, folder = _start("end")
    assert proc.wait(timeout=30) == 0
    assert folder.name.startswith("scratch-test-")  # (the script wrote into it before it printed it)
    assert not folder.exists()


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_the_folder_goes_when_timeout_terminates_the_script() -> None:
    proc, folder = _start("wait")
    assert (folder / "model.bin").exists()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not folder.exists()
