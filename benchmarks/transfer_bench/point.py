"""One measured point (a model shape at one chunk size): the same run's pinned-memcpy roofline,
store / retrieve streams through the daemon, both directions at once, lone requests next to
the bare ZMQ round trip, and the in-process baselines on the same blocks."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from kvdepot import trace
from kvdepot.client import KVDepotClient
from kvdepot.client.kvcache import ShmKVCache
from transfer_bench.baselines import Blocks, Pages, dma_baseline, torch_baseline
from transfer_bench.procs import busy_threads, process_cpu_s, thread_cpu_s
from transfer_bench.report import p10_p90
from transfer_bench.shapes import Shape, chunks_for, say
from transfer_bench.timing import timed
from transfer_bench.workload import (_Work, fresh_keys, retrieve_pipelined, retrieve_task, run_parallel,
                                     store_pipelined, store_task)


@dataclasses.dataclass
class Ctx:
    args: argparse.Namespace
    dev: torch.device
    clients: list[KVDepotClient]  # 2 * outstanding, each used by one thread at a time
    streams: list  # one CUDA stream per client
    host: list[torch.Tensor]  # two pinned buffers of max_bytes
    devbuf: list[torch.Tensor]  # two device buffers of max_bytes
    zmq_us: float
    daemon_pid: int | None = None  # the daemon started here (None: --endpoint), for its CPU time


class CpuMeter:
    """CPU cores (CPU seconds / wall seconds) of this process (the engine: every client thread)
    and of the daemon over timed runs, per phase (median over its runs): which process a phase
    saturates. A Python process's threads share one GIL: near 1 core of Python it cannot go
    faster, whatever the link could do. Per thread too: the engine's busiest client thread, and
    the daemon's threads by name (``main``: its event loop; ``kvd-issue`` / ``kvd-watch``: the
    kernel library's copy issuer and completion watcher). A client spinning for a reply
    (``--spin-us``) counts as busy: run with ``--spin-us 0`` to see the work alone."""

    def __init__(self, daemon_pid: int | None) -> None:
        self.daemon_pid = daemon_pid
        self.runs: dict[str, list[tuple[float, float | None, float, dict[str, float]]]] = {}

    def run(self, phase: str, tasks) -> float:
        """`run_parallel` of ``tasks``, metered; returns its wall seconds."""
        pid = self.daemon_pid
        d0 = process_cpu_s(pid) if pid else 0.0
        t0 = thread_cpu_s(pid) if pid else {}
        c0 = time.process_time()
        per_thread: list[float] = []
        dt = run_parallel(tasks, per_thread)
        own = (time.process_time() - c0) / dt
        daemon = (process_cpu_s(pid) - d0) / dt if pid else None
        threads = busy_threads(t0, thread_cpu_s(pid), dt) if pid else {}
        self.runs.setdefault(phase, []).append((own, daemon, max(per_thread, default=0.0) / dt, threads))
        return dt

    def cores(self) -> dict[str, dict]:
        """Per phase: {"engine", "daemon", "engine_thread_max", "daemon_threads": {name: cores}},
        each the median over the phase's runs (None / {} where the daemon was not metered)."""
        out = {}
        for phase, xs in self.runs.items():
            daemon = [d for _, d, _, _ in xs if d is not None]
            names = sorted({n for *_, th in xs for n in th})
            out[phase] = {"engine": statistics.median(o for o, _, _, _ in xs),
                          "daemon": statistics.median(daemon) if daemon else None,
                          "engine_thread_max": statistics.median(t for _, _, t, _ in xs),
                          "daemon_threads": {n: statistics.median(th.get(n, 0.0) for *_, th in xs)
                                             for n in names}}
        return out


def bench_point(ctx: Ctx, shape: Shape, cache: ShmKVCache, specs: tuple, blocks: Blocks, pages: Pages,
                chunk_size: int) -> dict:
    a = ctx.args
    t_start = time.perf_counter()
    k = a.outstanding
    per = a.per_message if a.client_mode == "pipelined" else 1
    n = chunks_for(shape, chunk_size, a.bytes_per_point, k * per)
    main = ctx.clients[0]
    staging = {}
    if a.staging == "engine":  # the ring holds every request in flight in both directions twice over
        ob_guess = shape.token_bytes * chunk_size
        staging = dict(local_storages=[cache.storage],
                       staging_bytes=max(256 << 20, 2 * (2 * k * per + 1) * ob_guess))
    reg = main.register(f"bench/{shape.name}", shape.shard, chunk_size, *specs, device=cache.register_device,
                        **staging)
    if a.staging == "engine" and reg.staging is None:
        raise RuntimeError("--staging engine: the daemon or this process cannot run engine-side staging")
    ob = reg.object_bytes
    assert ob == shape.token_bytes * chunk_size, (ob, shape.token_bytes, chunk_size)
    total = n * ob
    res: dict = {"shape": shape.name, "chunk_tokens": chunk_size, "object_bytes": ob, "chunks": n, "bytes": total,
                 "outstanding": k, "per_message": per, "client_mode": a.client_mode, "staging": a.staging, "spin_us": a.spin_us}
    try:
        main.flush()
        src = [blocks.chunk("src", j, chunk_size) for j in range(n)]
        dst = [blocks.chunk("dst", j, chunk_size) for j in range(n)]

        # roofline: one pinned memcpy of the same bytes each way, and both at once
        ha, hb = ctx.host[0][:total], ctx.host[1][:total]
        da, db = ctx.devbuf[0][:total], ctx.devbuf[1][:total]
        s1, s2 = ctx.streams[0], ctx.streams[1]

        def d2h() -> None:
            with torch.cuda.stream(s1):
                ha.copy_(da, non_blocking=True)
            s1.synchronize()

        def h2d() -> None:
            with torch.cuda.stream(s1):
                da.copy_(ha, non_blocking=True)
            s1.synchronize()

        def bidir() -> None:
            with torch.cuda.stream(s1):
                ha.copy_(da, non_blocking=True)
            with torch.cuda.stream(s2):
                db.copy_(hb, non_blocking=True)
            s1.synchronize()
            s2.synchronize()

        res["roofline_d2h_gbps"] = total / timed(d2h, a.iters) / 1e9
        res["roofline_h2d_gbps"] = total / timed(h2d, a.iters) / 1e9
        res["roofline_bidir_gbps"] = 2 * total / timed(bidir, a.iters) / 1e9

        def one_memcpy() -> None:
            with torch.cuda.stream(s1):
                ha[:ob].copy_(da[:ob], non_blocking=True)
            s1.synchronize()

        def one_memcpy_h2d() -> None:
            with torch.cuda.stream(s1):
                da[:ob].copy_(ha[:ob], non_blocking=True)
            s1.synchronize()

        # a plain lone copy's own time beyond the link time (launch, ramp, wake-up): the floor
        # under a lone request's overhead
        res["lone_memcpy_d2h_us"] = timed(one_memcpy, 20) * 1e6
        res["lone_memcpy_h2d_us"] = timed(one_memcpy_h2d, 20) * 1e6

        # store / retrieve streams through the daemon
        st_clients, st_streams = ctx.clients[:k], ctx.streams[:k]
        rt_clients, rt_streams = ctx.clients[k:2 * k], ctx.streams[k:2 * k]
        torch.cuda.synchronize()

        def store_tasks(w: _Work) -> list:
            if a.client_mode == "pipelined":
                return [store_pipelined(st_clients[0], reg, st_streams[0], w, k, per)]
            return [store_task(c, reg, s, w) for c, s in zip(st_clients, st_streams)]

        def retrieve_tasks(w: _Work) -> list:
            if a.client_mode == "pipelined":
                return [retrieve_pipelined(rt_clients[0], reg, rt_streams[0], w, k, per)]
            return [retrieve_task(c, reg, s, w) for c, s in zip(rt_clients, rt_streams)]

        meter = CpuMeter(ctx.daemon_pid)

        def store_run(keys, phase: str = "") -> tuple[float, int]:
            w = _Work(zip(keys, src))
            return (meter.run(phase, store_tasks(w)) if phase else run_parallel(store_tasks(w))), w.done

        def retrieve_run(keys, phase: str = "") -> tuple[float, int]:
            w = _Work(zip(keys, dst))
            return (meter.run(phase, retrieve_tasks(w)) if phase else run_parallel(retrieve_tasks(w))), w.done

        warm = fresh_keys(reg, min(n, 2 * k), chunk_size)
        store_run(warm)
        retrieve_run(warm)
        store_ts, stored = [], []
        keys: list[bytes] = []
        for _ in range(a.iters):
            main.flush()  # outside the clock; every rep stores n new chunks
            keys = fresh_keys(reg, n, chunk_size)
            dt, done = store_run(keys, "store")
            store_ts.append(dt)
            stored.append(done)
        res["store_gbps_runs"] = [total / t / 1e9 for t in store_ts]
        res["store_gbps"] = statistics.median(res["store_gbps_runs"])
        res["store_chunks_stored"] = stored
        retr_ts, retrieved = [], []
        for _ in range(a.iters):
            dt, done = retrieve_run(keys, "retrieve")
            retr_ts.append(dt)
            retrieved.append(done)
        res["retrieve_gbps_runs"] = [total / t / 1e9 for t in retr_ts]
        res["retrieve_gbps"] = statistics.median(res["retrieve_gbps_runs"])
        res["retrieve_chunks_retrieved"] = retrieved
        if any(s != n for s in stored) or any(r != n for r in retrieved):
            say(f"  WARNING: {shape.name} chunk {chunk_size}: stored {stored}, retrieved {retrieved} of {n} "
                "per run (L1 too small?)")
        # the data path really moved the bytes: chunk 0's blocks now equal its source blocks
        ok = True
        for li, (gid, *_rest) in enumerate(pages.layers):
            v = pages.views[li]
            s_ids = torch.tensor(src[0][gid], device=ctx.dev)
            d_ids = torch.tensor(dst[0][gid], device=ctx.dev)
            ok &= bool(torch.equal(v.index_select(0, s_ids), v.index_select(0, d_ids)))
        res["verified"] = ok
        if not ok:
            say(f"  WARNING: {shape.name} chunk {chunk_size}: retrieved blocks differ from the stored ones")

        # both directions at once: k threads store new chunks while k threads retrieve stored ones
        both_ts = []
        for _ in range(a.iters):
            new = fresh_keys(reg, n, chunk_size)
            ws, wr = _Work(zip(new, src)), _Work(zip(keys, dst))
            dt = meter.run("both", store_tasks(ws) + retrieve_tasks(wr))
            both_ts.append((ws.done + wr.done) * ob / dt / 1e9)
        res["bidir_gbps_runs"] = both_ts
        res["bidir_gbps"] = statistics.median(both_ts)
        res["cpu_cores"] = meter.cores()

        # lone requests (nothing else in flight)
        c, s = ctx.clients[0], ctx.streams[0]
        warmup = 3
        lat_r, reply_r = [], []
        rids = {"store": [], "retrieve": []}  # --trace: the lone requests (`transfer_bench.stages`)
        missing = 0
        for i in range(warmup + a.lone_iters):
            j = i % n
            t0 = time.perf_counter_ns()
            # as c.retrieve(..., before=s): the scatter enqueued on s now, behind the landed word
            pending = c.submit_retrieve(reg, [keys[j]], dst[j], scatter_on=s)
            got = pending.result(s)  # staged: after the daemon's copies (gated: the scatter is running)
            t1 = time.perf_counter_ns()
            s.synchronize()  # and the scatter
            t2 = time.perf_counter_ns()
            if i >= warmup:
                lat_r.append((t2 - t0) / 1e9)
                reply_r.append((t1 - t0) / 1e9)
                _trace_lone(rids["retrieve"], pending.rid, (("b_call", t0), ("b_replied", t1), ("b_end", t2)))
            missing += got != 1
        if missing:
            say(f"  WARNING: {missing} lone retrieves found no chunk (evicted? raise --l1-bytes)")
        lone_keys = fresh_keys(reg, warmup + a.lone_iters, chunk_size)
        lat_s = []
        not_stored = 0
        for i, key in enumerate(lone_keys):
            j = i % n
            t0 = time.perf_counter_ns()
            pending = c.submit_store(reg, [key], src[j], after=s)  # as c.store(...)
            r = pending.result()
            t1 = time.perf_counter_ns()
            if i >= warmup:
                lat_s.append((t1 - t0) / 1e9)
                _trace_lone(rids["store"], pending.rid, (("b_call", t0), ("b_end", t1)))
            not_stored += r.stored != 1
        if not_stored:
            say(f"  WARNING: {not_stored} lone stores stored nothing")
        pings = []
        for i in range(20 + 200):
            t0 = time.perf_counter()
            c.ping()
            if i >= 20:
                pings.append(time.perf_counter() - t0)
        res["lone_store_us"] = statistics.median(lat_s) * 1e6
        # spread of the lone figures (these VMs are noisy): 10th / 90th percentiles
        res["lone_store_us_p10_p90"] = [q * 1e6 for q in p10_p90(lat_s)]
        res["lone_retrieve_us_p10_p90"] = [q * 1e6 for q in p10_p90(lat_r)]
        res["lone_retrieve_us"] = statistics.median(lat_r) * 1e6
        res["lone_retrieve_reply_us"] = statistics.median(reply_r) * 1e6  # until retrieve() returned (staged: after its CPU wait for the copies)
        res["link_d2h_us"] = ob / (res["roofline_d2h_gbps"] * 1e9) * 1e6
        res["link_h2d_us"] = ob / (res["roofline_h2d_gbps"] * 1e9) * 1e6
        res["lone_store_overhead_us"] = res["lone_store_us"] - res["link_d2h_us"]
        res["lone_retrieve_overhead_us"] = res["lone_retrieve_us"] - res["link_h2d_us"]
        res["ping_us"] = statistics.median(pings) * 1e6
        if trace.POINTS is not None:
            res["lone_rids"] = rids  # turned into lone_stages by transfer_bench.stages.report
        res["zmq_echo_us"] = ctx.zmq_us
        main.flush()

        # baselines in this process, on the same shapes and blocks
        nb = max(2, min(n, int(a.baseline_bytes // ob)))
        res["baseline_chunks"] = nb
        bs = ctx.streams[0]
        for name, fn in (("torch_per_layer", torch_baseline), ("batched_dma", dma_baseline)):
            try:
                res[name] = fn(pages, blocks, chunk_size, nb, ob, ctx.host[0], bs, a.iters)
            except Exception as exc:  # noqa: BLE001 - one failing baseline prints n/a
                res[name] = {"error": f"{type(exc).__name__}: {exc}"}
                say(f"  baseline {name} failed: {res[name]['error']}")

        # ratios
        res["store_vs_roofline"] = res["store_gbps"] / res["roofline_d2h_gbps"]
        res["retrieve_vs_roofline"] = res["retrieve_gbps"] / res["roofline_h2d_gbps"]
        res["bidir_vs_roofline"] = res["bidir_gbps"] / res["roofline_bidir_gbps"]
        for name in ("torch_per_layer", "batched_dma"):
            b = res[name]
            for op in ("store", "retrieve"):
                if b.get(f"{op}_gbps"):
                    res[f"{op}_vs_{name}"] = res[f"{op}_gbps"] / b[f"{op}_gbps"]
    finally:
        torch.cuda.synchronize()
        main.unregister(reg)
    res["point_s"] = time.perf_counter() - t_start
    return res


def _trace_lone(rids: list[int], rid: int, points) -> None:
    """--trace: the benchmark's own points of one lone request (see `transfer_bench.stages`)."""
    if trace.POINTS is not None:
        rids.append(rid)
        for stage, t_ns in points:
            trace.point_at(rid, stage, t_ns)
