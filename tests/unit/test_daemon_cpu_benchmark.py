"""benchmarks/daemon_cpu.py still drives the daemon as it is (a smoke run; no timing is checked)."""

import importlib.util
from pathlib import Path

import torch

from kvdepot.client.kvcache import KVGroupShape

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "daemon_cpu.py"


def test_every_store_stores_every_cached_chunk_retrieves_and_the_lookup_hits(tmp_path):
    spec = importlib.util.spec_from_file_location("daemon_cpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    group = KVGroupShape(0, 2, 1, 64, 16, torch.bfloat16)
    ob = 2 * 1 * 2 * 64 * 2 * 64
    r = bench.measure(group, 64, requests=60, l1_bytes=20 * ob, sock_dir=str(tmp_path))
    assert r["object_bytes"] == ob and r["l1_objects"] == 20
    assert r["evictions"] >= 3 * (60 - 20)  # L1 full: each pass evicts on every store beyond 20
    assert r["lookup_hit_chunks"] == 16
    assert r["store_us"] > 0 and r["retrieve_us"] > 0 and r["lookup_us"] > 0
