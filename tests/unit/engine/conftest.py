"""Fixtures shared by the engine's unit tests: `replays` stands in for CUDA graph capture on the CPU, and
`prefill_stream` for CUDA streams."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

from engine import cuda_graphs


class _Graph:
    """A captured forward: each replay reruns it from the buffers and rewrites the captured output."""

    def __init__(self, forward: Callable[[], torch.Tensor], out: torch.Tensor, log: list[object], key: object):
        self.forward, self.out, self.log, self.key = forward, out, log, key

    def replay(self) -> None:
        self.log.append(self.key)
        with torch.inference_mode():
            self.out.copy_(self.forward())


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Capture without CUDA; the keys of the graphs replayed, in order."""
    log: list[object] = []

    def capture(forward: Callable[[], torch.Tensor], pool: object, stream: object) -> tuple[_Graph, torch.Tensor]:
        out = forward()
        key = getattr(forward, "args", (None,))[0]  # PrefillGraphs passes a partial over its key
        return _Graph(forward, out, log, key), out

    monkeypatch.setattr(cuda_graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: None)
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_capture", _keyed_capture)
    return log


def _keyed_capture(self: cuda_graphs.DecodeGraphs, key: cuda_graphs.GraphKey) -> None:
    graph, out = cuda_graphs.capture(lambda: self._forward(key), self._pool, self.capture_stream)
    graph.key = key  # type: ignore[attr-defined]
    self._graphs[key], self._logits[key] = graph, out  # type: ignore[assignment]


class HostStream:
    """A CUDA stream's stand-in: the CPU runs work as it is issued, so a stream only logs the waits between
    streams, and entering and leaving it (`torch.cuda.stream`), into the replay log."""

    def __init__(self, name: str, log: list[object]) -> None:
        self.name, self.log = name, log
        self.busy = False  # stands in for work still queued on it (`query`)

    def wait_stream(self, other: HostStream) -> None:
        self.log.append(f"{self.name} waits {other.name}")

    def wait_event(self, event: object) -> None:
        self.log.append(f"{self.name} waits {event}")

    def query(self) -> bool:
        """Whether all work issued to it has run."""
        return not self.busy


@pytest.fixture
def prefill_stream(monkeypatch: pytest.MonkeyPatch, replays: list[object]) -> HostStream:
    """The prefill stream, with `torch.cuda.current_stream` and `torch.cuda.stream` stood in for."""
    current = [HostStream("main", replays)]

    @contextlib.contextmanager
    def stream(s: HostStream) -> Iterator[None]:
        current.append(s)
        replays.append(f"on {s.name}")
        try:
            yield
        finally:
            current.pop()
            replays.append(f"off {s.name}")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    return HostStream("prefill", replays)
