"""The soak as CI runs it: a minute of randomized load on a real daemon with L2 and L3 (Redis),
every fault kind injected, every retrieved byte checked (`kvdepot soak`, kvdepot/soak/run.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from redis_server import redis_server_binary

SEED = 7  # fixed: CI replays the same faults; this seed's run injects every kind


def test_one_minute_soak_with_every_fault_kind_passes(tmp_path):
    if redis_server_binary() is None:
        if os.environ.get("KVDEPOT_REQUIRE_TOOLS"):
            pytest.fail("redis-server is not installed (.ci/run installs the Debian package)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    out = tmp_path / "soak.json"
    # 1.5 s: a loaded 2-core CI machine; the reclaims measured here take ~0.3 s (goal < 1 s)
    r = subprocess.run([sys.executable, "-m", "kvdepot", "soak", "--duration-s", "60", "--engines", "4",
                        "--seed", str(SEED), "--l3", "--fault-interval-s", "1.5", "--reclaim-limit-s", "1.5",
                        "--workdir", str(tmp_path / "work"), "--json", str(out)],
                       capture_output=True, text=True, timeout=400)
    print(r.stdout)
    report = json.loads(out.read_text())
    assert r.returncode == 0 and report["ok"], (report["failures"], r.stdout, r.stderr[-4000:])
    assert report["corrupt_bytes"] == 0 and report["wrong_hits"] == 0
    faults = report["faults"]
    for kind in ("kill_engine", "kill_daemon", "corrupt_l2", "kill_redis", "shrink_segment", "freeze",
                 "dropped_replies", "delayed_replies", "stalled_copies"):
        assert faults.get(kind, 0) >= 1, (kind, faults)
    assert report["reclaims"] >= 1 and report["reclaim_max_s"] <= 1.5
    assert report["daemon_starts"] == faults["kill_daemon"] + 1
    # the work was real: hits served from every tier, bytes checked, whole caches checked
    assert report["retrieved_chunks"] > 500 and report["stored_chunks"] > 500
    assert report["verified_bytes"] > 100 << 20 and report["cache_checks"] > 20
    assert report["tiers"].get("l2_hit_chunks", 0) > 0 and report["tiers"].get("l3_hit_chunks", 0) > 0
