"""One daemon serving several GPUs of a node: engine processes that each see only their own GPU
(``CUDA_VISIBLE_DEVICES``, as a Kubernetes pod or a tensor-parallel rank is given one) store at
the same time, then each loads what the other stored: every byte equal. The daemon sees every
GPU and matches each engine's by its UUID (`kvdepot.protocol.messages.StorageSpec.device_uuid`).
Skipped on a machine with fewer than two GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two GPUs")

HERE = Path(__file__).resolve().parent


@pytest.fixture
def daemon(tmp_path):
    ep = f"ipc://{tmp_path / 'kvdepot.sock'}"
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvdepot", "serve", "--endpoint", ep, "--l1-bytes", "2g",
                             "--pin-l1"], stdout=subprocess.PIPE, stderr=log, text=True)
    assert "ready" in proc.stdout.readline(), (tmp_path / "daemon.log").read_text()
    yield ep
    proc.terminate()
    assert proc.wait(30) == 0, (tmp_path / "daemon.log").read_text()
    proc.stdout.close()
    log.close()
    assert "Traceback" not in (tmp_path / "daemon.log").read_text()


def _engines(tmp_path, runs: list[tuple[int, list[str]]]) -> list[dict]:
    """Start one engine process per (gpu, args) at once, each seeing only that GPU; their results."""
    procs = []
    for i, (gpu, args) in enumerate(runs):
        out = tmp_path / f"out-{args[0]}-{i}.json"
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu),
                   PYTHONPATH=os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
        procs.append((out, subprocess.Popen([sys.executable, str(HERE / "cuda_engine_proc.py"), *args, "--out", str(out)],
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)))
    results = []
    for out, p in procs:
        text, _ = p.communicate(timeout=180)
        assert p.returncode == 0, text
        results.append(json.loads(out.read_text()))
    return results


@pytest.mark.parametrize("staging", ["engine", "daemon"])
def test_engines_on_two_gpus_store_at_once_and_load_each_others_chunks_bit_exact(daemon, tmp_path, staging):
    chunks = 6
    common = ["--endpoint", daemon, "--shape", "llama8b", "--chunks", str(chunks), "--staging", staging]
    refs = [str(tmp_path / f"ref-{g}.pt") for g in (0, 1)]
    stored = _engines(tmp_path, [(g, ["store", *common, "--layout", "LBNHC", "--seed", str(g + 1), "--ref", refs[g]])
                                 for g in (0, 1)])
    assert [s["stored"] for s in stored] == [chunks, chunks]
    assert all(s["staged"] == (staging == "engine") for s in stored)
    # GPU 0 loads what GPU 1 stored and the other way round, both at once, into an HND cache
    loaded = _engines(tmp_path, [(g, ["retrieve", *common, "--layout", "LBHNC", "--seed", str(2 - g),
                                      "--ref", refs[1 - g]]) for g in (0, 1)])
    for r in loaded:
        assert r["hit"] == r["retrieved"] == chunks
        assert r["mismatched"] == 0 and r["compared"] > 0
