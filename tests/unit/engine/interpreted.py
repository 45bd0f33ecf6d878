"""Triton kernels interpreted on the CPU, in a child pytest: triton reads TRITON_INTERPRET when its kernels are
defined, so a test module cannot switch it on for itself once imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_interpreted(node: str) -> None:
    """Run the pytest `node` (e.g. `path::TestInterpreted`) with TRITON_INTERPRET=1; fail unless all of it
    ran and passed (a skip there would mean the kernels were not exercised)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", node],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "skipped" not in proc.stdout and " passed" in proc.stdout, proc.stdout[-2000:]
