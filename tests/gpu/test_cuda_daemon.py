"""The daemon's CUDA path end to end with engines in separate processes: real CUDA IPC
handles, real interprocess events, an NHD engine storing and an HND engine retrieving into
other block ids, skipped leading blocks untouched. Skipped cleanly without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HERE = Path(__file__).parent


@pytest.fixture(scope="module", params=["kernels", "kernels-pieces", "torch-fallback"])
def cuda_daemon(request, tmp_path_factory):
    """A daemon with the kernel library (moving whole chunks, or every chunk in pieces of one
    block per group), or one that cannot load it (the torch fallback)."""
    d = tmp_path_factory.mktemp("cuda-daemon")
    ep = f"ipc://{d / 'kvdepot.sock'}"
    log = open(d / "daemon.log", "w")
    env = dict(os.environ)
    piece_bytes = "1" if request.param == "kernels-pieces" else "0"
    if request.param == "torch-fallback":
        env.update(KVDEPOT_KERNELS_SO=str(d / "no-such-library.so"), KVDEPOT_NO_JIT="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvdepot", "serve", "--endpoint", ep, "--l1-bytes", "2g",
                             "--pin-l1", "--copy-piece-bytes", piece_bytes], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    line = proc.stdout.readline()
    assert "ready" in line, (d / "daemon.log").read_text()
    yield ep
    from kvdepot.client import KVDepotClient

    with KVDepotClient(ep) as c:  # the daemon really used the path this run is about
        engine = c.describe().transfer_engine
    assert engine.endswith("cuda-torch" if request.param == "torch-fallback" else "cuda-kernels"), engine
    proc.terminate()
    rc = proc.wait(30)
    proc.stdout.close()
    log.close()
    assert rc == 0, (d / "daemon.log").read_text()
    text = (d / "daemon.log").read_text()
    assert "Traceback" not in text, text


@pytest.fixture
def daemon_kind(request) -> str:
    """The `cuda_daemon` parameter of the running test."""
    return request.node.callspec.params["cuda_daemon"]


def run_engine(tmp_path, *args) -> dict:
    out = tmp_path / f"out-{args[0]}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(HERE / "cuda_engine_proc.py"), *args, "--out", str(out)],
                       capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("staging", ["daemon", "engine"])
@pytest.mark.parametrize("shape,store_layout,retrieve_layout,skip", [
    ("llama8b", "LBNHC", "LBHNC", 0),
    ("llama8b", "LBNHC", "flash_attn_hnd", 32),
    ("llama8b", "BLNHC", "flashinfer", 0),
    ("hybrid", "LBNHC", "LBHNC", 32),
    ("mla", "mla", "mla", 0),
    ("fp8_ds_mla", "mla", "mla", 16),
])
def test_store_nhd_retrieve_hnd_across_processes(cuda_daemon, daemon_kind, tmp_path, shape, store_layout,
                                                 retrieve_layout, skip, staging):
    """``staging="engine"``: the engines gather / scatter on their own streams through their
    staging rings and the daemon only copies over PCIe (a daemon without the kernel library
    refuses the ring, and the engines fall back to the daemon's gathers)."""
    from kvdepot.client import KVDepotClient

    with KVDepotClient(cuda_daemon) as c:  # cases share keys; start each from an empty cache
        c.flush()
    ref = tmp_path / "ref.pt"
    common = ["--endpoint", cuda_daemon, "--shape", shape, "--ref", str(ref), "--chunks", "3", "--staging", staging]
    staged = staging == "engine" and daemon_kind != "torch-fallback"
    s = run_engine(tmp_path, "store", *common, "--layout", store_layout)
    assert s["stored"] + s["present"] == 3 and s["skipped"] == 0, s
    assert s["staged"] == staged, s
    r = run_engine(tmp_path, "retrieve", *common, "--layout", retrieve_layout, "--skip-tokens", str(skip))
    assert r["hit"] == 3 and r["retrieved"] == 3, r
    assert r["staged"] == staged, r
    assert r["mismatched"] == 0, r
    assert r["skipped_untouched"], r


@pytest.mark.parametrize("shape,skip,wait,staging", [("llama8b", 0, "gpu", "daemon"), ("hybrid", 32, "cpu", "daemon"),
                                                     ("llama8b", 0, "gpu", "engine"), ("hybrid", 32, "cpu", "engine")])
def test_early_store_request_is_answered_after_its_copies(cuda_daemon, tmp_path, shape, skip, wait, staging):
    """STORE with ``early=True``: the daemon no longer replies at enqueue with an event to wait
    on (an interprocess event was seen to report a record complete before the work ahead of
    it ran); the reply comes once the chunks are in L1, carries no event, and the engine
    overwrites its blocks right after it: the retrieving engine still gets the bytes from
    before the overwrite."""
    from kvdepot.client import KVDepotClient

    with KVDepotClient(cuda_daemon) as c:
        c.flush()
    ref = tmp_path / "ref.pt"
    common = ["--endpoint", cuda_daemon, "--shape", shape, "--ref", str(ref), "--chunks", "3", "--staging", staging]
    cpu = ["--cpu-wait"] if wait == "cpu" else []
    s = run_engine(tmp_path, "store", *common, "--layout", "LBNHC", "--early", *cpu)
    assert s["stored"] == 3 and not s["early_event"] and not s["stored_event"], s
    r = run_engine(tmp_path, "retrieve", *common, "--layout", "LBHNC", "--skip-tokens", str(skip), *cpu)
    assert r["hit"] == 3 and r["retrieved"] == 3, r
    assert r["mismatched"] == 0, r
