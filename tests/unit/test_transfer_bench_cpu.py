"""``benchmarks/transfer.py``'s CPU meter (`transfer_bench.point.CpuMeter`): per phase, the
engine process's and the daemon's CPU seconds over each run's wall seconds, median over runs,
and the report's line of them. The clocks are scripted: what is checked is the bookkeeping."""

from __future__ import annotations

import os
import threading
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
    threads = iter([0.5, 0.25, 0.25, 0.25])  # each run's one client thread's CPU seconds

    def run_parallel(tasks, thread_cpu_s):  # every run: 1 s of wall time
        thread_cpu_s.append(next(threads))
        return 1.0

    monkeypatch.setattr(point, "run_parallel", run_parallel)
    # the daemon's threads before / after each run: its loop (tid = pid), the issuer, a thread
    # that ends during the run (left out) and one that starts during it (left out)
    snaps = iter([
        {1234: ("main", 1.0), 7: ("kvd-issue", 0.0), 8: ("gone", 0.0)},
        {1234: ("main", 1.4), 7: ("kvd-issue", 0.1), 9: ("new", 5.0)},
        {1234: ("main", 2.0), 7: ("kvd-issue", 0.2)}, {1234: ("main", 2.2), 7: ("kvd-issue", 0.3)},
        {1234: ("main", 3.0), 7: ("kvd-issue", 0.4)}, {1234: ("main", 3.9), 7: ("kvd-issue", 0.5)},
        {1234: ("main", 4.0), 7: ("kvd-issue", 0.6)}, {1234: ("main", 4.7), 7: ("kvd-issue", 0.9)},
    ])
    monkeypatch.setattr(point, "thread_cpu_s", lambda pid: next(snaps))
    meter = point.CpuMeter(daemon_pid=1234)
    for phase in ("store", "store", "both", "both"):
        assert meter.run(phase, []) == 1.0
    cores = meter.cores()
    assert cores["store"] == {"engine": pytest.approx(0.95), "daemon": pytest.approx(0.35),
                              "engine_thread_max": pytest.approx(0.375),
                              "daemon_threads": {"kvd-issue": pytest.approx(0.1), "main": pytest.approx(0.3)}}
    assert cores["both"]["daemon"] == pytest.approx(1.0)
    assert cores["both"]["daemon_threads"] == {"kvd-issue": pytest.approx(0.2), "main": pytest.approx(0.8)}

    from transfer_bench.report import _cores

    assert _cores(cores) == ("; CPU cores engine/daemon: store 0.95/0.35 (threads: engine max 0.38; daemon main "
                             "0.30, kvd-issue 0.10), both 0.45/1.00 (threads: engine max 0.25; daemon main 0.80, "
                             "kvd-issue 0.20)")


def test_thread_cpu_reads_this_process_threads_by_name(point):
    from transfer_bench.procs import busy_threads, thread_cpu_s

    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        snap = thread_cpu_s(os.getpid())
    finally:
        stop.set()
        t.join()
    assert snap[os.getpid()][0] == "main"
    assert len(snap) >= 2 and all(cpu >= 0 for _, cpu in snap.values())
    assert busy_threads({1: ("main", 1.0)}, {1: ("main", 1.5), 2: ("x", 9.0)}, 2.0) == {"main": 0.25}


def test_without_a_daemon_started_here_only_the_engine_is_metered(point, monkeypatch):
    own = iter([0.0, 0.5])
    monkeypatch.setattr(point.time, "process_time", lambda: next(own))
    monkeypatch.setattr(point, "run_parallel", lambda tasks, thread_cpu_s: 2.0)

    def no_daemon(pid):
        raise AssertionError("no daemon pid: /proc must not be read")

    monkeypatch.setattr(point, "process_cpu_s", no_daemon)
    monkeypatch.setattr(point, "thread_cpu_s", no_daemon)
    meter = point.CpuMeter(daemon_pid=None)
    meter.run("retrieve", [])
    assert meter.cores() == {"retrieve": {"engine": 0.25, "daemon": None, "engine_thread_max": 0.0,
                                          "daemon_threads": {}}}
    from transfer_bench.report import _cores

    assert _cores(meter.cores()) == "; CPU cores engine/daemon: retrieve 0.25/n/a (threads: engine max 0.00)"
