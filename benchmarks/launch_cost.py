"""What one engine-side gather call (`Kernels.engine_gather`: the fused gather launch, plus the
fence word's ``cuStreamWriteValue64`` when a word is given) costs the calling thread's CPU on a
GPU host, by itself and in the conditions of a vLLM engine: after a torch "forward" on the same
stream, on the legacy default stream, and while another thread of the process makes CUDA
calls; the same for a two-group engine (gpt-oss-20b's shape), whose groups go in fused
launches, a store of three pieces by one call (`Kernels.engine_gather_pieces`), and while
another process on the GPU copies over PCIe and / or spins on its events, or copies out of this
process's ring through CUDA IPC (as the daemon does); and with the CPU caches flushed before each
call, or after a 1 ms sleep (an engine's step runs its forward, vLLM's scheduler and Python for
milliseconds between two such calls). Next to it,
in the same run, the references: one torch kernel launch (``x.add_(1)``), a
``torch.cuda.Event.record``, the fence word's write alone, and a trivial ctypes call into the
kernel library (the call's own floor).

Why: inside `benchmarks/vllm_connector.py` the engine thread's gather measured 26-31 us of CPU
per call (`benchmarks/launch_cpu.py`, gpt-oss-20b), which is most of a sliding-window model's
``wait_for_save``; this says what the call costs without the connector around it.

Every figure is the median (and p90) of ``time.thread_time`` around the call over ``--calls``
calls (and the median wall time, which also counts a wait for the GIL), the stream synchronized every 100 (50 for the contended cases) calls.

    python benchmarks/launch_cost.py [--calls 3000]

Needs a CUDA GPU and the kernel library (``kvdepot build-kernels``).
"""

from __future__ import annotations

import argparse
import array
import ctypes
import mmap
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu"), str(ROOT / "tests")]

import torch  # noqa: E402

CHUNK = 256
# the other process of the "another process" cases: 64 MiB copies device -> pinned host in a
# loop ("copies"), a thread spinning on cudaEventQuery ("polls"), or both
_OTHER = r"""
import sys, threading, torch
what = sys.argv[1]
dev = torch.device("cuda")
src = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
dst = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
s = torch.cuda.Stream()
def copies():
    while True:
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
        s.synchronize()
def polls():
    ev = torch.cuda.Event()
    q = torch.cuda.Stream()
    while True:
        ev.record(q)
        while not ev.query():
            pass
if "copies" in what:
    threading.Thread(target=copies, daemon=True).start()
if "polls" in what:
    threading.Thread(target=polls, daemon=True).start()
print("running", flush=True)
threading.Event().wait()
"""


def _copy_from(ring: torch.Tensor, ready, stop) -> None:
    """The other process of the IPC case: copies the first 64 MiB of ``ring`` (another process's
    device memory, received through CUDA IPC) to pinned host memory until ``stop``."""
    n = min(64 << 20, ring.numel())
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    s = torch.cuda.Stream()
    ready.set()
    while not stop.is_set():
        with torch.cuda.stream(s):
            dst.copy_(ring[:n], non_blocking=True)
        s.synchronize()


def _median_p90_us(ts: list[float]) -> tuple[float, float]:
    ts = sorted(ts)
    return 1e6 * ts[len(ts) // 2], 1e6 * ts[int(0.9 * len(ts))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=3000, help="calls per figure")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from test_kernels import _cache  # a random-filled shared-memory KV cache

    from kvdepot.client.kvcache import KVGroupShape
    from kvdepot.gpu.kernels import KvdGroupDesc, load_kernels
    from kvdepot.gpu.layout import group_layers

    k = load_kernels()
    if k is None:
        print("the kernel library could not be loaded", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    nb = 60 * CHUNK // 16 + 8

    def engine(groups, seed: int, ring_chunks: int):
        """An engine of ``groups`` (``nb`` random blocks on the GPU) and a ring of ``ring_chunks``
        chunks: (engine handle, 256-aligned ring address, what must stay alive)."""
        src = _cache(groups, "LBNHC", nb, seed)
        lay = group_layers(src.layer_specs(), src.group_specs(), CHUNK, [src.size_bytes])
        blocks = src.storage.to(dev)
        src.close()
        descs = [KvdGroupDesc.from_group(g, lay.object_bytes, lay.chunk_size) for g in lay.groups]
        ptrs = [[blocks.data_ptr() + off for _, off in g.offsets] for g in lay.groups]
        handle = k.engine_create(0, descs, ptrs, lay.chunk_size, lay.object_bytes)
        ring = torch.empty(ring_chunks * lay.object_bytes + 256, dtype=torch.uint8, device=dev)
        return handle, (ring.data_ptr() + 255) // 256 * 256, (blocks, ring, lay)

    # Llama-3.1-8B's per-token KV (32 layers, 8 KV heads, head dim 128, bf16), 16 tokens per block
    eng, base, _keep = engine([KVGroupShape(0, 32, 8, 128, 16, torch.bfloat16)], 1, 50)
    s, side = torch.cuda.Stream(), torch.cuda.Stream()
    dword = torch.zeros(8, dtype=torch.int64, device=dev)
    page = mmap.mmap(-1, 4096)
    hword = k.host_register_mapped(ctypes.addressof(ctypes.c_char.from_buffer(page)), 4096)
    value = [0]

    def nxt() -> int:
        value[0] += 1
        return value[0]

    def cpu(fn, n=args.calls, every=100, before=None) -> tuple[float, float, float]:
        ts, ws = [], []
        for i in range(n):
            if i % every == 0:
                torch.cuda.synchronize()
            if before is not None:
                before()
            w, c = time.perf_counter(), time.thread_time()
            fn()
            ts.append(time.thread_time() - c)
            ws.append(time.perf_counter() - w)
        torch.cuda.synchronize()
        return (*_median_p90_us(ts), _median_p90_us(ws)[0])

    rows = []
    sp = s.cuda_stream
    for nch in (1, 8, 50):
        ids = array.array("i", [b % nb for b in range(nch * 16)])
        rows.append((f"gather {nch} chunk(s) ({nch * 16} block ids), no word",
                     cpu(lambda: k.engine_gather(eng, ids, nch, base, sp))))
        rows.append((f"gather {nch} chunk(s), word in device memory",
                     cpu(lambda: k.engine_gather(eng, ids, nch, base, sp, dword.data_ptr(), nxt()))))
        rows.append((f"gather {nch} chunk(s), word in mapped host memory",
                     cpu(lambda: k.engine_gather(eng, ids, nch, base, sp, hword, nxt()))))
    ids8 = array.array("i", [b % nb for b in range(8 * 16)])

    def gather8(stream_ptr: int) -> None:
        k.engine_gather(eng, ids8, 8, base, stream_ptr, hword, nxt())

    rows.append(("gather 8 chunks + word, legacy default stream", cpu(lambda: gather8(0))))
    kv = [torch.zeros(nb, 2, 16, 8, 128, dtype=torch.bfloat16, device=dev) for _ in range(24)]
    idx = torch.tensor([1, 2, 3], device=dev)

    def forward() -> None:  # one indexed write per layer, on the current stream
        for t in kv:
            t.view(torch.int8)[idx] = 5

    rows.append(("gather 8 + word after a 24-op torch 'forward', default stream",
                 cpu(lambda: gather8(0), n=args.calls // 5, before=forward)))
    with torch.cuda.stream(s):
        rows.append(("gather 8 + word after a 24-op torch 'forward', own stream",
                     cpu(lambda: gather8(sp), n=args.calls // 5, before=forward)))
    stop = [False]

    def recorder() -> None:  # another thread recording and querying events on its stream
        ev = torch.cuda.Event()
        while not stop[0]:
            ev.record(side)
            ev.query()

    def launcher() -> None:  # another thread launching small kernels on its stream
        x = torch.zeros(4, device=dev)
        while not stop[0]:
            with torch.cuda.stream(side):
                x.add_(1)
            time.sleep(0)

    def syncing() -> None:  # another thread reading a small tensor back (a synchronous copy, as .cpu())
        y = torch.zeros(4, device=dev)
        while not stop[0]:
            with torch.cuda.stream(side):
                y.add_(1)
                y.cpu()

    def python() -> None:  # another thread running Python only (the GIL)
        n = 0
        while not stop[0]:
            n += 1

    def bursts() -> None:  # another thread running Python 100 us at a time, then sleeping 100 us
        while not stop[0]:
            t = time.perf_counter() + 100e-6
            while time.perf_counter() < t:
                pass
            time.sleep(100e-6)

    # the same call through ctypes.PyDLL, which keeps the GIL during the call (CDLL drops it)
    pyk = ctypes.PyDLL(k.path).kvd_engine_gather
    pyk.argtypes = k.lib.kvd_engine_gather.argtypes
    ids8_ptr = ids8.buffer_info()[0]

    def gather8_pydll() -> None:
        if pyk(eng, ids8_ptr, 8, base, hword, nxt(), sp) != 0:
            raise RuntimeError("kvd_engine_gather failed")

    rows.append(("gather 8 + word through PyDLL (keeps the GIL)", cpu(gather8_pydll)))
    for name, fn in (("recording / querying events", recorder), ("launching kernels", launcher),
                     ("copying small tensors back (.cpu())", syncing), ("running Python only", python),
                     ("running Python in 100 us bursts", bursts)):
        stop[0] = False
        th = threading.Thread(target=fn, daemon=True)
        th.start()
        rows.append((f"gather 8 + word while another thread is {name}", cpu(lambda: gather8(sp), every=50)))
        if fn in (python, bursts):
            rows.append(("  the same through PyDLL (keeps the GIL)", cpu(gather8_pydll, every=50)))
        stop[0] = True
        th.join()
    # gpt-oss-20b's two KV-cache groups (12 full + 12 sliding-window layers, 8 KV heads, head dim
    # 64, bf16, 16 tokens per block): every group in fused launches (`kvd_engine_gather`), and a
    # 16-chunk store in three pieces by one call (`kvd_engine_gather_pieces`)
    heng, hbase, (hblocks, hring, hlay) = engine([KVGroupShape(0, 12, 8, 64, 16, torch.bfloat16),
                                                  KVGroupShape(1, 12, 8, 64, 16, torch.bfloat16)], 2, 16)
    for nch in (1, 7, 16):
        hids = array.array("i", [b % nb for b in range(nch * 16)] * 2)
        rows.append((f"two groups (gpt-oss): gather {nch} chunk(s) + word",
                     cpu(lambda: k.engine_gather(heng, hids, nch, hbase, sp, hword, nxt()))))
    hids = array.array("i", [b % nb for b in range(16 * 16)] * 2)
    x0 = torch.zeros(16, device=dev)
    ob = hlay.object_bytes
    dsts = array.array("Q", [hbase, hbase + 7 * ob, hbase + 14 * ob])
    pieces = array.array("q", [7, 7, 2])
    words = array.array("Q", [hword] * 3)

    def three() -> None:
        v = nxt()
        k.engine_gather_pieces(heng, hids, dsts, pieces, words, array.array("Q", [v, v, v]), sp)

    rows.append(("two groups (gpt-oss): 16 chunks as 3 pieces, one call, 3 words", cpu(three)))
    # another process on the GPU, as the daemon beside an engine: copying pinned memory over PCIe
    # (its DMA lanes) and/or polling its events from a spinning thread (its completion watcher)
    for what in ("copies", "polls", "copies+polls"):
        other = subprocess.Popen([sys.executable, "-c", _OTHER, what], stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout.readline().strip() == "running"
            rows.append((f"two groups, 16 chunks + word, another process {what}",
                         cpu(lambda: k.engine_gather(heng, hids, 16, hbase, sp, hword, nxt()), n=args.calls // 2)))
            rows.append((f"reference: torch x.add_(1), another process {what}", cpu(lambda: x0.add_(1), n=args.calls // 2)))
        finally:
            other.kill()
            other.wait()
    # between two of an engine's steps its forward, vLLM's scheduler and Python run for
    # milliseconds: the driver's code and data are cold by the next call. Here: 64 MiB of host
    # memory touched (the caches flushed), or a 1 ms sleep, before each call
    flush_buf = bytearray(64 << 20)

    def flush() -> None:
        flush_buf[::4096] = bytes(len(flush_buf) // 4096)  # one write per page
        bytes(flush_buf)  # and a read of all of it

    rows.append(("two groups, 16 chunks + word, caches flushed before each call",
                 cpu(lambda: k.engine_gather(heng, hids, 16, hbase, sp, hword, nxt()), n=300, before=flush)))
    rows.append(("two groups, 16 chunks as 3 pieces by one call, caches flushed", cpu(three, n=300, before=flush)))
    rows.append(("reference: torch x.add_(1), caches flushed", cpu(lambda: x0.add_(1), n=300, before=flush)))
    rows.append(("reference: a trivial ctypes call, caches flushed",
                 cpu(lambda: k.lib.kvd_ipc_handle_bytes(), n=300, before=flush)))
    rows.append(("two groups, 16 chunks + word, 1 ms sleep before each call",
                 cpu(lambda: k.engine_gather(heng, hids, 16, hbase, sp, hword, nxt()), n=300,
                     before=lambda: time.sleep(1e-3))))
    # the daemon's own case: another process copying out of THIS process's staging ring (CUDA IPC)
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    ready, stop_ev = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_copy_from, args=(hring, ready, stop_ev), daemon=True)
    child.start()
    try:
        assert ready.wait(120), "the copying process did not start"
        rows.append(("two groups, 16 chunks + word, another process copies out of our ring (IPC)",
                     cpu(lambda: k.engine_gather(heng, hids, 16, hbase, sp, hword, nxt()), n=args.calls // 2)))
        rows.append(("reference: torch x.add_(1), another process copies out of our ring (IPC)",
                     cpu(lambda: x0.add_(1), n=args.calls // 2)))
    finally:
        stop_ev.set()
        child.join(30)
    rows.append(("reference: the fence word's write alone (mapped host word)", cpu(lambda: k.engine_signal(hword, nxt(), sp))))
    x = torch.zeros(16, device=dev)
    with torch.cuda.stream(s):
        rows.append(("reference: torch x.add_(1), one launch", cpu(lambda: x.add_(1))))
    ev = torch.cuda.Event()
    rows.append(("reference: torch.cuda.Event.record", cpu(lambda: ev.record(s))))
    rows.append(("reference: a trivial ctypes call into the library", cpu(lambda: k.lib.kvd_ipc_handle_bytes())))
    print(f"{torch.cuda.get_device_name()}: CPU of the calling thread per call")
    for name, (med, p90, wall) in rows:
        print(f"  {name:<66} median {med:6.1f} us, p90 {p90:6.1f} (wall median {wall:7.1f})")
    k.engine_destroy(eng)
    k.engine_destroy(heng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
