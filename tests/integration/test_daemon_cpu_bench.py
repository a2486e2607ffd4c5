"""benchmarks/daemon_cpu.py (the daemon's CPU time per request, no GPU) still runs end to end:
a short run of both shapes, with its own sanity checks (every store stored, every retrieve of
a cached chunk retrieved it, the lookups hit). No timing is checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_daemon_cpu_benchmark_runs_and_its_requests_do_what_they_say(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("daemon_cpu", None)
    import daemon_cpu

    out = tmp_path / "r.json"
    assert daemon_cpu.main(["--requests", "300", "--l1-objects", "40", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == set(daemon_cpu.SHAPES)
    for r in doc["results"].values():
        assert r["store_us"] > 0 and r["retrieve_us"] > 0 and r["lookup_us"] > 0
        assert r["evictions"] > 0  # L1 (40 objects) is smaller than a pass (300 chunks): stores evicted
        assert r["lookup_hit_chunks"] == 16
