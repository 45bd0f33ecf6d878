"""Process-wide interpreter settings for a GPU engine, whose step loop is bound by Python, not by the GPU.

Two things stall that loop while adapters load (bench/RESULTS-gpu.md, section d):
- The GIL. A loader thread that wants the GIL gets it only after the holder's switch interval (5 ms by
  default), and then keeps it as long: steps wait up to that long. A short interval spreads a load's
  Python work into short slices; it only matters while threads contend. Measured on an H200 it did not
  help reliably (parts of a load hold the GIL in C for their whole length), so the engine keeps Python's
  unless configured.
- Full garbage collections, which walk every tracked object: the start-up ones (model, captured graphs,
  tokenizer) are most of them and live as long as the engine. Freezing them keeps full collections short.
"""

from __future__ import annotations

import gc
import sys

_DEFAULT_SWITCH_INTERVAL_S = sys.getswitchinterval()
_serving = 0  # engines settled and not yet restored: the settings are process-wide


def settle_for_serving(switch_interval_ms: float) -> None:
    """Set the GIL switch interval (0 keeps the current one) and freeze the objects alive now.

    Call once start-up is done. Garbage is collected first, so only live objects are frozen. Every call
    is paired with one `restore`; the settings stay until the last engine restores them.
    """
    global _serving
    _serving += 1
    if switch_interval_ms > 0:
        sys.setswitchinterval(switch_interval_ms / 1e3)
    gc.collect()
    gc.freeze()


def restore() -> None:
    """Undo `settle_for_serving` (an engine stopped inside a longer-lived process: tests, benchmarks) once
    no other engine of the process still serves."""
    global _serving
    _serving = max(0, _serving - 1)
    if _serving:
        return
    sys.setswitchinterval(_DEFAULT_SWITCH_INTERVAL_S)
    gc.unfreeze()
