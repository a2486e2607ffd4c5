"""The connector benchmark's `CallTimer` (benchmarks/connector_bench/timers.py) takes off each call's
figure only the part of its own cost that lies inside the timed window: a call that spends a
known time reads at least that time, with or without the thread-CPU clock around it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from connector_bench.timers import CallTimer  # noqa: E402

SPIN_S = 20e-6


class Spinner:
    def spin(self) -> None:
        end = time.perf_counter() + SPIN_S
        while time.perf_counter() < end:
            pass


@pytest.fixture(params=[True, False], ids=["cpu-clock", "no-cpu-clock"])
def timer_kind(request, monkeypatch):
    monkeypatch.setattr(CallTimer, "cpu_clock", request.param)
    monkeypatch.setattr(CallTimer, "_overhead_s", None)
    monkeypatch.setattr(CallTimer, "_wrapper_s", None)
    return request.param


def test_a_call_reads_at_least_the_time_it_spent(timer_kind):
    s = Spinner()
    t = CallTimer(s, ["spin"])
    for _ in range(50):
        s.spin()
    assert t.calls["spin"] == 50
    spent = t.take()["spin"]
    # the wrapper's cost outside its window (the thread-CPU clock, the bookkeeping) is not
    # taken off: only what falls inside it, which is less than a call's own cost
    assert spent >= 50 * SPIN_S
    assert 0.0 <= CallTimer.overhead_s() <= CallTimer.wrapper_s()
    cpu = t.cpu_s["spin"]
    assert 0.0 < cpu <= spent
    if not timer_kind:
        assert cpu == spent  # no CPU clock: the wall figure
    assert t.calls == {} and t.take() == {}
