"""The scheduler-side connector's time per decode step against vLLM's own scheduler (no GPU).

Runs vLLM 0.33's real scheduler with the kvdepot connector on the CPU test harness
(`tests/vllm/vllm_harness.py`, a daemon of its own), lets N requests finish their prefill
(their prompt chunks stored), then times, hot and in a loop, the connector's
``build_connector_meta`` on a decode step of all N against vLLM's ``Scheduler.schedule`` of the
same requests (the reference: the connector's cost as a fraction of the scheduler's own); and
its time on a prefill step that stores 16 chunks (4 requests of 4096 tokens, 4 chunks each).

    python benchmarks/scheduler_step.py [--requests 8,64,256] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

from connector_bench import harness
from transfer_bench.procs import DaemonProc

H = harness()


def _daemon() -> DaemonProc:
    d = DaemonProc("256m", [], None, pin=False)
    d.wait_ready()
    return d


def _median_us(fn, calls: int) -> float:
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return 1e6 * ts[len(ts) // 2]


def measure(n: int, root: pathlib.Path, calls: int) -> dict:
    d = _daemon()
    cfg = H.make_vllm_config(H.model_dir(root), d.endpoint, chunk_size=64, max_model_len=1024,
                             extra={"model_id": f"step-{n}"}, max_num_seqs=n, max_num_batched_tokens=max(2048, 80 * n))
    e = H.Engine(cfg, H.dense_specs(num_layers=1), num_blocks=8 * n + 64)
    try:
        for i in range(n):
            e.add(H.tokens(i, 70), max_tokens=400)
        so = None
        for _ in range(40):
            so = e.step()
        assert len(so.num_scheduled_tokens) == n and so.total_num_scheduled_tokens == n, "not a decode step of all"
        conn = e.sched_conn
        connector_us = _median_us(lambda: conn.build_connector_meta(so), calls)
        # vLLM's scheduler on the same requests (schedule() alone: no output is fed back, so each
        # call schedules the same decode step again)
        schedule_us = _median_us(e.scheduler.schedule, calls)
        return {"requests": n, "build_connector_meta_us": connector_us, "vllm_schedule_us": schedule_us,
                "ratio": connector_us / schedule_us}
    finally:
        e.close()
        d.stop()


def measure_store(n: int, root: pathlib.Path, calls: int, prompt_tokens: int = 4096, step_tokens: int = 1024) -> dict:
    """A prefill step of ``n`` requests of ``prompt_tokens`` tokens (256-token chunks,
    ``step_tokens`` per request per step: 1024, chunked prefill, taken half-way, when the
    requests are vLLM's "cached" ones; or ``prompt_tokens``, the whole prompt in the step of a
    new request, as in `benchmarks/vllm_connector.py`): ``build_connector_meta`` with each
    request's store job, its state put back before each call (outside the timer)."""
    d = _daemon()
    cfg = H.make_vllm_config(H.model_dir(root), d.endpoint, chunk_size=256, max_model_len=prompt_tokens + 64,
                             extra={"model_id": f"store-{n}"}, max_num_seqs=n,
                             max_num_batched_tokens=step_tokens * n)
    if step_tokens < prompt_tokens:
        cfg.scheduler_config.long_prefill_token_threshold = step_tokens  # chunked prefill
    e = H.Engine(cfg, H.dense_specs(num_layers=1), num_blocks=n * (prompt_tokens // 16 + 4) + 64)
    per_step = step_tokens // 256
    try:
        for i in range(n):
            e.add(H.tokens(1000 + i, prompt_tokens), max_tokens=2)  # still running after the step
        half, storing = max(1, prompt_tokens // step_tokens // 2), 0
        deadline = time.monotonic() + 60
        while storing < half and time.monotonic() < deadline:  # the first steps wait for lookups
            so = e.step()
            storing += bool(so.kv_connector_metadata.stores)
            time.sleep(0.001)
        jobs = so.kv_connector_metadata.stores
        assert len(jobs) == n and all(len(j.chain) == per_step for j in jobs), "not the step wanted"
        side = e.sched_conn
        firsts = {j.req_id: j.first_chunk for j in jobs}
        computed = {}
        for rid in firsts:  # back to what the step was scheduled on (its output advanced them)
            req = side._reqs[rid].request
            computed[rid] = req.num_computed_tokens
            req.num_computed_tokens -= so.num_scheduled_tokens[rid]
        ts = []
        try:
            for _ in range(calls):
                for rid, first in firsts.items():
                    st = side._reqs[rid]
                    st.next_store_chunk = first
                    getattr(side, "_unstored", {})[rid] = st
                t = time.perf_counter()
                meta = side.build_connector_meta(so)
                ts.append(time.perf_counter() - t)
        finally:
            for rid, c in computed.items():
                side._reqs[rid].request.num_computed_tokens = c
        assert [len(j.chain) for j in meta.stores] == [per_step] * n
        ts.sort()
        return {"requests": n, "prompt_tokens": prompt_tokens, "chunks_stored": per_step * n,
                "new_requests": len(so.scheduled_new_reqs),
                "build_connector_meta_us": 1e6 * ts[len(ts) // 2]}
    finally:
        e.close()
        d.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="8,64,256")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    for n in (int(x) for x in args.requests.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            r = measure(n, pathlib.Path(tmp), args.calls)
        rows.append(r)
        print(f"{n:4} decode requests: build_connector_meta {r['build_connector_meta_us']:6.1f} us, "
              f"vLLM's schedule() {r['vllm_schedule_us']:7.1f} us  (connector = {100 * r['ratio']:.1f}% of it)")
    for n, step_tokens in ((4, 1024), (1, 4096)):
        with tempfile.TemporaryDirectory() as tmp:
            r = measure_store(n, pathlib.Path(tmp), args.calls, step_tokens=step_tokens)
        rows.append(r)
        print(f"store step, {n} request(s) of {r['prompt_tokens']} tokens ({r['new_requests']} new in the step), "
              f"{r['chunks_stored']} chunks of 256 tokens stored: build_connector_meta "
              f"{r['build_connector_meta_us']:.1f} us")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
