"""What a GIL-dropping ctypes call costs the calling thread while another Python thread is busy
(no GPU needed).

The vLLM connector's engine thread launches kernels through ctypes (`kvdepot.gpu.kernels`) while
its transfer thread runs Python. A ``ctypes.CDLL`` call drops the GIL; if the other thread takes
it, the caller waits until that thread blocks or the interpreter's switch interval (5 ms) forces
it off. A ``ctypes.PyDLL`` call keeps the GIL. This times a trivial C call (``getpid``) both ways,
alone (the baseline) and beside a thread that alternates ~50-100 us of Python with a 100 us wait,
roughly like the transfer thread's passes.

    python benchmarks/gil_handoff.py [--calls 3000] [--out results.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import queue
import statistics
import threading
import time


def _busy(stop: threading.Event) -> None:
    q: queue.SimpleQueue = queue.SimpleQueue()
    while not stop.is_set():
        x = 0
        for i in range(3000):
            x += i
        try:
            q.get(timeout=100e-6)
        except queue.Empty:
            pass


def _time_calls(fn, calls: int) -> dict:
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        y = 0
        for i in range(200):  # the caller's own Python between calls
            y += i
    ts.sort()
    return {"mean_us": 1e6 * statistics.fmean(ts), "median_us": 1e6 * ts[len(ts) // 2],
            "p99_us": 1e6 * ts[int(0.99 * len(ts))]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args()
    libs = {"CDLL (drops the GIL)": ctypes.CDLL(None).getpid, "PyDLL (keeps the GIL)": ctypes.PyDLL(None).getpid}
    out = {}
    for setting in ("alone", "beside a busy thread"):
        stop = threading.Event()
        th = None
        if setting != "alone":
            th = threading.Thread(target=_busy, args=(stop,), daemon=True)
            th.start()
        for name, fn in libs.items():
            out[f"{setting}: {name}"] = _time_calls(fn, args.calls)
        stop.set()
        if th is not None:
            th.join()
    for key, r in out.items():
        base = out["alone: " + key.split(": ", 1)[1]]
        print(f"{key:45} mean {r['mean_us']:7.1f} us  median {r['median_us']:5.1f}  p99 {r['p99_us']:7.1f}"
              f"  (p99 {r['p99_us'] / base['p99_us']:.1f}x alone)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
