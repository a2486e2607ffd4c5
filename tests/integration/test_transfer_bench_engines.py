"""benchmarks/transfer.py's many-engines case runs end to end with CPU engines (shared memory)
on this machine: every engine moves every chunk in each phase, and the figures and goals are
reported (what they say is for the GPU machine; nothing here checks a speed)."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "transfer.py"


def test_many_cpu_engines_move_every_chunk_in_every_phase(tmp_path):
    out = tmp_path / "many.json"
    run = subprocess.run([sys.executable, str(BENCH), "--only-engines", "--engines", "2", "--engine-device", "cpu",
                          "--engine-shape", "gpt-oss-20b hybrid", "--engine-chunk", "64", "--engine-outstanding", "3",
                          "--engine-bytes", "5e7", "--l1-bytes", "1g", "--iters", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    many = json.loads(out.read_text())["many_engines"]
    assert many["engines"] == 2 and set(many["phases"]) == {"store", "retrieve", "mixed"}
    for name, phase in many["phases"].items():
        assert phase["chunks_done"] == phase["chunks_expected"], (name, phase)
        assert phase["gbps"] > 0 and phase["daemon_cores"] is not None
    assert many["phases"]["mixed"]["chunks_expected"] == {"store": many["chunks_per_engine"],
                                                          "retrieve": many["chunks_per_engine"]}
    assert "2 engine processes (cpu)" in run.stdout and "daemon CPU, cores" in run.stdout
