"""The roofline of the many-engines case on several GPUs (`--gpus N`): every GPU's PCIe link
busy at once, as the engines keep them.

One process per GPU (spawned: a CUDA context each, as the engine processes have) copies its
share of the bytes between pinned host memory (allocated by that process, so first touch
places it near the CPU the process runs on) and its GPU. The processes start each measurement
together at a barrier and report their ``time.monotonic`` start and end (one clock for every
process on Linux); a measurement's aggregate GB/s is all GPUs' bytes over the span from the
first start to the last end, and the figure is the median of ``iters`` measurements after a
warm-up, as `transfer_bench.timing.timed` takes for one GPU.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time

from transfer_bench.procs import reaped

KINDS = ("d2h", "h2d", "bidir")
_BARRIER_TIMEOUT_S = 300.0


def pinned_copies(dev, nbytes: int) -> dict:
    """Per kind in `KINDS`, a callable that copies ``nbytes`` between pinned host memory and
    ``dev`` (a ``torch.device``) and returns once the copy ended: D2H, H2D, or one of each at
    once on two streams (2 x ``nbytes``). The buffers live as long as the callables."""
    import torch

    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    devb = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2)]
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def copy(pairs) -> None:
        for s, (dst, src) in zip((s1, s2), pairs):
            with torch.cuda.stream(s):
                dst.copy_(src, non_blocking=True)
        s1.synchronize()
        s2.synchronize()

    pairs = {"d2h": [(host[0], devb[0])], "h2d": [(devb[0], host[0])],
             "bidir": [(host[0], devb[0]), (devb[1], host[1])]}
    return {kind: (lambda kind=kind: copy(pairs[kind])) for kind in KINDS}


def _copier_main(gpu: int, nbytes: int, iters: int, barrier, results) -> None:
    """One GPU's copies: per kind a warm-up, then ``iters`` copies each started at the barrier;
    puts ``(gpu, kind, i, t0, t1)`` per copy, or ``(gpu, "error", message, 0, 0)``."""
    import torch

    try:
        dev = torch.device("cuda", gpu)
        torch.cuda.set_device(dev)
        copies = pinned_copies(dev, nbytes)
        for kind in KINDS:
            copies[kind]()
            for i in range(iters):
                barrier.wait(_BARRIER_TIMEOUT_S)
                t0 = time.monotonic()
                copies[kind]()
                results.put((gpu, kind, i, t0, time.monotonic()))
    except BaseException as exc:
        results.put((gpu, "error", f"{type(exc).__name__}: {exc}", 0.0, 0.0))
        barrier.abort()
        raise


def all_gpus_roofline(bytes_per_gpu: int, gpus: int, iters: int) -> dict:
    """Pinned copies of ``bytes_per_gpu`` on GPUs 0..``gpus``-1 at once: aggregate GB/s D2H, H2D
    and both ways at once (see the module docstring).

    Raises:
        RuntimeError: a copier process failed (its error is in the message) or hung.
    """
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(gpus)
    results = ctx.Queue()
    procs = [ctx.Process(target=_copier_main, args=(g, bytes_per_gpu, iters, barrier, results), daemon=True)
             for g in range(gpus)]
    for p in procs:
        p.start()
    rows = []
    with reaped(procs):
        for _ in range(gpus * iters * len(KINDS)):
            r = results.get(timeout=_BARRIER_TIMEOUT_S)
            if r[1] == "error":
                raise RuntimeError(f"roofline on GPU {r[0]}: {r[2]}")
            rows.append(r)
    out: dict = {"kind": f"pinned cudaMemcpy on {gpus} GPUs at once, one process each", "gpus": gpus}
    for kind in KINDS:
        total = gpus * bytes_per_gpu * (2 if kind == "bidir" else 1)
        spans = []
        for i in range(iters):
            mine = [r for r in rows if r[1] == kind and r[2] == i]
            spans.append(max(r[4] for r in mine) - min(r[3] for r in mine))
        out[kind] = total / statistics.median(spans) / 1e9
    return out
