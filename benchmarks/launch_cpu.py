"""What the engine side's kernel-library calls cost the thread that makes them, inside a run of
`benchmarks/vllm_connector.py` (GPU): per thread (the engine's main thread; the workers'
``kvdepot-*`` transfer threads) and per call (``engine_gather``, which also enqueues a staged
store's fence-word write; ``engine_gather_pieces``, the same for all pieces of a job at once;
``engine_signal``; ``engine_scatter``), the wall time and the
thread's CPU time (``time.thread_time``) of each call, median and p90.

Why both: a call that waits for the GIL back (ctypes drops it; the other thread may hold it)
sleeps, so its wall time grows and its CPU time does not; a launch that is slow in the CUDA
driver spends CPU. ``wall - cpu`` is the GIL's share.

    python benchmarks/launch_cpu.py [--ring-pieces 4] [vllm_connector.py's options...]

``--ring-pieces N``: a job's pieces are at most 1/N of the staging ring (the connector's own
split is 1/4, `kvdepot.client.vllm.jobs.JobPieces._piece_chunks`): fewer, larger pieces mean
fewer launches and messages per step, and fewer pieces in flight. A diagnosis: the connector
has no such setting.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CALLS = ("engine_gather", "engine_gather_pieces", "engine_signal", "engine_scatter")


def _wrap(records: dict, kernels_cls, name: str) -> None:
    orig = getattr(kernels_cls, name)

    def timed(self, *args, **kwargs):
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return orig(self, *args, **kwargs)
        finally:
            thread = threading.current_thread().name.split("-")[0]  # "MainThread" / "kvdepot"
            records[thread, name].append((time.perf_counter() - w0, time.thread_time() - c0))

    setattr(kernels_cls, name, timed)


def _report(records: dict) -> list[str]:
    lines = []
    for (thread, name), xs in sorted(records.items()):
        wall = sorted(w for w, _ in xs)
        cpu = sorted(c for _, c in xs)
        lines.append(f"{thread:10} {name:15} {len(xs):5} calls: wall median {1e6 * wall[len(wall) // 2]:6.1f} p90 "
                     f"{1e6 * wall[int(0.9 * len(wall))]:6.1f} us; CPU median {1e6 * cpu[len(cpu) // 2]:6.1f} p90 "
                     f"{1e6 * cpu[int(0.9 * len(cpu))]:6.1f} us; mean wall - CPU "
                     f"{1e6 * statistics.fmean(w - c for w, c in xs):6.1f} us")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--ring-pieces", type=int, default=0)
    args, rest = p.parse_known_args(argv)
    import vllm_connector as bench  # installs vLLM's stubs before the connector is imported

    import kvdepot.gpu.kernels as kernels_mod

    records: dict = collections.defaultdict(list)
    for name in CALLS:
        _wrap(records, kernels_mod.Kernels, name)
    if args.ring_pieces:
        from kvdepot.client.vllm import jobs

        def piece_chunks(self, n=args.ring_pieces):
            kvreg = self.side.kvreg
            if kvreg is None or kvreg.staging is None:
                return 1 << 30
            return max(1, kvreg.staging.ring.size_bytes // n // kvreg.object_bytes)

        jobs.JobPieces._piece_chunks = piece_chunks
    rc = bench.main(rest)
    print("\n".join(_report(records)))
    return rc


if __name__ == "__main__":
    sys.exit(main())
