"""The many-engines case: N engine processes (each its own KV cache, client and registration;
on one GPU, spread over ``--gpus`` GPUs, or CPU engines in shared memory with
``--engine-device cpu``) against one daemon. Engine i runs on GPU ``i % gpus``. Three phases,
all engines released together by a barrier: every engine stores fresh chunks, every engine
retrieves them, then half the engines store new chunks while the other half retrieve (with at
least two engines per GPU, each GPU has engines of both halves). Each engine keeps ``--outstanding`` one-chunk requests in flight (`submit_store` /
`submit_retrieve` on one client, as an engine's worker would).

Per phase: the aggregate GB/s (all engines' bytes over the span from the first engine's start
to the last one's end, ``time.monotonic`` being one clock for every process on Linux), next to
the same run's roofline (pinned ``cudaMemcpy`` of as many bytes D2H, H2D and both at once; on
several GPUs all of them at once, `transfer_bench.gpus`, next to one GPU's alone; with CPU
engines a host ``memcpy``), and the daemon process's CPU time over the phase in cores
(``/proc/<pid>/stat``; only for a daemon started here).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import queue
import time

import torch

from transfer_bench.gpus import KINDS, all_gpus_roofline, pinned_copies
from transfer_bench.procs import busy_text, busy_threads, process_cpu_s, reaped, thread_cpu_s
from transfer_bench.shapes import SHAPES

PHASES = ("store", "retrieve", "mixed")
_BARRIER_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class EngineJob:
    """What one engine process does (spawned: plain, picklable values)."""

    index: int
    endpoint: str
    shape: str  # a `transfer_bench.shapes.SHAPES` name
    chunk_size: int
    chunks: int  # chunks each phase moves per engine
    outstanding: int
    device: str  # "cuda" or "cpu"
    staging_bytes: int
    gpu: int = 0  # the CUDA device index (CUDA engines)
    stores_in_mixed: bool = True  # the third phase: store (else retrieve)


def _engine_main(job: EngineJob, barrier, results) -> None:
    """One engine process: register, then per phase wait for the barrier, run its requests,
    report ``(index, phase, op, t0, t1, chunks done, object bytes)`` and wait again."""
    from kvdepot.client import KVDepotClient
    from kvdepot.client.kvcache import ShmKVCache
    from transfer_bench.baselines import Blocks
    from transfer_bench.workload import _Work, fresh_keys, retrieve_pipelined, store_pipelined

    shape = next(s for s in SHAPES if s.name == job.shape)
    cuda = job.device == "cuda"
    dev = torch.device("cuda", job.gpu) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    max_tokens = job.chunks * job.chunk_size
    num_blocks = [2 * max_tokens // g.tokens_per_block + 16 for g in shape.groups]
    cache = ShmKVCache(list(shape.groups), num_blocks, shape.layout, device=dev)
    client = KVDepotClient(job.endpoint, timeout_s=120, name=f"many-{job.index}")
    try:
        cache.storage.random_()
        staged = dict(local_storages=[cache.storage], staging_bytes=job.staging_bytes) if cuda else {}
        reg = client.register(f"bench-many-{job.index}/{shape.name}", shape.shard, job.chunk_size,
                              cache.storage_specs(), cache.layer_specs(), cache.group_specs(),
                              device=cache.register_device, storage_fds=cache.storage_fds(), **staged)
        if cuda and reg.staging is None:
            raise RuntimeError("engine-side staging is off (no kernel library here or in the daemon)")
        blocks = Blocks(shape, max_tokens, num_blocks)
        src = [blocks.chunk("src", j, job.chunk_size) for j in range(job.chunks)]
        dst = [blocks.chunk("dst", j, job.chunk_size) for j in range(job.chunks)]
        stream = torch.cuda.Stream(dev) if cuda else None
        stored = fresh_keys(reg, job.chunks, job.chunk_size)
        for phase in PHASES:
            if phase == "store" or (phase == "mixed" and job.stores_in_mixed):
                op, keys = "store", (stored if phase == "store" else fresh_keys(reg, job.chunks, job.chunk_size))
                work = _Work(zip(keys, src))
                fn = store_pipelined(client, reg, stream, work, job.outstanding)
            else:
                op, work = "retrieve", _Work(zip(stored, dst))
                fn = retrieve_pipelined(client, reg, stream, work, job.outstanding)
            barrier.wait(_BARRIER_TIMEOUT_S)
            t0 = time.monotonic()
            fn()
            if stream is not None:
                stream.synchronize()
            t1 = time.monotonic()
            results.put((job.index, phase, op, t0, t1, work.done, reg.object_bytes))
            barrier.wait(_BARRIER_TIMEOUT_S)
        client.unregister(reg)
    except BaseException as exc:
        results.put((job.index, "error", f"{type(exc).__name__}: {exc}", 0.0, 0.0, 0, 0))
        barrier.abort()
        raise
    finally:
        client.close()
        cache.close()


def roofline_gbps(total_bytes: int, device: str, iters: int) -> dict:
    """The same bytes copied once: pinned D2H, H2D and both at once (CUDA), or a host memcpy
    (CPU engines, reported for every direction)."""
    from transfer_bench.timing import timed

    if device == "cpu":
        a = torch.empty(total_bytes, dtype=torch.uint8)
        b = torch.empty(total_bytes, dtype=torch.uint8)
        t = timed(lambda: b.copy_(a), iters)
        return {"d2h": total_bytes / t / 1e9, "h2d": total_bytes / t / 1e9, "bidir": total_bytes / t / 1e9,
                "kind": "host memcpy"}
    copies = pinned_copies(torch.device("cuda", torch.cuda.current_device()), total_bytes)
    out = {kind: (2 if kind == "bidir" else 1) * total_bytes / timed(copies[kind], iters) / 1e9 for kind in KINDS}
    out["kind"] = "pinned cudaMemcpy"
    return out


def run_many_engines(endpoint: str, daemon_pid: int | None, engines: int, shape_name: str, chunk_size: int,
                     outstanding: int, bytes_per_phase: float, device: str, iters: int, gpus: int = 1) -> dict:
    """Run the three phases with ``engines`` engine processes on ``gpus`` GPUs (CUDA engines);
    returns the figures (see the module docstring).

    Raises:
        RuntimeError: an engine failed (its error is in the message) or a phase hung.
    """
    shape = next(s for s in SHAPES if s.name == shape_name)
    ob = shape.token_bytes * chunk_size
    chunks = max(2 * outstanding, int(bytes_per_phase // (engines * ob)))
    # the ring holds every request in flight twice over
    staging_bytes = max(64 << 20, 2 * (outstanding + 1) * ob)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(engines + 1)
    results = ctx.Queue()
    gpus = gpus if device == "cuda" else 1
    # the third phase's halves: with two engines or more per GPU, each GPU has engines of both
    per_gpu_both = engines >= 2 * gpus

    def job(i: int) -> EngineJob:
        stores = (i // gpus) % 2 == 0 if per_gpu_both else i % 2 == 0
        return EngineJob(i, endpoint, shape_name, chunk_size, chunks, outstanding, device, staging_bytes,
                         i % gpus, stores)

    procs = [ctx.Process(target=_engine_main, daemon=True, args=(job(i), barrier, results)) for i in range(engines)]
    for p in procs:
        p.start()
    out: dict = {"engines": engines, "gpus": gpus, "shape": shape_name, "chunk_tokens": chunk_size, "object_bytes": ob,
                 "chunks_per_engine": chunks, "outstanding": outstanding, "device": device, "phases": {}}
    with reaped(procs):
        for phase in PHASES:
            try:
                barrier.wait(_BARRIER_TIMEOUT_S)  # every engine registered (first phase) and ready
                cpu0, w0 = (process_cpu_s(daemon_pid) if daemon_pid else 0.0), time.monotonic()
                th0 = thread_cpu_s(daemon_pid) if daemon_pid else {}
                barrier.wait(_BARRIER_TIMEOUT_S)  # every engine finished the phase
                cpu1, w1 = (process_cpu_s(daemon_pid) if daemon_pid else 0.0), time.monotonic()
                th1 = thread_cpu_s(daemon_pid) if daemon_pid else {}
            except Exception:  # noqa: BLE001 - a broken barrier: an engine failed; its error is queued
                errors = []
                with_timeout = time.monotonic() + 5
                while time.monotonic() < with_timeout:
                    try:
                        r = results.get(timeout=0.5)
                    except queue.Empty:
                        break
                    if r[1] == "error":
                        errors.append(f"engine {r[0]}: {r[2]}")
                raise RuntimeError(f"phase {phase}: " + ("; ".join(errors) or "an engine did not finish")) from None
            rows = [results.get(timeout=60) for _ in range(engines)]
            span_s = max(r[4] for r in rows) - min(r[3] for r in rows)
            by_op = {op: sum(r[5] * r[6] for r in rows if r[2] == op) for op in ("store", "retrieve")}
            done = {op: sum(r[5] for r in rows if r[2] == op) for op in ("store", "retrieve")}
            expected = {op: chunks * sum(1 for r in rows if r[2] == op) for op in ("store", "retrieve")}
            out["phases"][phase] = {
                "span_s": span_s, "store_gbps": by_op["store"] / span_s / 1e9,
                "retrieve_gbps": by_op["retrieve"] / span_s / 1e9,
                "gbps": (by_op["store"] + by_op["retrieve"]) / span_s / 1e9,
                "chunks_done": done, "chunks_expected": expected,
                "daemon_cores": (cpu1 - cpu0) / (w1 - w0) if daemon_pid else None,
                "daemon_threads": busy_threads(th0, th1, w1 - w0) if daemon_pid else {}}
    total = engines * chunks * ob
    if gpus > 1:
        roof = all_gpus_roofline(total // gpus, gpus, iters)
        out["one_gpu_roofline"] = roofline_gbps(total // gpus, device, iters)
    else:
        roof = roofline_gbps(total, device, iters)
    out["roofline"] = roof
    ph = out["phases"]
    out["store_vs_roofline"] = ph["store"]["gbps"] / roof["d2h"]
    out["retrieve_vs_roofline"] = ph["retrieve"]["gbps"] / roof["h2d"]
    out["mixed_vs_roofline"] = ph["mixed"]["gbps"] / roof["bidir"]
    return out


def format_many(r: dict) -> str:
    """The result as the lines the benchmark prints."""
    ph, roof = r["phases"], r["roofline"]

    def cores(p: str) -> str:
        c = ph[p]["daemon_cores"]
        if c is None:
            return "n/a"
        busy = busy_text(ph[p].get("daemon_threads", {}))
        return f"{c:.2f}" + (f" ({busy})" if busy else "")

    short = [f"{p}: {ph[p]['chunks_done']} of {ph[p]['chunks_expected']}" for p in PHASES
             if ph[p]["chunks_done"] != ph[p]["chunks_expected"]]
    gpus = r.get("gpus", 1)
    one = r.get("one_gpu_roofline")
    where = f"{r['device']}, {gpus} GPUs" if gpus > 1 else r["device"]
    return (f"{r['engines']} engine processes ({where}), {r['shape']} chunk {r['chunk_tokens']}, "
            f"{r['outstanding']} in flight each, {r['chunks_per_engine']} chunks per engine per phase:\n"
            f"  store {ph['store']['gbps']:.1f} GB/s = {100 * r['store_vs_roofline']:.1f}% of {roof['d2h']:.1f}; "
            f"retrieve {ph['retrieve']['gbps']:.1f} = {100 * r['retrieve_vs_roofline']:.1f}% of {roof['h2d']:.1f}; "
            f"half storing + half retrieving {ph['mixed']['gbps']:.1f} = {100 * r['mixed_vs_roofline']:.1f}% of "
            f"{roof['bidir']:.1f} both ways ({roof['kind']})\n"
            + (f"  one GPU alone: {one['d2h']:.1f} / {one['h2d']:.1f} / {one['bidir']:.1f} GB/s (d2h / h2d / both); "
               f"all {gpus} at once {roof['d2h'] / one['d2h']:.2f}x / {roof['h2d'] / one['h2d']:.2f}x / "
               f"{roof['bidir'] / one['bidir']:.2f}x of it\n" if one else "")
            + f"  daemon CPU, cores: store {cores('store')}, retrieve {cores('retrieve')}, mixed {cores('mixed')}"
            + (f"\n  WARNING: short phases: {'; '.join(short)} (L1 too small?)" if short else ""))


def evaluate_many(r: dict) -> list[dict]:
    """The many-engines goals. One GPU: >= 97% of the roofline each way, >= 95% both ways, the
    daemon below one core in every phase (when measured). Several GPUs: >= 90% of the all-GPU
    roofline each way and both ways at chunks of 256 tokens and more (smaller chunks are
    reported, not judged), the daemon below one core per two GPUs."""
    out = []
    gpus = r.get("gpus", 1)
    tag = f"{r['engines']} engines {r['shape']} chunk {r['chunk_tokens']}" + (f" on {gpus} GPUs" if gpus > 1 else "")
    limits = (("store_vs_roofline", 0.97), ("retrieve_vs_roofline", 0.97), ("mixed_vs_roofline", 0.95))
    max_cores = 1.0
    if gpus > 1:
        limits = (("store_vs_roofline", 0.90), ("retrieve_vs_roofline", 0.90), ("mixed_vs_roofline", 0.90))
        limits = limits if r["chunk_tokens"] >= 256 else ()
        max_cores = gpus / 2
    for key, limit in limits:
        out.append({"target": f"{tag}: {key.split('_')[0]} >= {100 * limit:.0f}% of roofline", "value": r[key],
                    "limit": limit, "pass": r[key] >= limit})
    for p in PHASES:
        c = r["phases"][p]["daemon_cores"]
        if c is not None:
            out.append({"target": f"{tag}: daemon below {max_cores:g} core{'s' if max_cores != 1 else ''} ({p})",
                        "value": c, "limit": max_cores, "pass": c < max_cores})
    return out
