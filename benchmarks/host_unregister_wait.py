"""What ``cudaHostUnregister`` costs while the GPU is busy: why an engine's fence words
(`kvdepot.client.staging.FenceWords`) are retired, never unregistered, while its process lives.

With one stream running a kernel of about a second, this measures:

* ``unregister_same_thread_ms``: an unregister of page-locked, mapped host memory (how the
  fence words were released, also from a garbage collection's finalizer);
* ``main_thread_ops_during_bg_unregister``: a kernel launch, an async host-to-device copy and an
  event record + query on another stream, by another thread, while a background thread
  unregisters (three rounds, ms each);
* ``main_thread_ops_no_unregister``: the same calls with the stream busy and no unregister;
* ``register_mapped_while_busy_ms``: registering a new fence (a registration's start).

    python benchmarks/host_unregister_wait.py [--out result.json]

Needs a CUDA GPU and the kernel library (``kvdepot build-kernels``).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch

from kvdepot.gpu.kernels import load_kernels
from kvdepot.gpu.shm import create_memfd

FENCE_BYTES = 4096 * 8  # `kvdepot.client.staging.FENCE_WORDS` words


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    k = load_kernels()
    if k is None:
        raise SystemExit("the kernel library does not load (kvdepot build-kernels)")
    x = torch.ones(1 << 20, device="cuda")
    pinned = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    busy, other = torch.cuda.Stream(), torch.cuda.Stream()
    keep = []

    def fence() -> int:
        fd, mem = create_memfd("unregister-bench", FENCE_BYTES)
        keep.append((fd, mem))
        k.host_register_mapped(mem.data_ptr(), FENCE_BYTES)
        return mem.data_ptr()

    def ops() -> dict[str, float]:
        t = {}
        t0 = time.perf_counter()
        with torch.cuda.stream(other):
            x.mul(2)
        t["launch_ms"] = 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.cuda.stream(other):
            dev.copy_(pinned, non_blocking=True)
        t["h2d_async_ms"] = 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        ev = torch.cuda.Event()
        ev.record(other)
        ev.query()
        t["event_ms"] = 1e3 * (time.perf_counter() - t0)
        return t

    def sleep_busy() -> None:
        with torch.cuda.stream(busy):
            torch.cuda._sleep(2_000_000_000)  # about a second

    ops()  # every kernel's first launch (a lazy load may wait for the device) before the checks
    torch.cuda.synchronize()
    out = {}
    ptr = fence()
    sleep_busy()
    t0 = time.perf_counter()
    k.host_unregister(ptr)
    out["unregister_same_thread_ms"] = 1e3 * (time.perf_counter() - t0)
    torch.cuda.synchronize()

    ptr = fence()
    sleep_busy()
    took = {}

    def unregister() -> None:
        t = time.perf_counter()
        k.host_unregister(ptr)
        took["ms"] = 1e3 * (time.perf_counter() - t)

    th = threading.Thread(target=unregister)
    th.start()
    time.sleep(0.05)
    out["main_thread_ops_during_bg_unregister"] = [ops() for _ in range(3)]
    th.join()
    out["unregister_bg_thread_ms"] = took["ms"]
    torch.cuda.synchronize()

    sleep_busy()
    out["main_thread_ops_no_unregister"] = [ops() for _ in range(3)]
    t0 = time.perf_counter()
    fence()
    out["register_mapped_while_busy_ms"] = 1e3 * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
