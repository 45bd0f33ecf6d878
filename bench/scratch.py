"""Scratch folders for a benchmark's files, removed when the script ends.

A run of `engine_gpu_e2e.py` writes a random 7B model (13 GB at 32 layers) and hundreds of adapter files; left
behind, a few runs filled a GPU machine's disk (stop 42). `timeout` ends a run with SIGTERM, which Python does
not turn into an exit by default, so the first scratch folder also makes SIGTERM exit the script normally.
"""

from __future__ import annotations

import atexit
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path


def scratch_dir(prefix: str) -> Path:
    """A new empty folder under the system's temporary directory, removed (with its files) at the exit."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    main = threading.current_thread() is threading.main_thread()  # (only it may set a handler)
    if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return folder
