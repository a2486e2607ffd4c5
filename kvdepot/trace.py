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

# rids below 0 mark what a thread does, not a request: -1 the daemon's loop got a frame, -3 its
# call into the kernel library, and these two
TRANSFER_THREAD = -20  # the vLLM worker's transfer thread: "t_wait" (waits for work), "t_run"
ENGINE_THREAD = -21  # an engine's own thread, where a benchmark marks it (e.g. "e_gpu_wait", "e_gpu_done")


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
