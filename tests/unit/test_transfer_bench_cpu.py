"""``benchmarks/transfer.py``'s CPU meter (`transfer_bench.point.CpuMeter`): per phase, the
engine process's and the daemon's CPU seconds over each run's wall seconds, median over runs,
and the report's line of them. The clocks are scripted: what is checked is the bookkeeping."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def point(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    from transfer_bench import point as mod

    return mod


def test_cores_per_phase_are_medians_of_cpu_over_wall_for_engine_and_daemon(point, monkeypatch):
    own = iter([0.0, 0.9, 1.0, 2.0, 2.0, 2.4, 3.0, 3.5])  # process_time() before / after each run
    daemon = iter([10.0, 10.5, 11.0, 11.2, 20.0, 21.0, 30.0, 31.0])
    monkeypatch.setattr(point.time, "process_time", lambda: next(own))
    monkeypatch.setattr(point, "process_cpu_s", lambda pid: next(daemon))
    monkeypatch.setattr(point, "run_parallel", lambda tasks: 1.0)  # every run: 1 s of wall time
    meter = point.CpuMeter(daemon_pid=1234)
    for phase in ("store", "store", "both", "both"):
        assert meter.run(phase, []) == 1.0
    cores = meter.cores()
    assert cores["store"] == {"engine": pytest.approx(0.95), "daemon": pytest.approx(0.35)}
    assert cores["both"] == {"engine": pytest.approx(0.45), "daemon": pytest.approx(1.0)}

    from transfer_bench.report import _cores

    assert _cores(cores) == "; CPU cores engine/daemon: store 0.95/0.35, both 0.45/1.00"


def test_without_a_daemon_started_here_only_the_engine_is_metered(point, monkeypatch):
    own = iter([0.0, 0.5])
    monkeypatch.setattr(point.time, "process_time", lambda: next(own))
    monkeypatch.setattr(point, "run_parallel", lambda tasks: 2.0)

    def no_daemon(pid):
        raise AssertionError("no daemon pid: /proc must not be read")

    monkeypatch.setattr(point, "process_cpu_s", no_daemon)
    meter = point.CpuMeter(daemon_pid=None)
    meter.run("retrieve", [])
    assert meter.cores() == {"retrieve": {"engine": 0.25, "daemon": None}}
    from transfer_bench.report import _cores

    assert _cores(meter.cores()) == "; CPU cores engine/daemon: retrieve 0.25/n/a"
