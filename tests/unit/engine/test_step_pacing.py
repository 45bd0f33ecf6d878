"""The compose pacer on a fake clock: when it ends the wait for the next step's composition."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine.step_pacing import ComposePacer


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Wake:
    """A `threading.Event` whose waits move the fake clock on, and which may be set at a given time."""

    clock: Clock
    set_at: float | None = None
    flag: bool = False
    oversleep: float = 0.0  # how much later than asked each wait returns (the GIL held elsewhere)
    waited: list[float] = field(default_factory=list)

    def clear(self) -> None:
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None and timeout > 0
        self.waited.append(timeout)
        until = self.clock.now + timeout
        if self.set_at is not None and self.set_at <= until:
            self.clock.now = max(self.clock.now, self.set_at)
            self.flag = True
        else:
            self.clock.now = until + self.oversleep
        return self.flag


@dataclass
class Flight:
    clock: Clock
    ends_at: float = float("inf")
    seconds: float | None = None

    def done(self) -> bool:
        return self.clock.now >= self.ends_at

    def device_seconds(self) -> float | None:
        return self.seconds


def measured(clock: Clock, device: list[float], compose: list[float], **kwargs: float) -> ComposePacer:
    pacer = ComposePacer(clock=clock, **kwargs)
    for seconds in device:
        pacer.ran(Flight(clock, seconds=seconds))
    for seconds in compose:
        pacer.composed(seconds)
    return pacer


def nothing_arrived() -> bool:
    return False


def test_no_wait_before_a_step_and_a_composition_were_measured() -> None:
    clock = Clock()
    for pacer in (
        ComposePacer(clock=clock),
        measured(clock, [0.010], []),
        measured(clock, [], [0.001]),
    ):
        wake = Wake(clock)
        assert pacer.wait(Flight(clock), clock.now, wake, nothing_arrived) == 100.0
        assert wake.waited == [] and pacer.waits == 0


def test_composes_the_shortest_step_less_the_longest_composition_and_the_slack_after_the_start() -> None:
    clock = Clock()
    pacer = measured(clock, [0.012, 0.010, 0.011], [0.001, 0.003, 0.002], slack_s=0.0005, poll_s=0.002)
    assert pacer.deadline(100.0) == pytest.approx(100.0065)
    clock.now = 100.001  # the step started a millisecond ago
    wake = Wake(clock)
    assert pacer.wait(Flight(clock), 100.0, wake, nothing_arrived) == pytest.approx(100.0065)
    assert wake.waited == pytest.approx([0.002, 0.002, 0.0015])  # polls of the flight, the last up to the deadline
    assert (pacer.waits, pacer.woken) == (1, 0)


def test_a_step_already_past_the_deadline_composes_at_once() -> None:
    clock = Clock(now=100.02)
    pacer = measured(clock, [0.010], [0.001])
    wake = Wake(clock)
    assert pacer.wait(Flight(clock), 100.0, wake, nothing_arrived) == 100.02
    assert wake.waited == [] and pacer.waits == 0


def test_an_arrival_ends_the_wait() -> None:
    clock = Clock()
    pacer = measured(clock, [0.010], [0.001], poll_s=0.001)
    wake = Wake(clock, set_at=100.0025)  # a request or a finished load wakes the engine
    assert pacer.wait(Flight(clock), 100.0, wake, nothing_arrived) == pytest.approx(100.0025)
    assert (pacer.waits, pacer.woken) == (1, 1)


def test_queued_work_ends_the_wait_without_a_wake() -> None:
    clock = Clock()
    pacer = measured(clock, [0.010], [0.001], poll_s=0.001)
    checks = []

    def arrived() -> bool:  # a command queued before the wake was cleared: its set was cleared with it
        checks.append(clock.now)
        return len(checks) > 2

    assert pacer.wait(Flight(clock), 100.0, Wake(clock), arrived) == pytest.approx(100.002)
    assert pacer.woken == 1


def test_an_earlier_wake_does_not_end_the_wait() -> None:
    clock = Clock()
    pacer = measured(clock, [0.010], [0.001], slack_s=0.0)
    wake = Wake(clock, flag=True)  # set for work the engine thread already took in
    assert pacer.wait(Flight(clock), 100.0, wake, nothing_arrived) == pytest.approx(100.009)
    assert pacer.woken == 0


def test_a_step_that_ends_early_ends_the_wait() -> None:
    clock = Clock()
    pacer = measured(clock, [0.010], [0.001], poll_s=0.001)
    assert pacer.wait(Flight(clock, ends_at=100.003), 100.0, Wake(clock), nothing_arrived) == pytest.approx(100.003)
    assert pacer.woken == 0


def test_untimed_steps_are_not_measured_and_the_window_forgets() -> None:
    clock = Clock()
    pacer = measured(clock, [0.002], [0.001], window=2, slack_s=0.0)
    pacer.ran(Flight(clock, seconds=None))
    assert pacer.deadline(0.0) == pytest.approx(0.001)
    for seconds in (0.010, 0.011):  # the 2 ms step leaves the window
        pacer.ran(Flight(clock, seconds=seconds))
    assert pacer.deadline(0.0) == pytest.approx(0.009)
    with pytest.raises(ValueError, match="window must be positive"):
        ComposePacer(window=0)


def test_a_late_wake_up_returns_when_the_composition_was_due() -> None:
    clock = Clock()
    pacer = measured(clock, [0.010], [0.001], slack_s=0.0, poll_s=0.020)
    wake = Wake(clock, oversleep=0.004)
    assert pacer.wait(Flight(clock), 100.0, wake, nothing_arrived) == pytest.approx(100.009)  # due then
    assert clock.now == pytest.approx(100.013)  # though the thread woke 4 ms later
    pacer.composed(clock.now + 0.001 - 100.009)  # so the composition counts the late wake-up
    assert pacer.deadline(200.0) == pytest.approx(200.005)


def test_steps_that_got_shorter_move_the_estimate() -> None:
    """Steps launched after the device ran dry are not timed; a step seen done before the deadline is, at most."""
    clock = Clock()
    pacer = measured(clock, [0.010] * 16, [0.001], slack_s=0.0, poll_s=0.001)
    assert pacer.wait(Flight(clock, ends_at=100.005), 100.0, Wake(clock), nothing_arrived) == pytest.approx(100.005)
    assert min(pacer.device_times) == pytest.approx(0.005)
    assert pacer.deadline(200.0) == pytest.approx(200.004)


def test_a_step_whose_start_is_unknown_ends_the_wait_early_unmeasured() -> None:
    """An eager pass runs on the device as it is launched, before the start the engine notes: its early end
    is no step time (it would be far shorter than any, and the next deadlines would fall at their start)."""
    clock = Clock()
    pacer = measured(clock, [0.010], [0.001], poll_s=0.001)
    flight = Flight(clock, ends_at=100.002)
    assert pacer.wait(flight, 100.0, Wake(clock), nothing_arrived, started_known=False) == pytest.approx(100.002)
    assert pacer.device_times == (0.010,)


def by_kind(clock: Clock, **kwargs: float) -> ComposePacer:
    """A pacer by kind that saw a 10 ms step, a prompt step's 4 ms composition and a decode step's 1 ms."""
    pacer = ComposePacer(clock=clock, by_kind=True, slack_s=0.0, **kwargs)
    pacer.ran(Flight(clock, seconds=0.010))
    pacer.composed(0.004, prompts=True)
    pacer.composed(0.001, prompts=False)
    return pacer


def test_by_kind_a_next_step_without_prompts_is_held_to_decode_compositions() -> None:
    clock = Clock()
    pacer = by_kind(clock)
    assert pacer.deadline(100.0, prompts=False) == pytest.approx(100.009)
    assert pacer.deadline(100.0, prompts=True) == pytest.approx(100.006)  # the longest of either kind
    assert pacer.estimates(prompts=False) == pytest.approx((0.010, 0.001))
    decode_only = nothing_arrived  # (no prompt work in sight)
    assert pacer.wait(Flight(clock), 100.0, Wake(clock), nothing_arrived, prompts=decode_only) == pytest.approx(100.009)
    asked = []

    def prompts() -> bool:
        asked.append(clock.now)
        return True

    assert pacer.wait(Flight(clock), 200.0, Wake(clock), nothing_arrived, prompts=prompts) == pytest.approx(200.006)
    assert asked == [pytest.approx(100.009)]  # once, as the wait began


def test_a_pacer_not_by_kind_never_asks_for_the_next_steps_kind() -> None:
    clock = Clock()
    pacer = measured(clock, [0.010], [0.001])

    def prompts() -> bool:
        raise AssertionError("asked")

    assert pacer.wait(Flight(clock, ends_at=100.002), 100.0, Wake(clock), nothing_arrived, prompts=prompts) > 100.0


def test_one_window_holds_every_step_to_the_longest_composition() -> None:
    clock = Clock()
    pacer = measured(clock, [0.010], [], slack_s=0.0)
    pacer.composed(0.004, prompts=True)
    pacer.composed(0.001, prompts=False)
    assert pacer.deadline(100.0, prompts=False) == pacer.deadline(100.0, prompts=True) == pytest.approx(100.006)
    assert pacer.compose_times == (0.004, 0.001)


def test_by_kind_without_a_decode_composition_in_the_window_takes_the_longest() -> None:
    clock = Clock()
    pacer = by_kind(clock, window=2)
    for _ in range(2):  # the decode step's 1 ms leaves the window, then the 4 ms prompt step's
        pacer.composed(0.003, prompts=True)
    assert pacer.deadline(100.0, prompts=False) == pytest.approx(100.007)
