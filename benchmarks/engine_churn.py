"""Does an engine that registers and leaves hold up the daemon's transfers for the engines that
stay? (GPU.)

An engine that leaves makes the daemon release what it mapped of it: the CUDA IPC mappings of
its KV caches and staging ring (``cudaIpcCloseMemHandle``) and its fence words
(``cudaHostUnregister``). Engine side, an unregister of page-locked memory waited until the
device was idle and held other threads' launches meanwhile; this measures what the daemon's releases cost the engines that stay.

A steady engine (this process, Llama-3.1-8B's KV shape, engine-side staging) retrieves the same
``--chunks`` cached chunks again and again, each retrieve waited for on the CPU, and records
each one's wall time. Phases alternate: quiet (nothing else registered), then churn (a second
engine process registers a small KV cache with engine-side staging, stores one chunk,
unregisters and closes, every ``--churn-interval-s``). Per phase: the steady retrieves' median,
p99 and max ms, next to their bytes' time at the same run's pinned host-to-device roofline, and
the churn cycles run.

    python benchmarks/engine_churn.py [--seconds 4] [--rounds 2] [--out result.json]

Needs a CUDA GPU and the kernel library (``kvdepot build-kernels``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from connector_bench.timers import pct
from transfer_bench.engines import roofline_gbps
from transfer_bench.procs import DaemonProc  # noqa: E402

from kvdepot.client import KVDepotClient  # noqa: E402
from kvdepot.client.kvcache import KVGroupShape, ShmKVCache  # noqa: E402

CHUNK = 256  # tokens per chunk
LLAMA8B = [KVGroupShape(0, 32, 8, 128, 16, torch.bfloat16)]
SMALL = [KVGroupShape(0, 4, 8, 128, 16, torch.bfloat16)]


def _register(client: KVDepotClient, cache: ShmKVCache, name: str):
    return client.register(name, "tp0of1", CHUNK, cache.storage_specs(), cache.layer_specs(), cache.group_specs(),
                           device=cache.register_device, local_storages=[cache.storage])


def churn(endpoint: str, stop_path: str, interval_s: float, out_path: str) -> int:
    """The leaving engine: register, store a chunk, unregister, close; until ``stop_path`` exists."""
    cache = ShmKVCache(SMALL, 64, "LBNHC", device=torch.device("cuda"))
    cache.storage.random_(0, 256)
    torch.cuda.synchronize()
    rng, cycles, spent = random.Random(5), 0, []
    while not os.path.exists(stop_path):
        t0 = time.perf_counter()
        with KVDepotClient(endpoint, timeout_s=60) as c:
            reg = _register(c, cache, "churn")
            keys = reg.keys([rng.randrange(50000) for _ in range(CHUNK)])
            c.store(reg, keys, [list(range(1, CHUNK // 16 + 1))], after=torch.cuda.current_stream())
            c.unregister(reg)
        spent.append(time.perf_counter() - t0)
        cycles += 1
        time.sleep(interval_s)
    Path(out_path).write_text(json.dumps({"cycles": cycles, "cycle_ms_median": 1e3 * statistics.median(spent)
                                          if spent else None}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--l1-bytes", default="8g")
    p.add_argument("--chunks", type=int, default=16, help="chunks per steady retrieve (default 16)")
    p.add_argument("--seconds", type=float, default=4.0, help="length of each phase")
    p.add_argument("--rounds", type=int, default=2, help="quiet + churn phase pairs")
    p.add_argument("--churn-interval-s", type=float, default=0.05)
    p.add_argument("--out", default="")
    p.add_argument("--churner", nargs=4, metavar=("ENDPOINT", "STOP", "INTERVAL_S", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.churner:
        return churn(a.churner[0], a.churner[1], float(a.churner[2]), a.churner[3])
    with tempfile.TemporaryDirectory() as td:
        d = DaemonProc(a.l1_bytes, [], os.path.join(td, "daemon.log"), pin=True)
        try:
            d.wait_ready()
            d.wait_pinned(120)
            blocks_per_chunk = CHUNK // 16
            cache = ShmKVCache(LLAMA8B, 2 * a.chunks * blocks_per_chunk + 8, "LBNHC", device=torch.device("cuda"))
            cache.storage.random_(0, 256)
            torch.cuda.synchronize()
            c = KVDepotClient(d.endpoint, timeout_s=60)
            reg = _register(c, cache, "steady")
            keys = reg.keys([random.Random(1).randrange(50000) for _ in range(a.chunks * CHUNK)])
            src = [list(range(1, a.chunks * blocks_per_chunk + 1))]
            dst = [list(range(a.chunks * blocks_per_chunk + 1, 2 * a.chunks * blocks_per_chunk + 1))]
            assert c.store(reg, keys, src, after=torch.cuda.current_stream()).stored == a.chunks
            link_gbps = roofline_gbps(512 << 20, "cuda", 5)["h2d"]  # the same run's pinned copies
            stream = torch.cuda.current_stream()

            def phase(seconds: float) -> list[float]:
                times, end = [], time.perf_counter() + seconds
                while time.perf_counter() < end:
                    t0 = time.perf_counter()
                    n = c.submit_retrieve(reg, keys, dst).result(before=stream, cpu_wait=True)
                    stream.synchronize()
                    times.append(time.perf_counter() - t0)
                    assert n == a.chunks
                return times

            phase(1.0)  # warm-up
            phases = []
            for r in range(a.rounds):
                for kind in ("quiet", "churn"):
                    proc = stop = None
                    if kind == "churn":
                        stop = os.path.join(td, f"stop{r}")
                        cout = os.path.join(td, f"churn{r}.json")
                        proc = subprocess.Popen([sys.executable, __file__, "--churner", d.endpoint, stop,
                                                 str(a.churn_interval_s), cout])
                        time.sleep(3.0)  # its CUDA context and first registration
                    times = phase(a.seconds)
                    row = {"phase": kind, "round": r, "retrieves": len(times),
                           "ms_median": 1e3 * statistics.median(times),
                           "ms_p99": 1e3 * pct(times, 0.99),
                           "ms_max": 1e3 * max(times)}
                    if proc is not None:
                        Path(stop).touch()
                        proc.wait(timeout=60)
                        row.update(json.loads(Path(cout).read_text()))
                    phases.append(row)
                    print(json.dumps(row), flush=True)
            obj = reg.object_bytes
            out = {"chunks": a.chunks, "object_bytes": obj, "roofline_h2d_gbps": link_gbps,
                   "link_ms_per_retrieve": 1e3 * a.chunks * obj / link_gbps / 1e9, "phases": phases}
            c.unregister(reg)
            c.close()
        finally:
            d.stop()
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
