"""The vLLM connector on a GPU: what it costs the engine per step, and how fast KV moves through
it next to `KVDepotClient` used directly and the same run's pinned-memcpy roofline.

vLLM 0.33's real ``Scheduler``, KV-cache planning and connector lifecycle drive the connector
(`tests/vllm/vllm_harness.py`; vLLM's compiled modules are stubbed where absent, see
`tests/vllm/vllm_stubs.py`); the model is a "forward" that writes each scheduled token's blocks
on the current stream. Per shape:

* engine A prefills ``--requests`` prompts of 16 chunks each, one prompt per step (16 chunks
  stored per step); engine B (another engine on the same daemon, other block ids) runs the same
  prompts and loads them. ``--prompt-chunks K``: prompts of K chunks, 16 / K of them per step
  (``--prompt-chunks 1``: sixteen one-chunk requests stored per step, which the connector sends
  to the daemon together).
* ``step_us``: wall time spent inside the connector's methods per engine step, scheduler side
  (lookup answer, allocation, metadata, finished requests) plus worker side (bind, load, save,
  results), and the calls vLLM makes of any connector in every step (stats, events, pending
  push work, worker metadata: `SCHED_CALLS`, `WORKER_CALLS`), median and p99 over the steps
  that stored 16 chunks / that loaded; per method too.
  ``step_wait_us``: of it, the time those calls waited (their wall time beyond the engine
  thread's CPU time: for the GIL while the transfer thread held it, or in a blocking call).
  ``on_new_request`` (a prompt's keys, its lookup sent) runs when vLLM adds a request, on the
  engine thread between steps: reported per request, and counted into a store step's figure
  as ``store_step_with_new_requests_us_median`` (its 16 / K new prompts' share; here every
  prompt is added before the first step, so each call finds the caches warm from the one
  before). Worker side includes the per-layer ``wait_for_layer_load``
  / ``save_kv_layer`` calls, if vLLM makes any. The worker's transfer thread (the stores' and
  loads' work itself) runs beside the engine's thread: its CPU time per step is reported
  apart (``thread_cpu_us_per_step``). ``vllm_sched_us``: vLLM's own ``Scheduler.schedule`` and
  ``update_from_output`` in the same steps, less the connector's calls inside them (median):
  work the connector takes over from vLLM shows there as time vLLM no longer spends (a
  sliding-window model's pinned blocks go back to vLLM's free queue in the connector's
  ``update_connector_output`` instead of vLLM's ``schedule``).
* ``decode_step_us``: the same for a step that moves nothing (8 short requests decoding).
* As vLLM's engine core does after start-up (`vllm.utils.gc_utils.freeze_gc_heap`), each engine's
  objects are frozen out of the garbage collector once it is warm, so that a full collection
  does not walk the whole heap of vLLM, torch and the harness in the middle of a measured step.
  Collections still run (of the objects made since, vLLM's mostly; about 1 ms each on an H200
  host, in the step that admits 24 requests at once): one that runs inside a connector call
  is taken out of its figures and reported apart (``gc_in_steps``: every collection in the
  measured steps, those inside the connector's calls, and the p99 with them counted).
* Every figure is less the part of the timer's own cost that falls inside its timed window,
  per wrapped call (``timer_overhead_us_per_call``, a fraction of a microsecond, measured in the
  same process around a method that does nothing; the wrapper's whole cost,
  ``timer_wrapper_us_per_call``, mostly its reads of the thread-CPU clock, lies outside the
  window and is in no figure but vLLM's own scheduler time, which is less it per connector
  call made inside), and the per-layer calls
  less what the same timer costs per call in their place in the forward, measured there on a
  method that does nothing (`LayerProbe`, ``timer_in_layer_extra_us_per_call``): a step of an
  80-layer model makes 80 to 240 per-layer calls.
* ``store_gbps`` / ``load_gbps``: chunk bytes moved / wall time from the first step until vLLM
  freed every request (A: every store reported finished; B: every load done and the request
  finished), against ``direct_*``: the same chunks through `KVDepotClient` with engine-side
  staging, 16 chunks per request, 4 requests in flight; and ``roofline_*``: one pinned
  ``cudaMemcpyAsync`` of 16 chunks' bytes each way.
* ``*_vs_bound``: max(the link's time for the bytes at the roofline, the engine's own time)
  / the wall time (``*_vs_bound_with_admission``: the engine's own time also counts vLLM's own
  scheduler time, less the connector's calls, in the steps without a forward,
  ``*_no_forward_sched_s``: with asynchronous loads vLLM admits every waiting request of a hit
  in one such step, 8 ms of its own Python for 24 requests on an H200, work it does inside its
  forward steps without them). The engine's own time is the wall time of its steps that ran a forward,
  less the connector's time in them: this harness's "forward" is far shorter than a model's,
  so with 16 chunks per step its steps can take longer than the link needs for their bytes,
  and then no connector could finish sooner.

* ``--kv-blocks-factor F``: each engine's KV cache holds F times every prompt's blocks (default
  1: a freed block is soon given out again, which makes a sliding-window model's forwards
  order themselves after the stores' gathers most steps; vLLM's cache is far larger).

* ``--forward-us US``: each forward also spins the GPU that long (a model's forward takes
  milliseconds; the toy one microseconds); ``--output-wait [own|previous]``: each step ends
  waiting for its own or the previous step's GPU work (vLLM's model runner waits for sampled
  tokens; with async scheduling, vLLM's default, for the step before's). Together they give the
  engine thread the GPU waits a real model gives it, when the transfer thread may run.

* ``--evict-bytes N``: each forward also writes N bytes of host memory on the engine thread. A
  real model runner's host work (its Python, kernel launches, input preparation) leaves little of
  the connector's code and objects in the CPU caches by the next step, where the toy forward
  leaves most of them; the connector's per-step figures are mostly such cache misses (on the
  dev VM, `build_connector_meta` of a decode step: 1.3 us warm, 20-25 us after 64 MiB written).

* ``--hits N``: on a third engine, N of the prompts again (a hit each), half of them alone and
  half while new prompts are prefilled and stored: how long each hit's load took from its post
  to its report, and from its arrival to its first token, next to its bytes' time on the link;
  the time before its load was posted split into vLLM's queue (until its scheduler first asked
  the connector), the lookup's answer, and the rest (`connector_bench/hits.py`).

* ``--floor``: each shape's prompts and decodes again on an engine whose connector does nothing
  (`connector_bench.floor.FloorConnector`: every call returns a constant), timed by the same calls:
  ``floor_step_us`` over the steps that prefill a new prompt (the steps in which kvdepot stores 16
  chunks), ``floor_decode_step_us``. The per-step figures' floor, measured in the same run:
  what vLLM's calls cost any Python connector, which no change to kvdepot's can take off.

* ``--timeline``: each phase's wall time split into its lead-in (first step until the first
  transfer is sent), the time with one or more transfers at the daemon (and their GB/s), the
  time with none, and the tail (last answer until vLLM freed every request); see `Timeline`.
  Also how long each command the engine thread posted waited until the transfer thread took it
  (``post_to_take_us``).

    python benchmarks/vllm_connector.py --out result.json [--chunk 256] [--requests 24] [--timeline]

Needs a CUDA GPU, the kernel library (``kvdepot build-kernels``) and vLLM's Python files.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from connector_bench import floor as connector_floor
from connector_bench import harness
from connector_bench.hits import hit_latency
from connector_bench.hits import report as hits_report
from connector_bench.model import (CHUNKS_PER_STEP, FillEngine, FillForward, WaitingFillEngine, WaitingFillForward,
                                   shapes)
from connector_bench.refs import _sync, direct, roofline
from connector_bench.report import report
from connector_bench.timers import CallTimer, GcMeter, LayerProbe, StageTimers, Timeline, less_probe, pct
from connector_bench.trace import report as trace_report
from connector_bench.trace import summary as trace_summary
from kvdepot import trace
from kvdepot.client import KVDepotClient
from kvdepot.client.vllm.config import load_ring_bytes
from kvdepot.client.vllm.worker import WorkerConnector
from kvdepot.config import parse_bytes
from transfer_bench import stages as trace_stages
from transfer_bench.procs import FALLBACK_FLAG, DaemonProc, kernels_missing
from vllm.utils.gc_utils import freeze_gc_heap  # (after connector_bench: the harness stubs vLLM's compiled modules)

H = harness()

SCHED_CALLS = ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
               "request_finished", "request_finished_all_groups", "update_connector_output",
               "get_kv_connector_stats", "take_events", "has_pending_push_work")
VLLM_SCHED_CALLS = ("schedule", "update_from_output")  # `Scheduler`'s, which call the scheduler side's
WORKER_CALLS = ("handle_preemptions", "bind_connector_metadata", "start_load_kv", "has_connector_metadata",
                "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_transfer_results", "get_block_ids_with_load_errors",
                "clear_connector_metadata", "get_kv_connector_stats", "get_kv_connector_kv_cache_events",
                "build_connector_worker_meta")


def drive(engine: H.Engine, prompts: list[list[int]], kind: str, chunk_bytes: int, timeout_s: float = 300.0,
          select=None) -> dict:
    """Add every prompt, step until vLLM freed them all; the connector's CPU time in the steps
    whose connector metadata carried ``kind`` jobs ("stores" or "loads"), or for which
    ``select(scheduler_output)`` is true: in total, scheduler side, worker side, and per method
    (median over those steps)."""
    sched_t = CallTimer(engine.sched_conn, SCHED_CALLS)
    work_t = CallTimer(engine.worker_conn, WORKER_CALLS)
    # vLLM's own scheduler calls, around the connector's scheduler-side calls made inside them
    vllm_t = CallTimer(engine.scheduler, VLLM_SCHED_CALLS)
    ours = isinstance(engine.worker_conn, WorkerConnector)  # (not `connector_bench.floor.FloorConnector`)
    before = dict(engine.worker_conn.stats) if ours else {}
    stages = StageTimers(engine)
    for p in prompts:
        engine.add(p, max_tokens=1)
    _sync()
    added = sched_t.take()  # on_new_request (keys hashed, lookup sent) at add time, not a step's
    vllm_t.take()
    gcm = GcMeter()
    steps, waits, gcs, vllm_own, t0 = [], [], [], [], time.perf_counter()
    timeline = Timeline(engine, t0)
    forward_steps = 0
    engine_s = 0.0  # the engine's own time (its steps that ran a forward, less the connector's)
    no_forward_sched_s = 0.0  # vLLM's own scheduler in the steps without a forward (less the connector's)
    deadline = time.monotonic() + timeout_s
    while engine.scheduler.has_requests():
        ts = time.perf_counter()
        so = engine.step()
        step_s = time.perf_counter() - ts
        timeline.step(ts, ts + step_s, bool(so.total_num_scheduled_tokens))
        calls, sched_calls = dict(work_t.calls), sum(sched_t.calls.values())
        sched, work = sched_t.take(), less_probe(work_t.take(), calls)
        # vLLM's scheduler less the connector's calls in it (and their timers' own cost)
        own = sum(vllm_t.take().values()) - sum(sched.values()) - CallTimer.wrapper_s() * sched_calls
        in_gc = gcm.take()
        if select(so) if select is not None else getattr(so.kv_connector_metadata, kind, None):
            steps.append((sched, work))
            vllm_own.append(max(0.0, own))
            gcs.append((*in_gc, sum(sched_t.gc_s.values()) + sum(work_t.gc_s.values())))
            waits.append(_waited(sched, sched_t.cpu_s) + _waited(work, work_t.cpu_s))
        if so.total_num_scheduled_tokens:
            forward_steps += 1
            engine_s += max(0.0, step_s - sum(sched.values()) - sum(work.values()))
        else:
            no_forward_sched_s += max(0.0, own)
            time.sleep(0.0002)
        assert time.monotonic() < deadline, "engine did not finish"
    _sync()
    end_s = time.perf_counter()
    total = [1e6 * (sum(a.values()) + sum(b.values())) for a, b in steps]
    names = sorted({n for a, b in steps for n in (*a, *b)})
    per_call = {n: statistics.median([1e6 * (a.get(n, 0.0) + b.get(n, 0.0)) for a, b in steps]) for n in names}
    med = statistics.median
    stats = {k: v - before.get(k, 0) for k, v in engine.worker_conn.stats.items()} if ours else {}
    return {"thread_cpu_us_per_step": 1e6 * stats.get("thread_cpu_s", 0.0) / max(1, forward_steps),
            "forward_steps": forward_steps,
            "wall_s": end_s - t0, "timeline": timeline.take(end_s, chunk_bytes), "engine_s": engine_s,
            "no_forward_sched_s": no_forward_sched_s,
            "steps_measured": len(steps),
            "step_us_median": med(total) if total else None, "step_us_p99": pct(total, 0.99),
            "step_wait_us_median": 1e6 * med(waits) if waits and CallTimer.cpu_clock else None,
            "sched_us_median": med([1e6 * sum(a.values()) for a, _ in steps]) if steps else None,
            "worker_us_median": med([1e6 * sum(b.values()) for _, b in steps]) if steps else None,
            "per_call_us_median": per_call,
            "vllm_sched_us_median": 1e6 * med(vllm_own) if vllm_own else None,
            "on_new_request_us_per_request": 1e6 * sum(added.values()) / len(prompts),
            "stages": stages.take(), "stats": stats,
            # garbage collections inside the measured steps (anywhere in the step: vLLM's code too)
            # and inside the connector's calls: taken out of the figures above (`CallTimer`)
            "gc_in_steps": {"steps_with_one": sum(1 for n, *_ in gcs if n), "collections": sum(n for n, *_ in gcs),
                            "us_total": 1e6 * sum(g[1] for g in gcs), "us_max": 1e6 * max((g[1] for g in gcs), default=0.0),
                            "in_connector_calls_us_total": 1e6 * sum(g[2] for g in gcs),
                            "in_connector_calls_us_max": 1e6 * max((g[2] for g in gcs), default=0.0),
                            "step_us_p99_with_them": pct([t + 1e6 * g[2] for t, g in zip(total, gcs)], 0.99)}}


def _waited(wall: dict[str, float], cpu: dict[str, float]) -> float:
    """Seconds the calls of one step waited (their wall time beyond the calling thread's CPU
    time: the GIL, held by another thread of the process, or a blocking call)."""
    return sum(max(0.0, v - cpu.get(n, 0.0)) for n, v in wall.items())


def decode_steps(engine: H.Engine, requests: int = 8, steps: int = 48) -> dict:
    """What the connector costs a step that moves nothing (decode): ``requests`` prompts shorter
    than a chunk generate ``steps`` tokens each; median and p99 of the connector's CPU time per
    step that scheduled tokens."""
    sched_t = CallTimer(engine.sched_conn, SCHED_CALLS)
    work_t = CallTimer(engine.worker_conn, WORKER_CALLS)
    for i in range(requests):
        engine.add(H.tokens(5000 + i, 100), max_tokens=steps)
    sched_t.take()
    total, waits, calls = [], [], {}
    while engine.scheduler.has_requests():
        so = engine.step()
        counts = dict(work_t.calls)
        sched, work = sched_t.take(), less_probe(work_t.take(), counts)
        spent = {**sched, **work}
        if so.total_num_scheduled_tokens == len(so.num_scheduled_tokens):  # one token per request
            total.append(1e6 * sum(spent.values()))
            waits.append(1e6 * (_waited(sched, sched_t.cpu_s) + _waited(work, work_t.cpu_s)))
            for n, v in spent.items():
                calls.setdefault(n, []).append(1e6 * v)
    return {"decode_step_us_median": statistics.median(total), "decode_step_us_p99": pct(total, 0.99),
            "decode_step_wait_us_median": statistics.median(waits) if CallTimer.cpu_clock else None,
            "decode_steps": len(total),
            "decode_per_call_us_median": {n: statistics.median(v) for n, v in calls.items()}}


def floor_steps(engine: H.Engine, prompts: list[list[int]], chunk_bytes: int) -> dict:
    """``--floor``: the same prefills and decodes with `connector_bench.floor.FloorConnector` (every
    call returns at once): ``floor_step_us_*`` over the steps that prefill a new prompt (kvdepot
    stores 16 chunks in those), ``floor_decode_step_us_*``, and the per-call medians."""
    timeline, stages = Timeline.enabled, StageTimers.enabled
    Timeline.enabled = StageTimers.enabled = False  # (they time kvdepot's worker: this engine has none)
    try:
        engine.add(H.tokens(8, 1000), max_tokens=1)
        engine.run(timeout_s=60)
        freeze_gc_heap()
        got = drive(engine, prompts, "", chunk_bytes, select=connector_floor.is_prefill_step)
        dec = decode_steps(engine)
    finally:
        Timeline.enabled, StageTimers.enabled = timeline, stages
        engine.close()
        gc.unfreeze()
    out = {f"floor_{k}": got[k] for k in ("step_us_median", "step_us_p99", "sched_us_median", "worker_us_median",
                                          "per_call_us_median", "steps_measured", "vllm_sched_us_median")}
    out.update({f"floor_{k}": v for k, v in dec.items()})
    return out


def new_engine(specs: dict, model: str, endpoint: str, *, name: str, chunk: int, requests: int, device: str,
               num_blocks: int, output_wait: str = "", forward_us: float = 0.0, evict_bytes: int = 0,
               staging_bytes: int = 0, load_staging_bytes: int = 0, key_source: str = "auto",
               connector: dict | None = None) -> H.Engine:
    """One engine of a shape as this benchmark runs it: 16 chunks per step (vLLM's
    max_num_batched_tokens), ``requests`` sequences at most, the "forward" of `FillForward`
    (``forward_us``, ``evict_bytes``; ``output_wait``: `WaitingFillForward`); ``connector``:
    ``make_vllm_config``'s ``connector`` / ``module`` (default kvdepot's)."""
    tokens = CHUNKS_PER_STEP * chunk
    cfg = H.make_vllm_config(model, endpoint, chunk_size=chunk, device=device, max_model_len=tokens + 64,
                             max_num_batched_tokens=tokens, max_num_seqs=requests, **(connector or {}),
                             extra={"model_id": f"bench-{name}", "rpc_timeout_s": 30.0,
                                    "staging_bytes": staging_bytes, "load_staging_bytes": load_staging_bytes,
                                    "key_source": key_source,
                                    "lookup_timeout_s": 5.0, "hold_max_s": 60.0})
    FillForward.forward_us = forward_us
    FillForward.evict_bytes = evict_bytes
    WaitingFillForward.lag = 1 if output_wait == "previous" else 0
    return (WaitingFillEngine if output_wait else FillEngine)(cfg, specs, num_blocks=num_blocks)


def bench_shape(name: str, specs: dict, endpoint: str, workdir: Path, chunk: int, requests: int,
                device: str = "cuda", staging_bytes: int = 0, prompt_chunks: int = CHUNKS_PER_STEP,
                output_wait: str = "", kv_blocks_factor: float = 1.0, forward_us: float = 0.0,
                key_source: str = "auto", hits: int = 0, load_staging_bytes: int = 0, evict_bytes: int = 0,
                floor: bool = False) -> dict:
    tokens = CHUNKS_PER_STEP * chunk  # per step (vLLM's max_num_batched_tokens)
    prompt_tokens = prompt_chunks * chunk
    block_bytes = sum(s.page_size_bytes for s in specs.values())
    num_blocks = int(((requests * prompt_tokens + 4 * tokens) // 16 + 64) * kv_blocks_factor)
    model = H.model_dir(workdir)

    def engine(connector: dict | None = None):
        return new_engine(specs, model, endpoint, name=name, chunk=chunk, requests=requests, device=device,
                          num_blocks=num_blocks, output_wait=output_wait, forward_us=forward_us,
                          evict_bytes=evict_bytes, staging_bytes=staging_bytes,
                          load_staging_bytes=load_staging_bytes, key_source=key_source, connector=connector)

    prompts = [H.tokens(1000 + i, prompt_tokens) for i in range(requests)]
    res = {"shape": name, "chunk_tokens": chunk, "requests": requests, "prompt_chunks": prompt_chunks,
           "chunk_bytes": block_bytes * chunk // 16, "staging_bytes": staging_bytes, "output_wait": output_wait,
           "kv_blocks": num_blocks, "forward_us": forward_us, "key_source": key_source, "evict_bytes": evict_bytes}
    a = engine()
    try:
        a.add(H.tokens(8, 1000), max_tokens=1)  # connect, register, first kernels: not measured
        a.run(timeout_s=60)
        freeze_gc_heap()  # as vLLM's EngineCore after start-up
        store = drive(a, prompts, "stores", res["chunk_bytes"])
        staging_bytes = a.worker_conn.registrar.staging_bytes()  # the ring used (0 above: the connector's auto size)
        res["staging_bytes"] = staging_bytes
        res["load_staging_bytes"] = load_ring_bytes(a.worker_conn.cfg)  # 0: loads share the ring
        res.update(decode_steps(a))
    finally:
        a.close()
        gc.unfreeze()
    b = engine()
    try:
        b.add(H.tokens(7, 160), max_tokens=1)  # other block ids than A's
        b.run(timeout_s=60)
        freeze_gc_heap()
        load = drive(b, prompts, "loads", res["chunk_bytes"])
        if hits:  # engine C: hits of A's prompts, alone and while fresh prompts are stored
            c = engine()
            try:
                c.add(H.tokens(6, 200), max_tokens=1)
                c.run(timeout_s=60)
                freeze_gc_heap()
                res.update(hit_latency(c, prompts[:hits], [H.tokens(3000 + i, prompt_tokens) for i in range(hits)],
                                       res["chunk_bytes"], chunk))
            finally:
                c.close()
        if device == "cpu":  # B's shared-memory segments go with close()
            res.update(direct(b.worker_conn.registrar.reg, num_blocks, endpoint, chunk, requests, res["chunk_bytes"],
                              device, staging_bytes))
    finally:
        b.close()
        gc.unfreeze()
    if device == "cuda":  # B's caches stay allocated; registered again once B's registration is gone
        res.update(direct(b.worker_conn.registrar.reg, num_blocks, endpoint, chunk, requests, res["chunk_bytes"],
                          device, staging_bytes))
    res["stored_chunks"] = store["stats"]["stored_chunks"]
    res["loaded_chunks"] = load["stats"]["loaded_chunks"]
    res["store_gbps"] = res["stored_chunks"] * res["chunk_bytes"] / store["wall_s"] / 1e9
    res["load_gbps"] = res["loaded_chunks"] * res["chunk_bytes"] / load["wall_s"] / 1e9
    for op, d in (("store", store), ("load", load)):
        res[f"{op}_wall_s"], res[f"{op}_engine_s"] = d["wall_s"], d["engine_s"]
        res[f"{op}_no_forward_sched_s"] = d["no_forward_sched_s"]
    for op, d in (("store", store), ("load", load)):
        for k in ("step_us_median", "step_us_p99", "step_wait_us_median", "sched_us_median", "worker_us_median", "per_call_us_median",
                  "steps_measured", "on_new_request_us_per_request", "stages", "thread_cpu_us_per_step", "timeline",
                  "gc_in_steps", "vllm_sched_us_median"):
            res[f"{op}_{k}"] = d[k]
    res["store_stats"], res["load_stats"] = store["stats"], load["stats"]
    if floor:
        res.update(floor_steps(engine({"connector": connector_floor.NAME, "module": connector_floor.MODULE}),
                               [H.tokens(9000 + i, prompt_tokens) for i in range(requests)], res["chunk_bytes"]))
    # a store step's figure with its prompts' on_new_request (keys, lookup sent) counted in:
    # vLLM calls it on the engine thread between steps, once per prompt
    res["store_step_with_new_requests_us_median"] = (
        res["store_step_us_median"] + CHUNKS_PER_STEP // prompt_chunks * res["store_on_new_request_us_per_request"])
    res["timer_overhead_us_per_call"] = 1e6 * CallTimer.overhead_s()
    res["timer_wrapper_us_per_call"] = 1e6 * CallTimer.wrapper_s()
    res["timer_cpu_clock"] = CallTimer.cpu_clock
    res["timer_in_layer_extra_us_per_call"] = statistics.median(LayerProbe.in_situ_us) if LayerProbe.in_situ_us else 0.0
    LayerProbe.in_situ_us.clear()
    if device != "cuda":
        return res  # a smoke run (no roofline on CPU)
    res.update(roofline(CHUNKS_PER_STEP * res["chunk_bytes"]))
    for op, roof in (("store", "roofline_d2h_gbps"), ("load", "roofline_h2d_gbps")):
        res[f"{op}_vs_roofline"] = res[f"{op}_gbps"] / res[roof]
        # the run cannot end before the link moved the bytes nor before the engine's own steps
        # ran (this harness's steps are far shorter than a real model's forward): the bound
        chunks = res["stored_chunks" if op == "store" else "loaded_chunks"]
        link_s = chunks * res["chunk_bytes"] / res[roof] / 1e9
        res[f"{op}_link_s"] = link_s
        res[f"{op}_vs_bound"] = max(link_s, res[f"{op}_engine_s"]) / res[f"{op}_wall_s"]
        # the same with vLLM's own scheduling in the steps without a forward counted as the
        # engine's: with asynchronous loads vLLM admits every waiting request in one such step
        # (their blocks allocated, their state changed), work it does in its forward steps
        # without them
        res[f"{op}_vs_bound_with_admission"] = (max(link_s, res[f"{op}_engine_s"] + res[f"{op}_no_forward_sched_s"])
                                                / res[f"{op}_wall_s"])
    res["direct_store_vs_roofline"] = res["direct_store_gbps"] / res["roofline_d2h_gbps"]
    res["direct_retrieve_vs_roofline"] = res["direct_retrieve_gbps"] / res["roofline_h2d_gbps"]
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--requests", type=int, default=24, help="prompts per shape (default 24)")
    p.add_argument("--prompt-chunks", type=int, default=CHUNKS_PER_STEP,
                   help=f"chunks per prompt (default {CHUNKS_PER_STEP}: one prompt per step; 1: {CHUNKS_PER_STEP} "
                        "one-chunk prompts per step, whose stores and loads the connector sends together)")
    p.add_argument("--shapes", default="", help="comma-separated subset of the shape names")
    p.add_argument("--l1-bytes", default="24g")
    p.add_argument("--pin-wait-s", type=float, default=120.0,
                   help="wait at most this long for the daemon to page-lock L1 before measuring (default 120)")
    p.add_argument("--staging-bytes", type=int, default=0,
                   help="the connector's staging ring (its staging_bytes setting; default 0: its auto size)")
    p.add_argument("--load-staging-bytes", type=int, default=0,
                   help="the connector's ring for loads (its load_staging_bytes setting; default 0: its auto size; "
                        "-1: loads share the staging ring)")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--profile", default="",
                   help="write a cProfile of the whole run (all shapes, both engines; on Python >= 3.12 every "
                        "thread, the workers' transfer threads too) here, as text (the timings above then "
                        "include the profiler's own cost)")
    p.add_argument("--stages", action="store_true",
                   help="also time the worker's internal calls (ring, gather, event, send, poll...) per call; "
                        "the per-step figures then include those timers' own cost")
    p.add_argument("--timeline", action="store_true",
                   help="also split each phase's wall time: lead-in, time with transfers at the daemon, time "
                        "with none (the client idles the link), tail")
    p.add_argument("--switch-interval-us", type=float, default=0.0,
                   help="diagnosis: sys.setswitchinterval for this process (default: Python's 5000 us), to see "
                        "how much the engine and transfer threads' sharing of the GIL costs")
    p.add_argument("--no-cpu-clock", action="store_true",
                   help="do not read the engine thread's CPU clock around each timed call (a system call before "
                        "and after each): no figure of the time the calls waited, and none of that clock's effect "
                        "on the calls' own figures")
    p.add_argument(FALLBACK_FLAG, action="store_true",
                   help="run even where the CUDA kernel library does not load (the torch fallback: not the product's speed)")
    p.add_argument("--output-wait", nargs="?", const="own", default="", choices=["own", "previous"],
                   help="end each step with a wait for the GPU, as vLLM's model runner waits for its sampled "
                        "tokens (`WaitingFillForward`): for this step's (own, the default) or the step before's "
                        "(previous: vLLM's async scheduling); without it the engine thread never waits between steps")
    p.add_argument("--forward-us", type=float, default=0.0,
                   help="GPU time of each step's forward, spun on the stream (a model's: milliseconds; default 0)")
    p.add_argument("--kv-blocks-factor", type=float, default=1.0,
                   help="KV-cache blocks per engine, times what holds every prompt at once (default 1: a block "
                        "freed is soon given out again, the worst case for a sliding-window model's stores; vLLM "
                        "gives the cache most of the GPU, e.g. ~150k blocks for gpt-oss-20b on an H200)")
    p.add_argument("--key-source", default="auto", choices=["auto", "vllm", "tokens"],
                   help="the connector's key_source: chunk keys from vLLM's block hashes (auto / vllm) or from the "
                        "tokens hashed by the connector (tokens, the way before; for comparisons)")
    p.add_argument("--hits", type=int, default=0,
                   help="also time N prefix hits' loads on a third engine, half alone, half while other prompts' "
                        "stores stream (`connector_bench/hits.py`); N <= --requests")
    p.add_argument("--evict-bytes", default="0",
                   help="each forward also writes this many bytes of host memory on the engine thread (e.g. 64m), "
                        "leaving the CPU caches as cold as a real model runner's host work would")
    p.add_argument("--trace", default="",
                   help="a directory: the daemon's trace points (`kvdepot.trace`, KVDEPOT_TRACE_FILE) go to "
                        "daemon-trace.jsonl there and this process's (every engine's clients: sent, replied) to "
                        "engine-trace.jsonl, on one clock with the hits' stamps in the JSON (--hits), to line up a "
                        "hit's pieces at the client and at the daemon")
    p.add_argument("--floor", action="store_true",
                   help="also run each shape's prefills and decodes on an engine whose connector does nothing "
                        "(`connector_bench/floor.py`): the per-step figures' floor, measured in the same run")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke run of the same steps with shared-memory KV caches (no roofline)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    if args.device == "cuda" and not args.allow_torch_fallback:
        why = kernels_missing()
        if why is not None:
            print(f"the CUDA kernel library is unavailable ({why}): the daemon and engines would run the torch "
                  f"fallback. Rebuild it (`kvdepot build-kernels`), or pass {FALLBACK_FLAG} to measure that",
                  file=sys.stderr)
            return 2
    results = []
    StageTimers.enabled = args.stages
    CallTimer.cpu_clock = not args.no_cpu_clock
    Timeline.enabled = args.timeline
    if args.switch_interval_us:
        sys.setswitchinterval(args.switch_interval_us * 1e-6)
    prof = cProfile.Profile() if args.profile else None
    if prof is not None:
        prof.enable()  # Python >= 3.12: every thread (the workers' transfer threads too)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        trace_stages.enable(os.path.join(args.trace, "daemon-trace.jsonl"))  # the daemon started below, and here
    with tempfile.TemporaryDirectory() as td:
        wd = Path(td)
        d = DaemonProc(args.l1_bytes, [], str(wd / "daemon.log"), pin=args.device == "cuda")
        ep = d.endpoint
        try:
            d.wait_ready()
            # the daemon page-locks L1 in the background and allocates only in the part already
            # pinned (`HostPool.start_pinning`): measure once all of it is
            pinned, waited_s = d.wait_pinned(args.pin_wait_s)
            if d.pin:
                print(f"L1 {'pinned' if pinned else 'NOT pinned'} after {waited_s:.1f} s", flush=True)
            wanted = [s for s in args.shapes.split(",") if s]
            for name, specs in shapes().items():
                if wanted and name not in wanted:
                    continue
                with KVDepotClient(ep, timeout_s=60) as c:
                    c.flush()
                r = bench_shape(name, specs, ep, wd, args.chunk, args.requests, args.device, args.staging_bytes,
                                args.prompt_chunks, args.output_wait, args.kv_blocks_factor, args.forward_us,
                                args.key_source, args.hits, args.load_staging_bytes,
                                parse_bytes(args.evict_bytes), args.floor)
                print(report(r) + hits_report(r) if "store_vs_roofline" in r else json.dumps(r), flush=True)
                results.append(r)
        finally:
            d.stop()  # (it writes its trace as it stops)
    if args.trace:
        with open(os.path.join(args.trace, "engine-trace.jsonl"), "w") as f:
            for row in trace.POINTS or ():
                f.write(json.dumps(row) + "\n")
        for r in results:
            if r.get("lone_stamps_ns") or r.get("streaming_stamps_ns"):
                r.update(trace_summary(args.trace, r))
                print(f"{r['shape']}:{trace_report(r)}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if prof is not None:
        prof.disable()
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        for key in ("tottime", "cumulative"):
            st.sort_stats(key).print_stats(45)
        Path(args.profile).write_text(buf.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
