"""The phase timer behind the first step's and the checkpoint's time lines, on a clock set by hand."""
from __future__ import annotations

import pytest

from megacpp.runtime import phase_timer
from megacpp.runtime.phase_timer import PhaseTimer


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(phase_timer.time, "perf_counter", lambda: now[0])
    return now


def test_tier1_each_mark_takes_the_time_since_the_previous_one_and_a_repeated_phase_adds_up(clock):
    timer = PhaseTimer()
    clock[0] += 2.0
    timer.mark("forward")
    clock[0] += 0.5
    timer.mark("backward")
    clock[0] += 3.0
    timer.mark("forward")  # a second micro-batch's forward
    assert timer.seconds == {"forward": 5.0, "backward": 0.5}
    assert timer.line("first step") == "first step 5.5 s: forward 5.0 s, backward 0.5 s"


def test_tier1_restart_leaves_the_time_since_the_last_mark_out_of_every_phase(clock):
    timer = PhaseTimer()
    clock[0] += 1.0
    timer.mark("gathering the weights")
    clock[0] += 60.0  # between two measured pieces of work
    timer.restart()
    clock[0] += 4.0
    timer.mark("publishing")
    assert timer.seconds == {"gathering the weights": 1.0, "publishing": 4.0}
    assert timer.line("checkpoint step_00000003 written in") == (
        "checkpoint step_00000003 written in 5.0 s: gathering the weights 1.0 s, publishing 4.0 s")
