"""When the engine thread composes its next step while one runs on the GPU (async steps).

With async steps the engine launches step k+1 before it reads step k's tokens, so the GPU never waits for the
engine thread. Composed as soon as step k starts, step k+1 leaves out every request that arrives while step k
runs, and every request whose adapter finishes loading meanwhile (a cold start, a hot swap's new version):
they wait for step k+2, and their first token comes a whole step later than it could.

`ComposePacer` holds the composition of step k+1 back until step k is about to end, and ends the wait at once
when something arrives (`LLMEngine._wake`: a request, an adapter command, a finished load), so that it joins
step k+1. "About to end": the shortest of the last steps' device times (CUDA events; only steps queued whole
before the device ran dry) after step k started (when the engine thread read step k-1's tokens, having waited
for them), less the longest of the last compositions and a slack. A composition is timed from when it was due
to the launch of its step, so a wake-up that came late (the GIL held by another thread, say) counts in it and
moves the next deadlines earlier. Composing early costs nothing but the wait's purpose; composing late leaves
the GPU idle. A step that ends before the wait does (polled every `poll_s`) is composed at once, and the GPU
then idles for one composition; the time it took, at most, joins the estimates, so they follow steps that got
shorter.

By kind (`by_kind`, opt-in: `EngineConfig.compose_late` "by-kind"): a step that takes in prompts (admissions, a
long prompt's next chunk) composes for longer than one that only decodes. With one window, the longest
composition of the last steps is most often a prompt step's, and it also holds back decode-only steps' deadlines:
a request arriving in that margin before a decode step's end waits a whole step more. By kind, a next step with
no prompt work in sight when the wait begins is held to the longest recent decode-only composition. The cost: a
request that arrives within the margin the longest composition would have kept is composed at once, with its
prompt, and the step in flight may end before that composition does (the GPU idles for the difference).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Protocol


class StepInFlight(Protocol):
    """A launched step, as the pacer sees it (`engine.step_forward.InFlight`)."""

    def done(self) -> bool:
        """Whether the device has finished the step (its tokens can be read without waiting)."""
        ...

    def device_seconds(self) -> float | None:
        """The step's time on the device, once done; None where it was not timed."""
        ...


class Wakeup(Protocol):
    """What wakes the engine thread (`threading.Event`)."""

    def clear(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


def prompts_in_sight() -> bool:
    """`ComposePacer.wait`'s default: the next step may take in prompts (what a pacer not by kind assumes)."""
    return True


class ComposePacer:
    """Decides how long the engine thread waits before composing the next step (see the module docstring).

    `window`: how many recent steps and compositions the estimates look back on. `by_kind`: a next step with no
    prompt work is held to decode-only compositions' times (see the module docstring).
    """

    def __init__(
        self,
        window: int = 16,
        slack_s: float = 0.0005,
        poll_s: float = 0.0005,
        clock: Callable[[], float] = time.perf_counter,
        by_kind: bool = False,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.slack_s, self.poll_s, self.clock, self.by_kind = slack_s, poll_s, clock, by_kind
        self._device_s: collections.deque[float] = collections.deque(maxlen=window)
        # (seconds, whether the step took in prompts)
        self._compose_s: collections.deque[tuple[float, bool]] = collections.deque(maxlen=window)
        self.waits = 0  # compositions held back (tests, benchmarks)
        self.woken = 0  # of which ended by an arrival

    def estimates(self, prompts: bool = True) -> tuple[float, float] | None:
        """The step's and the composition's time the deadlines use, in seconds: the shortest recent step's and
        the longest recent composition's (by kind, for a next step without `prompts`: the longest recent
        decode-only one's, where the window holds any); None until a step and a composition were measured."""
        if not self._device_s or not self._compose_s:
            return None
        decode = self.longest_composition(prompts=False) if self.by_kind and not prompts else None
        return min(self._device_s), max(self.compose_times) if decode is None else decode

    def longest_composition(self, prompts: bool) -> float | None:
        """The longest recent composition of a step that took in `prompts`, or of one that only decoded; None
        where the window holds none of that kind."""
        return max((s for s, took in self._compose_s if took is prompts), default=None)

    def deadline(self, since: float, prompts: bool = True) -> float | None:
        """When to compose the next step, for a step in flight that started on the device at `since` (the
        clock's time), the next step taking in `prompts` or not; None until a step and a composition were
        measured."""
        estimates = self.estimates(prompts)
        if estimates is None:
            return None
        step, composition = estimates
        return since + step - composition - self.slack_s

    def wait(
        self,
        flight: StepInFlight,
        since: float,
        wake: Wakeup,
        arrived: Callable[[], bool],
        started_known: bool = True,
        prompts: Callable[[], bool] = prompts_in_sight,
    ) -> float:
        """Block until the next step should be composed: `flight` is near its end or done, or something
        arrived (`wake` set after this call began, or `arrived()`). Returns when the composition was due: the
        deadline where the wait ran to it (however late this thread woke), else the clock's time at its end.
        `started_known` False: `flight` may have started on the device well before `since` (an eager pass runs
        as it is launched), so its end before the deadline is no step time to learn from. `prompts`: whether the
        next step has prompt work in sight (`Scheduler.prompts_next`), asked only by a pacer `by_kind`, after
        `wake` is cleared: a load that ended before is seen there, or its wake-up ends the wait.

        `wake` is cleared first: an earlier set was for work the caller has already taken in."""
        wake.clear()
        deadline = self.deadline(since, prompts() if self.by_kind else True)
        now = self.clock()
        if deadline is None or now >= deadline:
            return now
        self.waits += 1
        while True:
            if arrived() or wake.is_set():
                self.woken += 1
                return self.clock()
            if flight.done():
                # Ended before the estimate: its time, at most this, joins the estimates. Steps launched after
                # it ran dry are not timed (`ran`), so steps that got shorter would otherwise never be seen.
                now = self.clock()
                if started_known:
                    self._device_s.append(now - since)
                return now
            now = self.clock()
            if now >= deadline:
                return deadline
            wake.wait(min(deadline - now, self.poll_s))

    @property
    def device_times(self) -> tuple[float, ...]:
        """The recent steps' device times the estimates use, in seconds (tests, benchmarks)."""
        return tuple(self._device_s)

    @property
    def compose_times(self) -> tuple[float, ...]:
        """The recent compositions' times, in seconds (benchmarks); by kind, a decode-only step's estimate uses
        only those of decode-only steps where there are any (`longest_composition`)."""
        return tuple(s for s, _ in self._compose_s)

    def composed(self, seconds: float, prompts: bool = True) -> None:
        """Record one composition's time on the engine thread (from when it was due to its step's launch), of a
        step that took in `prompts` or only decoded."""
        self._compose_s.append((seconds, bool(prompts)))

    def ran(self, flight: StepInFlight) -> None:
        """Record a read step's device time, where it was timed."""
        seconds = flight.device_seconds()
        if seconds is not None:
            self._device_s.append(seconds)
