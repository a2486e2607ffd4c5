"""benchmarks/daemon_loop.py (the daemon's event-loop CPU per request over its stream socket,
copies stubbed, no GPU) still runs end to end against the daemon as it is: every store stores
its chunk and every retrieve finds its chunk (the benchmark raises otherwise), in all three
phases. No timing is checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_daemon_loop_benchmark_answers_every_request_in_every_phase(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("daemon_loop", None)
    import daemon_loop

    out = tmp_path / "r.json"
    assert daemon_loop.main(["--requests", "300", "--depth", "4", "--repeat", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    assert r["object_bytes"] == 80 * 1 * 2 * 128 * 2 * 64  # 70B TP8, 64 tokens
    assert set(r["phases"]) == {"store", "retrieve", "both"}
    for ph in r["phases"].values():
        assert len(ph["runs"]) == 2
        assert ph["loop_us_per_request"] == min(x["loop_us_per_request"] for x in ph["runs"]) > 0
        assert ph["requests_per_s"] > 0
