"""One vLLM engine in a process of its own, for the GPU connector tests: vLLM 0.33's real
scheduler and worker-side connector classes (`tests/vllm/vllm_harness.py`) around the toy model,
KV caches on CUDA.

    python vllm_engine_proc.py '<json scenario>'

Scenario keys: ``device`` (default cuda), ``endpoint``, ``model_id``, ``workdir``, ``layout`` (LBNHC / LBHNC), ``specs``
(dense / dense-wide / hybrid / mla), ``tp``, ``rank_processes``, ``warmup`` ([seed, tokens]: a request run first so
that the prompt gets other block ids), ``prompt`` ([seed, tokens]), ``max_tokens``,
``more_prompts`` (more [seed, tokens] added with it), ``extra`` (connector settings),
``kill_daemon_pid`` (SIGKILL that pid once the scheduler's lookup was answered, then run on),
``num_blocks`` (KV-cache blocks per group), ``budget`` (max_num_batched_tokens: chunked prefill),
``max_model_len``, ``without_worker_meta`` (the connector sees no worker-metadata channel, as
with vLLM before 0.33: sliding-window stores are not pinned, forwards wait for their gathers).
Prints one JSON line: ``outputs``, ``computed`` (tokens the toy forward computed), per-rank
``stats``, ``run_s``, ``stubbed`` (compiled vLLM modules that were absent), ``stores_pinned`` (the
scheduler pins sliding-window stores' blocks), ``pinned_blocks_left`` (pins not dropped at the end).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))

import vllm_harness as H  # noqa: E402
import vllm_stubs  # noqa: E402


def main(sc: dict) -> dict:
    if sc.get("without_worker_meta"):
        from kvdepot.client.vllm import scheduler

        scheduler.KVConnectorWorkerMetadata = None
    specs = {"hybrid": lambda: H.hybrid_specs(sliding_window=16),
             "dense-wide": lambda: H.dense_specs(heads=8, head_size=64),  # 512 KiB per 64-token chunk
             "mla": lambda: H.mla_specs(latent=576),  # DeepSeek-V3's latent width, whole on every rank
             "dense": H.dense_specs}[sc.get("specs", "dense")]()
    model = H.model_dir(Path(sc["workdir"]))
    budget = {"max_num_batched_tokens": sc["budget"]} if sc.get("budget") else {}
    if sc.get("max_model_len"):
        budget["max_model_len"] = sc["max_model_len"]
    cfg = H.make_vllm_config(model, sc["endpoint"], chunk_size=sc.get("chunk_size", 64), layout=sc["layout"],
                             device=sc.get("device", "cuda"), **budget,
                             extra={"model_id": sc["model_id"], "rpc_timeout_s": 2.0, **sc.get("extra", {})})
    eng = H.Engine(cfg, specs, tp=sc.get("tp", 1), rank_processes=sc.get("rank_processes", False),
                   **({"num_blocks": sc["num_blocks"]} if sc.get("num_blocks") else {}))
    try:
        if sc.get("warmup"):
            eng.add(H.tokens(*sc["warmup"]), max_tokens=1)
            eng.run()
        rid = eng.add(H.tokens(*sc["prompt"]), max_tokens=sc.get("max_tokens", 3))
        more = [eng.add(H.tokens(*p), max_tokens=sc.get("max_tokens", 3)) for p in sc.get("more_prompts", [])]
        if sc.get("kill_daemon_pid"):
            st = eng.sched_conn._reqs[rid]
            deadline = time.monotonic() + 10
            while not st.answered:
                eng.sched_conn.client.poll(0.01)
                assert time.monotonic() < deadline, "no lookup answer"
            os.kill(sc["kill_daemon_pid"], signal.SIGKILL)
        t0 = time.monotonic()
        eng.run(timeout_s=60)
        run = eng.runs[rid]
        return {"outputs": run.outputs, "computed": run.computed, "run_s": time.monotonic() - t0,
                "more_outputs": [eng.runs[r].outputs for r in more], "more_computed": [eng.runs[r].computed for r in more],
                "stats": [eng.worker_stats(r) for r in range(eng.tp)], "stubbed": vllm_stubs.STUBBED,
                "registrations": [eng.registration_id(r) for r in range(eng.tp)],
                "stores_pinned": eng.sched_conn._pins is not None,
                "pinned_blocks_left": eng.sched_conn.pinned_blocks}
    finally:
        eng.close()


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
