"""Opt-in latency trace: ``KVDEPOT_TRACE_FILE=path`` records ``(rid, stage, perf_counter_ns)``
at named points of each request, written as JSON lines by `dump` (the daemon calls it at
shutdown). ``perf_counter_ns`` is CLOCK_MONOTONIC, so engine-side timestamps of the same host
line up. Off by default; a disabled point costs one global lookup."""

from __future__ import annotations

import json
import os
import time

FILE = os.environ.get("KVDEPOT_TRACE_FILE")
POINTS: list | None = [] if FILE else None


def point(rid: int, stage: str) -> None:
    if POINTS is not None:
        POINTS.append((rid, stage, time.perf_counter_ns()))


def now_ns() -> int:
    """``perf_counter_ns()`` while tracing (for a point whose rid is known only later), else 0."""
    return time.perf_counter_ns() if POINTS is not None else 0


def point_at(rid: int, stage: str, t_ns: int) -> None:
    """A point taken earlier (``t_ns`` from `now_ns`; 0: tracing was off, nothing recorded)."""
    if POINTS is not None and t_ns:
        POINTS.append((rid, stage, t_ns))


def dump() -> None:
    if POINTS is not None and FILE:
        with open(FILE, "w") as f:
            for row in POINTS:
                f.write(json.dumps(row) + "\n")
