"""A GPU engine's interpreter settings: set while it serves, undone when it stops."""

from __future__ import annotations

import gc
import sys

import pytest

from engine import interpreter


def test_settle_sets_the_switch_interval_and_freezes_live_objects_until_restored() -> None:
    before = sys.getswitchinterval()
    survivor = [object() for _ in range(10)]
    try:
        interpreter.settle_for_serving(0.2)
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        assert gc.get_freeze_count() >= len(survivor)  # start-up objects leave the collected generations
    finally:
        interpreter.restore()
    assert sys.getswitchinterval() == before
    assert gc.get_freeze_count() == 0


def test_zero_keeps_the_switch_interval() -> None:
    before = sys.getswitchinterval()
    try:
        interpreter.settle_for_serving(0)
        assert sys.getswitchinterval() == before
    finally:
        interpreter.restore()


def test_settings_stay_until_the_last_serving_engine_restores_them() -> None:
    before = sys.getswitchinterval()
    try:
        interpreter.settle_for_serving(0.2)  # a first engine
        interpreter.settle_for_serving(0.2)  # a second one, in the same process
        interpreter.restore()  # the second stops: the first still serves
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        assert gc.get_freeze_count() > 0
    finally:
        interpreter.restore()
    assert sys.getswitchinterval() == before
    assert gc.get_freeze_count() == 0
