"""The vLLM connector on CUDA, driven through vLLM 0.33's real Python classes.

Each engine is a process of its own (`vllm_engine_proc.py`): vLLM's ``Scheduler`` with the
connector's scheduler side, KV caches planned by vLLM and allocated on the GPU (vLLM's
``create_kv_cache_views``), the worker-side connector called in the order of vLLM's
``KVConnectorModelRunnerMixin`` (bind metadata, forward, start_load_kv, wait_for_save,
get_transfer_results), and a toy forward that checks every KV byte it attends to against the
KV the toy model defines for that prefix, then writes the scheduled tokens' KV on the current
stream. vLLM's compiled modules are stubbed only where absent (`tests/vllm/vllm_stubs.py`).
Skipped without CUDA or without vLLM's Python files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_daemon import serve

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")]

HERE = Path(__file__).resolve().parent
CHUNK = 64


@pytest.fixture
def daemon(tmp_path):
    yield from serve(tmp_path, "2g", with_process=True)


def engine(tmp_path: Path, endpoint: str, model_id: str, env: dict | None = None, **scenario) -> dict:
    """Run one engine process (``env``: variables set for it); its JSON result."""
    sc = {"endpoint": endpoint, "model_id": model_id, "workdir": str(tmp_path), "layout": "LBNHC",
          "specs": "dense", "prompt": [5, 300], **scenario}
    p = subprocess.run([sys.executable, str(HERE / "vllm_engine_proc.py"), json.dumps(sc)], capture_output=True,
                       text=True, timeout=240, env={**os.environ, **(env or {})})
    assert p.returncode == 0, f"engine process failed (rc {p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("specs,tokens,ring", [("dense", 300, 0), ("hybrid", 300, 0), ("hybrid", 1000, 1 << 20)],
                         ids=["dense", "hybrid", "hybrid-pieces"])
def test_engine_a_stores_engine_b_in_another_process_loads_every_byte(tmp_path, daemon, specs, tokens, ring):
    """A (LBNHC) stores a prompt of ``tokens``; B (another process, LBHNC, other block ids after a
    warm-up request) loads the cached chunks and its forward finds every KV byte as A computed
    it; both sample the same tokens. ``hybrid``: two KV-cache groups (full attention, 16 tokens
    per block; sliding window, 32 tokens per block). ``hybrid-pieces``: a 1000-token prompt
    and a 1 MiB staging ring (21 chunks of 48 KiB, pieces of 5): the step's store goes in three
    pieces (with store pins, vLLM >= 0.33, the transfer thread gathers them; without, the
    engine thread gathers them with one call, `KVDepotClient.stage_store_pieces`)."""
    ep, _ = daemon
    extra = {"staging_bytes": ring} if ring else {}
    name = f"gpu-{specs}-{tokens}"
    a = engine(tmp_path, ep, name, specs=specs, prompt=[5, tokens], extra=extra)
    assert a["computed"] == tokens + 2
    assert a["stats"][0]["stored_chunks"] == tokens // CHUNK and a["stats"][0]["store_failures"] == 0
    b = engine(tmp_path, ep, name, specs=specs, prompt=[5, tokens], layout="LBHNC", warmup=[98, 40], extra=extra)
    assert b["stats"][0]["loaded_chunks"] == tokens // CHUNK
    assert b["computed"] == tokens - tokens // CHUNK * CHUNK + 2
    assert b["outputs"] == a["outputs"]
    print(f"\n{specs}: stubbed compiled vLLM modules: {a['stubbed']}")


@pytest.mark.parametrize("pins", [True, False], ids=["pinned", "ordered"])
def test_sliding_window_blocks_reused_while_stores_run_load_back_bit_exact(tmp_path, daemon, pins):
    """Hybrid model, chunked prefill of 6 prompts through a small block pool: vLLM frees the
    sliding-window group's blocks that leave the window while their request runs and would give
    them to other requests at once. ``pinned``: the scheduler pins the blocks a store reads
    until the workers report its save ended, and the transfer thread gathers when it likes;
    ``ordered`` (as with vLLM < 0.33, no worker-metadata channel): a forward that may write such a block waits for
    the gathers of the stores that read it (`WorkerConnector.bind_connector_metadata`). B then loads every chunk and
    its forward finds every KV byte as A computed it."""
    ep, _ = daemon
    prompts = [[60 + i, 320] for i in range(6)]
    sc = dict(specs="hybrid", prompt=prompts[0], more_prompts=prompts[1:], max_tokens=2, num_blocks=96, budget=128,
              max_model_len=512, without_worker_meta=not pins)
    a = engine(tmp_path, ep, f"gpu-sliding-{pins}", **sc)
    st = a["stats"][0]
    assert st["stored_chunks"] == 6 * (320 // CHUNK) and st["store_failures"] == 0, st
    assert a["stores_pinned"] is pins and a["pinned_blocks_left"] == 0
    if pins:
        assert st["forwards_waiting_for_gathers"] == 0 and st["saves_gathered_by_bind"] == 0, st
    b = engine(tmp_path, ep, f"gpu-sliding-{pins}", layout="LBHNC", warmup=[98, 40], **sc)
    assert b["stats"][0]["loaded_chunks"] == 6 * (320 // CHUNK)
    assert [b["outputs"]] + b["more_outputs"] == [a["outputs"]] + a["more_outputs"]
    print(f"\nsliding window: forwards that waited for gathers {st['forwards_waiting_for_gathers']}, saves gathered "
          f"by bind {st.get('saves_gathered_by_bind')}; A {st}")


def test_tensor_parallel_two_rank_processes_on_one_gpu(tmp_path, daemon):
    """TP=2, rank 1 in a process of its own (pickled SchedulerOutput, as vLLM's multiprocess
    executor), both ranks' KV on the one GPU: A stores both shards, B loads each rank's own."""
    ep, _ = daemon
    a = engine(tmp_path, ep, "gpu-tp2", tp=2, rank_processes=True)
    assert [s["stored_chunks"] for s in a["stats"]] == [4, 4]
    b = engine(tmp_path, ep, "gpu-tp2", tp=2, rank_processes=True, layout="LBHNC", warmup=[98, 40])
    assert [s["loaded_chunks"] for s in b["stats"]] == [4, 4]
    assert b["outputs"] == a["outputs"]
    assert len(set(a["registrations"] + b["registrations"])) == 4


def test_mla_tensor_parallel_two_rank_processes_store_once_and_both_load(tmp_path, daemon):
    """MLA at TP=2, rank 1 in a process of its own: the latent KV is the same on both ranks, so
    rank 0 alone stores it (one copy in the daemon) and B's two ranks both load it bit-exact."""
    ep, _ = daemon
    a = engine(tmp_path, ep, "gpu-mla-tp2", specs="mla", tp=2, rank_processes=True)
    assert [s["stored_chunks"] for s in a["stats"]] == [4, 0]
    assert a["stats"][1]["stores"] == 0
    from kvdepot.client import KVDepotClient

    with KVDepotClient(ep, timeout_s=5) as c:
        info = c.describe()
    l1 = next(t for t in info.tiers if t.name == "l1")
    chunk_bytes = 4 * CHUNK * 576 * 2  # 4 layers of one bf16 latent row per token
    assert l1.num_objects == 4 and 4 * chunk_bytes <= l1.used_bytes < 5 * chunk_bytes, l1
    b = engine(tmp_path, ep, "gpu-mla-tp2", specs="mla", tp=2, rank_processes=True, layout="LBHNC",
               warmup=[98, 40])
    assert [s["loaded_chunks"] for s in b["stats"]] == [4, 4]
    assert [s["load_failures"] for s in b["stats"]] == [0, 0]
    assert b["outputs"] == a["outputs"]


def test_a_step_storing_more_than_the_staging_ring_sends_the_rest_as_the_ring_frees(tmp_path, daemon):
    """A 1 MiB staging ring (2 chunks of 512 KiB) and steps that store 32 chunks each: what
    does not fit waits, and the worker's transfer thread sends it as ring regions free (during
    the next forwards, not at the next step's end); every chunk is stored and loads back
    bit-exact."""
    ep, _ = daemon
    prompts = [[40 + i, 1024] for i in range(6)]
    small = {"staging_bytes": 1 << 20}
    a = engine(tmp_path, ep, "gpu-ring", specs="dense-wide", prompt=prompts[0], more_prompts=prompts[1:],
               extra=small, max_tokens=1)
    st = a["stats"][0]
    assert st["stored_chunks"] == 6 * 1024 // CHUNK and st["store_failures"] == 0
    assert st["pieces_queued"] > 0, st
    b = engine(tmp_path, ep, "gpu-ring", specs="dense-wide", layout="LBHNC", warmup=[98, 40], prompt=prompts[0],
               more_prompts=prompts[1:], extra=small, max_tokens=1)
    assert b["stats"][0]["loaded_chunks"] == 6 * 1024 // CHUNK
    assert [b["outputs"]] + b["more_outputs"] == [a["outputs"]] + a["more_outputs"]
    print(f"\nsmall ring: A {st}\nB {b['stats'][0]}")


def test_daemon_sigkilled_after_the_lookup_means_recompute(tmp_path, daemon):
    """The lookup said "hit", then the daemon is SIGKILLed: B's load fails fast, vLLM recomputes
    the prompt (no hang, and the forward finds no wrong byte), outputs equal A's."""
    ep, proc = daemon
    a = engine(tmp_path, ep, "gpu-kill")
    b = engine(tmp_path, ep, "gpu-kill", layout="LBHNC", warmup=[98, 40], kill_daemon_pid=proc.pid)
    assert proc.wait(10) == -signal.SIGKILL
    assert b["outputs"] == a["outputs"]
    assert b["computed"] == 300 + 2, "everything recomputed"
    assert b["stats"][0]["loaded_chunks"] == 0 and b["stats"][0]["load_failures"] == 1
    assert b["run_s"] < 15
