"""End-to-end STORE / RETRIEVE benchmark through a running kvdepot daemon (CUDA engines).

This process is the engine: it holds a paged KV cache on the GPU (vLLM 0.33 layouts, via
`ShmKVCache(device="cuda")`), registers it with a daemon in another process (real CUDA IPC,
real interprocess events) and times requests from "request sent" to "data in place":

* STORE: ``client.store(..., after=stream)`` returns once the chunk is in the daemon's pinned L1;
  in streams, by default (``--store-reply early``) the daemon replies at enqueue, the engine's
  stream waits for the daemon's gathers, and the clock stops when every chunk is visible to a
  lookup (i.e. in L1);
* RETRIEVE: ``client.retrieve(..., before=stream)`` returns once the copy is enqueued; the
  clock stops after ``stream.synchronize()``, i.e. when the blocks hold the data.

Per (shape, chunk size) it measures, in the same run and on the same bytes:

* roofline: one pinned ``cudaMemcpy`` of all the point's bytes D2H, H2D, and both at once;
* store / retrieve streams: N distinct one-chunk requests, ``--outstanding`` of them in flight
  per direction: by default one thread per direction pipelines them on one client
  (``submit_store`` / ``submit_retrieve``, as an engine's worker would), or with
  ``--client-mode threads`` one blocking request per thread; GB/s = object bytes / wall time;
* both at once: one direction storing new chunks while the other retrieves stored ones;
* lone request: median latency of one-chunk requests minus the bytes' time on the link
  (object bytes / roofline GB/s) = overhead, next to the median of a bare ZMQ ipc round trip
  (DEALER <-> ROUTER echo in a subprocess) and of the daemon's ping. Clients talk to the
  daemon over its stream socket (see kvdepot/protocol/transport.py). A retrieve ends when the
  engine's stream, made to wait on the daemon's event, has synchronized; and again with
  ``cpu_wait`` (the engine thread waits on the event). A store ends at its reply (copied into
  L1), and again when an early store's "stored" event says the bytes are in L1 (``cpu_wait``,
  ``in_l1``); an early store also when the blocks are reusable (stream wait, and ``cpu_wait``);
* baselines in this process: per-layer torch ``index_select`` into staging + one copy
  (``index_copy_`` for retrieve), and batched DMA of raw pages (``cuMemcpyBatchAsync``, one
  copy per (layer, block) page; a per-page ``cuMemcpyAsync`` loop where the batch API is
  missing).

One row per point is printed, and everything is written as JSON (rewritten after each row).
The daemon is started here (``--pin-l1``) unless ``--endpoint`` is given; set
``KVDEPOT_KERNELS_SO`` (``.kbuild/libkvdepot_kernels.so`` is used when present).

    python benchmarks/transfer.py --out benchmarks/results/transfer_h200.json
    python benchmarks/transfer.py --quick
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import zmq

REPO = Path(__file__).resolve().parents[1]
try:
    import kvdepot  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from kvdepot.client import KVDepotClient  # noqa: E402
from kvdepot.client.kvcache import KVGroupShape, ShmKVCache  # noqa: E402


def say(*args) -> None:
    print(*args, flush=True)


# ---------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class Shape:
    """One model shard's KV cache (from tests/data/model_kv_shapes.json)."""

    name: str
    groups: tuple[KVGroupShape, ...]
    layout: str
    shard: str

    @property
    def token_bytes(self) -> int:
        """Object bytes of one token (all layers of all groups)."""
        return sum(g.num_layers * g.token_bytes for g in self.groups)


BF16 = torch.bfloat16
SHAPES = [
    Shape("Llama-3.1-8B TP1", (KVGroupShape(0, 32, 8, 128, 16, BF16),), "LBNHC", "tp0of1"),
    Shape("Llama-3.1-70B TP4", (KVGroupShape(0, 80, 2, 128, 16, BF16),), "LBNHC", "tp0of4"),
    Shape("Llama-3.1-70B TP8", (KVGroupShape(0, 80, 1, 128, 16, BF16),), "LBNHC", "tp0of8"),
    Shape("DeepSeek-V3 MLA", (KVGroupShape(0, 61, 1, 576, 16, BF16, mla=True),), "mla", "replicated"),
    # 12 full + 12 sliding-window layers as two KV-cache groups with different block sizes
    Shape("gpt-oss-20b hybrid", (KVGroupShape(0, 12, 8, 64, 16, BF16), KVGroupShape(1, 12, 8, 64, 32, BF16)),
          "LBNHC", "tp0of1"),
]


def chunks_for(shape: Shape, chunk_size: int, bytes_per_point: float, outstanding: int) -> int:
    """Chunks per stream measurement: about ``bytes_per_point``, at least 2 per thread, at most 512."""
    ob = shape.token_bytes * chunk_size
    return max(2 * outstanding, min(512, int(bytes_per_point // ob)))


# ---------------------------------------------------------------------------- bare ZMQ round trip

_ECHO_SERVER = r"""
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
s.setsockopt(zmq.LINGER, 0)
s.bind(sys.argv[1])
print("ready", flush=True)
while True:
    frames = s.recv_multipart()
    s.send_multipart(frames)
    if frames[-1] == b"stop":
        break
s.close(0)
ctx.term()
"""


def zmq_echo_rtt_us(iters: int = 2000, warmup: int = 200) -> dict:
    """Round trip of a 1-byte message to a ROUTER echo server in another process over ipc://,
    blocking DEALER socket: median / p10 / p90 in microseconds."""
    with tempfile.TemporaryDirectory(prefix="kvd-echo-") as d:
        ep = f"ipc://{d}/echo.sock"
        proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER, ep], stdout=subprocess.PIPE, text=True)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            line = proc.stdout.readline()
            if "ready" not in line:
                raise RuntimeError(f"zmq echo server did not start (rc {proc.poll()})")
            sock.connect(ep)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            ts = []
            for i in range(warmup + iters):
                t0 = time.perf_counter()
                sock.send(b"x")
                sock.recv()
                if i >= warmup:
                    ts.append(time.perf_counter() - t0)
            sock.send(b"stop")
            sock.recv()
        finally:
            sock.close(0)
            ctx.term()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
    q = statistics.quantiles(ts, n=10)
    return {"median_us": statistics.median(ts) * 1e6, "p10_us": q[0] * 1e6, "p90_us": q[-1] * 1e6, "iters": iters}


# ---------------------------------------------------------------------------- daemon


class DaemonProc:
    """``python -m kvdepot serve`` in a subprocess on an ipc endpoint in a temp dir.

    Logs at info level to ``log_path`` so that the end of L1 pinning ("L1 pinned") can be seen.
    """

    def __init__(self, l1_bytes: str, extra_args: list[str], log_path: str | None, pin: bool = True) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvd-bench-")
        self.endpoint = f"ipc://{self.dir}/kvdepot.sock"
        self.log_path = log_path or os.path.join(self.dir, "daemon.log")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        so = REPO / ".kbuild" / "libkvdepot_kernels.so"
        if "KVDEPOT_KERNELS_SO" not in env and so.exists():
            env["KVDEPOT_KERNELS_SO"] = str(so)
        self.kernels_so = env.get("KVDEPOT_KERNELS_SO", "")
        self.pin = pin and "--no-pin-l1" not in extra_args
        cmd = [sys.executable, "-m", "kvdepot", "serve", "--endpoint", self.endpoint, "--l1-bytes", l1_bytes,
               "--pin-l1" if pin else "--no-pin-l1", "--log-level", "info", *extra_args]
        self.cmd = cmd
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=str(REPO),
                                     env=env)
        self._ready = threading.Event()
        threading.Thread(target=self._drain, name="daemon-stdout", daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            if "kvdepot ready" in line:
                self._ready.set()

    def log_tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "".join(Path(self.log_path).read_text(errors="replace").splitlines(True)[-n:])
        return ""

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon not ready after {timeout_s} s:\n{self.log_tail()}")

    def wait_pinned(self, max_s: float) -> tuple[bool, float]:
        """Wait until the daemon logs that L1 is pinned (or a pinning failure), at most ``max_s``."""
        t0 = time.monotonic()
        if not self.pin:
            return False, 0.0
        while time.monotonic() - t0 < max_s:
            text = Path(self.log_path).read_text(errors="replace")
            if "L1 pinned" in text:
                return True, time.monotonic() - t0
            if "cudaHostRegister of L1" in text:  # pinning stopped part way: the log says why
                return False, time.monotonic() - t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.25)
        return False, time.monotonic() - t0

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the daemon stops cleanly
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# ---------------------------------------------------------------------------- timing helpers


from kernel_transfer import timed  # noqa: E402  (same directory: median of synchronizing runs)


class _Work:
    """Items handed out to threads one at a time."""

    def __init__(self, items) -> None:
        self._items = list(items)
        self._i = 0
        self._lock = threading.Lock()
        self.done = 0

    def next(self):
        with self._lock:
            if self._i >= len(self._items):
                return None
            self._i += 1
            return self._items[self._i - 1]

    def add_done(self, n: int) -> None:
        with self._lock:
            self.done += n


def run_parallel(tasks) -> float:
    """Run each callable in its own thread, all released together; wall seconds from the
    release to the end of the last one. Re-raises the first error."""
    barrier = threading.Barrier(len(tasks) + 1)
    errors: list[BaseException] = []

    def body(fn) -> None:
        try:
            barrier.wait()
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(fn,), daemon=True) for fn in tasks]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt


def store_task(client: KVDepotClient, reg, stream, work: _Work):
    """One thread's STOREs: one chunk per request (parent b""), until ``work`` is empty."""

    def fn() -> None:
        while (item := work.next()) is not None:
            key, ids = item
            r = client.store(reg, [key], ids, after=stream)
            work.add_done(r.stored)

    return fn


def retrieve_task(client: KVDepotClient, reg, stream, work: _Work):
    """One thread's RETRIEVEs; its stream waits on the daemon's events and is synchronized at the
    end, so the thread ends when its data is in place."""

    def fn() -> None:
        while (item := work.next()) is not None:
            key, ids = item
            work.add_done(client.retrieve(reg, [key], ids, before=stream))
        if stream is not None:
            stream.synchronize()

    return fn


def store_pipelined(client: KVDepotClient, reg, stream, work: _Work, depth: int, early: bool = False):
    """One thread keeping ``depth`` STOREs in flight on one client (`submit_store`). With
    ``early`` the daemon replies at enqueue; the caller then waits until the chunks are visible
    (`wait_visible`)."""

    def fn() -> None:
        q: collections.deque = collections.deque()
        while True:
            while len(q) < depth and (item := work.next()) is not None:
                key, ids = item
                q.append(client.submit_store(reg, [key], ids, after=stream, early=early))
            if not q:
                return
            # the source blocks are never overwritten here, so the stream need not wait for the
            # daemon's gathers (an engine waits once, before its next forward)
            work.add_done(q.popleft().result().stored)

    return fn


def wait_visible(client: KVDepotClient, keys: list[bytes], chunk_size: int, timeout_s: float = 30.0) -> None:
    """Until every one-chunk key is in L1 (early-reply stores commit when their copy ends)."""
    deadline = time.monotonic() + timeout_s
    chains = [[k] for k in keys]
    while client.lookup(chains, chunk_size) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("early-reply stores did not become visible")
        time.sleep(20e-6)


def retrieve_pipelined(client: KVDepotClient, reg, stream, work: _Work, depth: int, cpu_wait: bool = False):
    """One thread keeping ``depth`` RETRIEVEs in flight on one client (`submit_retrieve`). As an
    engine would, the stream waits once, on the last reply's event (a registration's retrieves
    complete in order, so it covers every earlier one), and is then synchronized."""

    # engine-side staging: each result enqueues its scatter, on the stream given to it
    before = stream if reg.staging is not None else None

    def fn() -> None:
        q: collections.deque = collections.deque()
        while True:
            while len(q) < depth and (item := work.next()) is not None:
                key, ids = item
                q.append(client.submit_retrieve(reg, [key], ids))
            if not q:
                break
            work.add_done(q.popleft().result(before, cpu_wait=cpu_wait))
        if stream is not None:
            if client.last_retrieve_event is not None:
                stream.wait_event(client.last_retrieve_event)
            stream.synchronize()

    return fn


def fresh_keys(reg, n: int, chunk_size: int) -> list[bytes]:
    """Keys of ``n`` one-chunk prompts of random tokens (distinct chunks, parent b"")."""
    toks = torch.randint(0, 1 << 30, (n, chunk_size)).tolist()
    return [reg.keys(t)[0] for t in toks]


# ---------------------------------------------------------------------------- engine-side pieces


class Blocks:
    """Two disjoint random sets of block ids per gid: S (stores read) and R (retrieves write)."""

    def __init__(self, shape: Shape, max_tokens: int, num_blocks: list[int]) -> None:
        self.src: list[list[int]] = []
        self.dst: list[list[int]] = []
        for g, nb in zip(shape.groups, num_blocks):
            half = max_tokens // g.tokens_per_block
            perm = torch.randperm(nb).tolist()
            self.src.append(perm[:half])
            self.dst.append(perm[half:2 * half])
        self.tpb = [g.tokens_per_block for g in shape.groups]

    def chunk(self, which: str, j: int, chunk_size: int) -> list[list[int]]:
        ids = self.src if which == "src" else self.dst
        return [s[j * (chunk_size // t):(j + 1) * (chunk_size // t)] for s, t in zip(ids, self.tpb)]


class Pages:
    """Raw (layer, block) pages of a cache: base pointer, block stride and page bytes per layer."""

    def __init__(self, cache: ShmKVCache) -> None:
        self.cache = cache
        self.layers = []  # (gid, base_ptr, block_stride_bytes, page_bytes, num_blocks)
        for li, t in enumerate(cache.engine_tensors):
            gid = cache.layer_gids[li]
            g = cache.groups[gid]
            self.layers.append((gid, t.data_ptr(), t.stride(0) * t.element_size(), g.page_bytes, t.shape[0]))
        base = cache.storage.data_ptr()
        self.views = [torch.as_strided(cache.storage, (nb, pb), (bs, 1), ptr - base)
                      for _, ptr, bs, pb, nb in self.layers]

    def copies(self, block_ids: list[list[int]], host_ptr: int, to_host: bool) -> list[tuple[int, int, int]]:
        """(dst, src, bytes) per page of one chunk, host side packed layer by layer."""
        out = []
        off = 0
        for gid, ptr, bs, pb, _ in self.layers:
            for b in block_ids[gid]:
                dev, host = ptr + b * bs, host_ptr + off
                out.append((host, dev, pb) if to_host else (dev, host, pb))
                off += pb
        return out


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _CUmemLocation), ("dstLocHint", _CUmemLocation),
                ("flags", ctypes.c_uint)]


CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
# the CUDA 12.8 ABI of cuMemcpyBatchAsync (with failIdx), which cuGetProcAddress(..., 12080) returns
_BATCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)


def load_batch_memcpy():
    """(callable, label) for cuMemcpyBatchAsync: through cuda-python's cuGetProcAddress when
    importable, else libcuda's cuGetProcAddress_v2 via ctypes. Raises if neither works."""
    errors = []
    try:
        from cuda.bindings import driver as drv

        res = drv.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
        if res[0] == drv.CUresult.CUDA_SUCCESS and int(res[1]):
            return _BATCH_FN(int(res[1])), "cuMemcpyBatchAsync (cuda-python)"
        errors.append(f"cuda-python cuGetProcAddress: {res[0]}")
    except Exception as exc:  # noqa: BLE001 - not installed, or an API this code does not know
        errors.append(f"cuda-python: {type(exc).__name__}: {exc}")
    lib = ctypes.CDLL("libcuda.so.1")
    get = lib.cuGetProcAddress_v2
    get.restype = ctypes.c_int
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                    ctypes.POINTER(ctypes.c_int)]
    ptr, status = ctypes.c_void_p(), ctypes.c_int()
    rc = get(b"cuMemcpyBatchAsync", ctypes.byref(ptr), 12080, 0, ctypes.byref(status))
    if rc != 0 or not ptr.value:
        raise RuntimeError(f"cuMemcpyBatchAsync not available ({'; '.join(errors)}; ctypes rc {rc} status "
                           f"{status.value})")
    return _BATCH_FN(ptr.value), "cuMemcpyBatchAsync (ctypes)"


class PageCopier:
    """Issues one chunk's page copies on a stream: one cuMemcpyBatchAsync call per chunk, or
    (``per_page``) one cuMemcpyAsync per page from a Python loop."""

    def __init__(self, per_page: bool) -> None:
        self.per_page = per_page
        if per_page:
            lib = ctypes.CDLL("libcuda.so.1")
            self.fn = lib.cuMemcpyAsync
            self.fn.restype = ctypes.c_int
            self.fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
            self.label = "per-page cuMemcpyAsync loop"
        else:
            self.fn, self.label = load_batch_memcpy()
            self.attr = _CUmemcpyAttributes(srcAccessOrder=CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
            self.attr_idx = ctypes.c_size_t(0)
            self.fail_idx = ctypes.c_size_t(0)

    def prepare(self, copies: list[tuple[int, int, int]]):
        if self.per_page:
            return copies
        n = len(copies)
        arr = ctypes.c_uint64 * n
        return (arr(*(c[0] for c in copies)), arr(*(c[1] for c in copies)), (ctypes.c_size_t * n)(*(c[2] for c in copies)),
                n)

    def issue(self, prepared, stream_handle: int) -> None:
        if self.per_page:
            fn = self.fn
            for dst, src, size in prepared:
                rc = fn(dst, src, size, stream_handle)
                if rc:
                    raise RuntimeError(f"cuMemcpyAsync failed: CUresult {rc}")
            return
        dsts, srcs, sizes, n = prepared
        rc = self.fn(ctypes.addressof(dsts), ctypes.addressof(srcs), ctypes.addressof(sizes), n,
                     ctypes.addressof(self.attr), ctypes.addressof(self.attr_idx), 1, ctypes.addressof(self.fail_idx),
                     stream_handle)
        if rc:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {rc} (copy {self.fail_idx.value})")


def dma_baseline(pages: Pages, blocks: Blocks, chunk_size: int, n: int, ob: int, host: torch.Tensor,
                 stream: torch.cuda.Stream, iters: int) -> dict:
    """Batched DMA of raw pages straight between the engine's blocks and pinned host memory."""
    hp = host.data_ptr()
    sh = stream.cuda_stream
    out: dict = {}
    copier = None
    errors = []
    for per_page in (False, True):
        try:
            copier = PageCopier(per_page)
            st = [copier.prepare(pages.copies(blocks.chunk("src", j, chunk_size), hp + j * ob, True))
                  for j in range(n)]

            def d2h() -> None:
                for p in st:
                    copier.issue(p, sh)
                stream.synchronize()

            host[:ob].fill_(0)
            d2h()
            # the first page of chunk 0 must have arrived (catches a call that silently did nothing)
            gid, ptr, bs, pb, _ = pages.layers[0]
            b0 = blocks.chunk("src", 0, chunk_size)[gid][0]
            if not torch.equal(host[:pb].to(pages.cache.device), pages.views[0][b0]):
                raise RuntimeError("bytes differ after the copy")
            out["store_gbps"] = n * ob / timed(d2h, iters) / 1e9
            break
        except Exception as exc:  # noqa: BLE001 - fall back to the per-page loop
            errors.append(f"{'per-page' if per_page else 'batch'}: {type(exc).__name__}: {exc}")
            copier = None
    if copier is None:
        raise RuntimeError("; ".join(errors))
    out["method"] = copier.label
    if errors:
        out["fallback_reason"] = "; ".join(errors)
    rt = [copier.prepare(pages.copies(blocks.chunk("dst", j, chunk_size), hp + j * ob, False)) for j in range(n)]

    def h2d() -> None:
        for p in rt:
            copier.issue(p, sh)
        stream.synchronize()

    out["retrieve_gbps"] = n * ob / timed(h2d, iters) / 1e9
    return out


def torch_baseline(pages: Pages, blocks: Blocks, chunk_size: int, n: int, ob: int, host: torch.Tensor,
                   stream: torch.cuda.Stream, iters: int) -> dict:
    """Per-layer torch index_select into a device staging buffer + one copy per chunk (store), and
    one copy + per-layer index_copy_ (retrieve): what a simple connector does."""
    dev = pages.cache.device
    stage = torch.empty(ob, dtype=torch.uint8, device=dev)

    def idx(which: str) -> list[list[torch.Tensor]]:
        return [[torch.tensor(ids, dtype=torch.long, device=dev) for ids in blocks.chunk(which, j, chunk_size)]
                for j in range(n)]

    src_idx, dst_idx = idx("src"), idx("dst")
    plan = []  # per layer: view, gid, offset in the staging buffer, rows
    off = 0
    for li, (gid, _, _, pb, _) in enumerate(pages.layers):
        rows = chunk_size // blocks.tpb[gid]
        plan.append((pages.views[li], gid, off, rows, pb))
        off += rows * pb
    assert off == ob, (off, ob)

    def store() -> None:
        with torch.cuda.stream(stream):
            for j in range(n):
                for v, gid, o, rows, pb in plan:
                    torch.index_select(v, 0, src_idx[j][gid], out=stage[o:o + rows * pb].view(rows, pb))
                host[j * ob:(j + 1) * ob].copy_(stage, non_blocking=True)
        stream.synchronize()

    def retrieve() -> None:
        with torch.cuda.stream(stream):
            for j in range(n):
                stage.copy_(host[j * ob:(j + 1) * ob], non_blocking=True)
                for v, gid, o, rows, pb in plan:
                    v.index_copy_(0, dst_idx[j][gid], stage[o:o + rows * pb].view(rows, pb))
        stream.synchronize()

    return {"store_gbps": n * ob / timed(store, iters) / 1e9, "retrieve_gbps": n * ob / timed(retrieve, iters) / 1e9}


# ---------------------------------------------------------------------------- one point


@dataclasses.dataclass
class Ctx:
    args: argparse.Namespace
    dev: torch.device
    clients: list[KVDepotClient]  # 2 * outstanding, each used by one thread at a time
    streams: list  # one CUDA stream per client
    host: list[torch.Tensor]  # two pinned buffers of max_bytes
    devbuf: list[torch.Tensor]  # two device buffers of max_bytes
    zmq_us: float


def bench_point(ctx: Ctx, shape: Shape, cache: ShmKVCache, specs: tuple, blocks: Blocks, pages: Pages,
                chunk_size: int) -> dict:
    a = ctx.args
    t_start = time.perf_counter()
    k = a.outstanding
    n = chunks_for(shape, chunk_size, a.bytes_per_point, k)
    main = ctx.clients[0]
    staging = {}
    if a.staging == "engine":  # the ring holds every request in flight in both directions twice over
        ob_guess = shape.token_bytes * chunk_size
        staging = dict(local_storages=[cache.storage], staging_bytes=max(256 << 20, 2 * (2 * k + 1) * ob_guess))
    reg = main.register(f"bench/{shape.name}", shape.shard, chunk_size, *specs, device=cache.register_device,
                        **staging)
    if a.staging == "engine" and reg.staging is None:
        raise RuntimeError("--staging engine: the daemon or this process cannot run engine-side staging")
    ob = reg.object_bytes
    assert ob == shape.token_bytes * chunk_size, (ob, shape.token_bytes, chunk_size)
    total = n * ob
    res: dict = {"shape": shape.name, "chunk_tokens": chunk_size, "object_bytes": ob, "chunks": n, "bytes": total,
                 "outstanding": k, "client_mode": a.client_mode, "store_reply": a.store_reply,
                 "staging": a.staging, "spin_us": a.spin_us, "stream_wait": a.stream_wait}
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

        early = a.store_reply == "early"

        def store_tasks(w: _Work) -> list:
            if a.client_mode == "pipelined":
                return [store_pipelined(st_clients[0], reg, st_streams[0], w, k, early)]
            return [store_task(c, reg, s, w) for c, s in zip(st_clients, st_streams)]

        def visible(keys, dt: float) -> float:
            """dt plus the time until the early-reply stores are in L1 (the clock's end)."""
            if not early or a.client_mode != "pipelined":
                return dt
            t = time.perf_counter()
            wait_visible(main, list(keys), chunk_size)
            return dt + time.perf_counter() - t

        def retrieve_tasks(w: _Work) -> list:
            if a.client_mode == "pipelined":
                return [retrieve_pipelined(rt_clients[0], reg, rt_streams[0], w, k, a.stream_wait == "cpu")]
            return [retrieve_task(c, reg, s, w) for c, s in zip(rt_clients, rt_streams)]

        def store_run(keys) -> tuple[float, int]:
            w = _Work(zip(keys, src))
            return visible(keys, run_parallel(store_tasks(w))), w.done

        def retrieve_run(keys) -> tuple[float, int]:
            w = _Work(zip(keys, dst))
            return run_parallel(retrieve_tasks(w)), w.done

        warm = fresh_keys(reg, min(n, 2 * k), chunk_size)
        store_run(warm)
        retrieve_run(warm)
        store_ts, stored = [], []
        keys: list[bytes] = []
        for _ in range(a.iters):
            main.flush()  # outside the clock; every rep stores n new chunks
            keys = fresh_keys(reg, n, chunk_size)
            dt, done = store_run(keys)
            store_ts.append(dt)
            stored.append(done)
        res["store_gbps_runs"] = [total / t / 1e9 for t in store_ts]
        res["store_gbps"] = statistics.median(res["store_gbps_runs"])
        res["store_chunks_stored"] = stored
        retr_ts, retrieved = [], []
        for _ in range(a.iters):
            dt, done = retrieve_run(keys)
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
            dt = visible(new, run_parallel(store_tasks(ws) + retrieve_tasks(wr)))
            both_ts.append((ws.done + wr.done) * ob / dt / 1e9)
        res["bidir_gbps_runs"] = both_ts
        res["bidir_gbps"] = statistics.median(both_ts)

        # lone requests (nothing else in flight)
        c, s = ctx.clients[0], ctx.streams[0]
        warmup = 3
        lat_r, reply_r = [], []
        missing = 0
        for i in range(warmup + a.lone_iters):
            j = i % n
            t0 = time.perf_counter()
            got = c.retrieve(reg, [keys[j]], dst[j], before=s)
            t1 = time.perf_counter()
            s.synchronize()
            if i >= warmup:
                lat_r.append(time.perf_counter() - t0)
                reply_r.append(t1 - t0)
            missing += got != 1
        # the same, with the engine waiting on the CPU for the daemon's event (cpu_wait) instead
        # of its stream waiting on the GPU: a GPU wait on another process's event is slow
        lat_rc = []
        for i in range(warmup + a.lone_iters):
            j = i % n
            t0 = time.perf_counter()
            got = c.retrieve(reg, [keys[j]], dst[j], before=s, cpu_wait=True)
            if i >= warmup:
                lat_rc.append(time.perf_counter() - t0)
            missing += got != 1
        if missing:
            say(f"  WARNING: {missing} lone retrieves found no chunk (evicted? raise --l1-bytes)")
        lone_keys = fresh_keys(reg, warmup + a.lone_iters, chunk_size)
        lat_s = []
        not_stored = 0
        for i, key in enumerate(lone_keys):
            j = i % n
            t0 = time.perf_counter()
            r = c.store(reg, [key], src[j], after=s)
            if i >= warmup:
                lat_s.append(time.perf_counter() - t0)
            not_stored += r.stored != 1
        if not_stored:
            say(f"  WARNING: {not_stored} lone stores stored nothing")
        # lone early-reply stores: until the engine may overwrite its blocks (reply + the
        # stream's wait on the daemon's gathers), not until the chunk is in L1
        lat_e = []
        for i, key in enumerate(fresh_keys(reg, warmup + a.lone_iters, chunk_size)):
            t0 = time.perf_counter()
            c.store(reg, [key], src[i % n], after=s, early=True)
            s.synchronize()
            if i >= warmup:
                lat_e.append(time.perf_counter() - t0)
            wait_visible(c, [key], chunk_size)  # lone: the copy ends before the next store
        res["lone_store_early_reusable_us"] = statistics.median(lat_e) * 1e6
        lat_ec = []
        for i, key in enumerate(fresh_keys(reg, warmup + a.lone_iters, chunk_size)):
            t0 = time.perf_counter()
            c.store(reg, [key], src[i % n], after=s, early=True, cpu_wait=True)
            if i >= warmup:
                lat_ec.append(time.perf_counter() - t0)
            wait_visible(c, [key], chunk_size)
        res["lone_store_early_reusable_cpu_wait_us"] = statistics.median(lat_ec) * 1e6
        # bytes in L1 as the engine sees it: early reply, then a CPU wait on the daemon's event
        # after the copies (no reply after the copies)
        lat_l1 = []
        for i, key in enumerate(fresh_keys(reg, warmup + a.lone_iters, chunk_size)):
            t0 = time.perf_counter()
            c.store(reg, [key], src[i % n], after=s, early=True, cpu_wait=True, in_l1=True)
            if i >= warmup:
                lat_l1.append(time.perf_counter() - t0)
            wait_visible(c, [key], chunk_size)
        res["lone_store_in_l1_cpu_wait_us"] = statistics.median(lat_l1) * 1e6
        pings = []
        for i in range(20 + 200):
            t0 = time.perf_counter()
            c.ping()
            if i >= 20:
                pings.append(time.perf_counter() - t0)
        res["lone_store_us"] = statistics.median(lat_s) * 1e6
        # spread of the lone figures (these VMs are noisy): 10th / 90th percentiles
        res["lone_store_us_p10_p90"] = [q * 1e6 for q in _p10_p90(lat_s)]
        res["lone_retrieve_us_p10_p90"] = [q * 1e6 for q in _p10_p90(lat_r)]
        res["lone_retrieve_us"] = statistics.median(lat_r) * 1e6
        res["lone_retrieve_reply_us"] = statistics.median(reply_r) * 1e6  # until retrieve() returned (staged: after its CPU wait for the copies)
        res["link_d2h_us"] = ob / (res["roofline_d2h_gbps"] * 1e9) * 1e6
        res["link_h2d_us"] = ob / (res["roofline_h2d_gbps"] * 1e9) * 1e6
        res["lone_store_overhead_us"] = res["lone_store_us"] - res["link_d2h_us"]
        res["lone_retrieve_overhead_us"] = res["lone_retrieve_us"] - res["link_h2d_us"]
        res["lone_store_in_l1_cpu_wait_overhead_us"] = res["lone_store_in_l1_cpu_wait_us"] - res["link_d2h_us"]
        res["lone_retrieve_cpu_wait_us"] = statistics.median(lat_rc) * 1e6
        res["lone_retrieve_cpu_wait_overhead_us"] = res["lone_retrieve_cpu_wait_us"] - res["link_h2d_us"]
        res["ping_us"] = statistics.median(pings) * 1e6
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


# ---------------------------------------------------------------------------- output


HEADER = (f"{'shape':<19} {'chunk':>5} {'MiB x n':>11} | {'roofline d2h/h2d/both':>21} | "
          f"{'store GB/s (%roof, x dma, x torch)':<36} | {'retrieve GB/s (%roof, x dma, x torch)':<36} | "
          f"{'both GB/s (%roof)':<17} | lone overhead store/retrieve vs 2x zmq")


def _x(r: dict, key: str) -> str:
    v = r.get(key)
    return f"x{v:.2f}" if v else "n/a"


def _p10_p90(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (0.0, 0.0)
    q = statistics.quantiles(xs, n=10)
    return q[0], q[-1]


def format_row(r: dict) -> str:
    st = (f"{r['store_gbps']:5.1f} ({100 * r['store_vs_roofline']:5.1f}% {_x(r, 'store_vs_batched_dma'):>6} "
          f"{_x(r, 'store_vs_torch_per_layer'):>6})")
    rt = (f"{r['retrieve_gbps']:5.1f} ({100 * r['retrieve_vs_roofline']:5.1f}% {_x(r, 'retrieve_vs_batched_dma'):>6} "
          f"{_x(r, 'retrieve_vs_torch_per_layer'):>6})")
    both = f"{r['bidir_gbps']:5.1f} ({100 * r['bidir_vs_roofline']:5.1f}%)"
    roof = f"{r['roofline_d2h_gbps']:5.1f}/{r['roofline_h2d_gbps']:5.1f}/{r['roofline_bidir_gbps']:5.1f}"
    lone = (f"{r['lone_store_overhead_us']:+.0f}/{r['lone_retrieve_overhead_us']:+.0f} us vs "
            f"{2 * r['zmq_echo_us']:.0f} us (ping {r['ping_us']:.0f})")
    flag = "" if r.get("verified", True) else "  DATA MISMATCH"
    return (f"{r['shape']:<19} {r['chunk_tokens']:>5} {r['object_bytes'] / 2**20:6.2f} x{r['chunks']:<3} | {roof:>21} | "
            f"{st:<36} | {rt:<36} | {both:<17} | {lone}{flag}")


def baseline_line(r: dict) -> str:
    parts = []
    for name in ("batched_dma", "torch_per_layer"):
        b = r.get(name, {})
        if "error" in b or not b:
            parts.append(f"{name}: n/a")
        else:
            label = f" [{b['method']}]" if "method" in b else ""
            parts.append(f"{name}{label}: store {b['store_gbps']:.1f} retrieve {b['retrieve_gbps']:.1f} GB/s")
    return ("      baselines: " + "; ".join(parts)
            + (f"; a plain lone pinned memcpy {r['lone_memcpy_d2h_us'] - r['link_d2h_us']:+.0f} (d2h) / "
               f"{r['lone_memcpy_h2d_us'] - r['link_h2d_us']:+.0f} (h2d) us over the link"
               if "lone_memcpy_h2d_us" in r else "")
            + (f"; lone store p10-p90 {r['lone_store_us_p10_p90'][0] - r['link_d2h_us']:+.0f}.."
               f"{r['lone_store_us_p10_p90'][1] - r['link_d2h_us']:+.0f} us, retrieve "
               f"{r['lone_retrieve_us_p10_p90'][0] - r['link_h2d_us']:+.0f}.."
               f"{r['lone_retrieve_us_p10_p90'][1] - r['link_h2d_us']:+.0f} us over the link"
               if "lone_store_us_p10_p90" in r else "")
            + f"; lone retrieve call returned after {r.get('lone_retrieve_reply_us', 0):.0f} us"
            + f"; lone early store, blocks reusable after {r.get('lone_store_early_reusable_us', 0):.0f} us"
            + f" ({r.get('lone_store_early_reusable_cpu_wait_us', 0):.0f} us with cpu_wait)"
            + f"; lone retrieve with cpu_wait {r.get('lone_retrieve_cpu_wait_overhead_us', 0):+.0f} us over the link"
            + "; lone store, bytes in L1 with early+cpu_wait+in_l1 "
            + f"{r.get('lone_store_in_l1_cpu_wait_overhead_us', 0):+.0f} us over the link"
            + f"; point {r.get('point_s', 0):.1f} s")


def evaluate_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, checked on the rows that exist."""
    out = []

    def add(what: str, value: float, limit: float, ok: bool) -> None:
        out.append({"target": what, "value": value, "limit": limit, "pass": ok})

    for r in rows:
        tag = f"{r['shape']} chunk {r['chunk_tokens']}"
        if r["chunk_tokens"] == 256 and r["shape"] in ("Llama-3.1-8B TP1", "Llama-3.1-70B TP8", "Llama-3.1-70B TP4"):
            for op in ("store", "retrieve"):
                v = r[f"{op}_vs_roofline"]
                add(f"{tag}: {op} stream >= 95% of roofline", v, 0.95, v >= 0.95)
        if r["chunk_tokens"] == 256:
            for op in ("store", "retrieve"):
                v = r[f"lone_{op}_overhead_us"]
                add(f"{tag}: lone {op} overhead <= 2x bare zmq rtt (us)", v, 2 * r["zmq_echo_us"],
                    v <= 2 * r["zmq_echo_us"])
            v = r["lone_store_in_l1_cpu_wait_overhead_us"]
            add(f"{tag}: lone store overhead until the bytes are in L1, engine waiting with cpu_wait, "
                "<= 2x bare zmq rtt (us)", v, 2 * r["zmq_echo_us"], v <= 2 * r["zmq_echo_us"])
            v = r["lone_retrieve_cpu_wait_overhead_us"]
            add(f"{tag}: lone retrieve overhead, engine waiting with cpu_wait, <= 2x bare zmq rtt (us)", v,
                2 * r["zmq_echo_us"], v <= 2 * r["zmq_echo_us"])
            add(f"{tag}: store+retrieve together >= 90 GB/s", r["bidir_gbps"], 90.0, r["bidir_gbps"] >= 90.0)
        if r["chunk_tokens"] == 64:
            for op in ("store", "retrieve"):
                v = r[f"{op}_vs_roofline"]
                add(f"{tag}: {op} stream >= 70% of roofline", v, 0.70, v >= 0.70)
    return out


def write_json(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default=None, help="use this running daemon instead of starting one")
    p.add_argument("--l1-bytes", default="48g", help="L1 size of the daemon started here (default 48g)")
    p.add_argument("--warmup-s", type=float, default=60.0,
                   help="wait at most this long for the daemon to finish pinning L1 (it logs 'L1 pinned')")
    p.add_argument("--daemon-args", default="", help="extra arguments for `kvdepot serve`, e.g. "
                   "'--staging-batch-bytes 64m'")
    p.add_argument("--daemon-log", default=None, help="daemon log file (default: in its temp dir)")
    p.add_argument("--chunk-sizes", default="64,256,1024,2048")
    p.add_argument("--shapes", default="", help="comma-separated substrings of shape names to run (default all)")
    p.add_argument("--quick", action="store_true", help="only Llama-3.1-8B TP1 at chunks 64 and 256")
    p.add_argument("--outstanding", type=int, default=4, help="requests in flight per direction")
    p.add_argument("--staging", choices=("engine", "daemon"), default="engine",
                   help="engine: this process gathers / scatters on its streams through a staging ring and the "
                        "daemon only copies over PCIe (register's local_storages); daemon: the daemon gathers")
    p.add_argument("--store-reply", choices=("early", "copied"), default="early",
                   help="early: STOREs reply at enqueue (the engine's stream waits for the daemon's gathers) and "
                        "a stream's clock stops when all its chunks are visible in L1; copied: STOREs reply once in "
                        "L1 (pipelined client mode only; lone-request overheads always use copied)")
    p.add_argument("--client-mode", choices=("pipelined", "threads"), default="pipelined",
                   help="pipelined: one thread per direction keeps --outstanding requests in flight on one client "
                        "(submit_store / submit_retrieve); threads: --outstanding threads per direction, one "
                        "blocking request each")
    p.add_argument("--spin-us", type=float, default=200.0, help="the clients' spin before a wait sleeps")
    p.add_argument("--stream-wait", choices=("gpu", "cpu"), default="gpu",
                   help="pipelined retrieves with --staging daemon: the engine waits for the daemon's copies on "
                        "its stream (gpu) or on the CPU (cpu_wait); engine-side staging always waits on the CPU")
    p.add_argument("--bytes-per-point", type=float, default=2e9, help="bytes per stream measurement (about)")
    p.add_argument("--baseline-bytes", type=float, default=5e8, help="bytes per baseline measurement (about)")
    p.add_argument("--iters", type=int, default=5, help="repetitions of each stream / roofline measurement")
    p.add_argument("--lone-iters", type=int, default=50, help="lone requests per op")
    p.add_argument("--out", default="transfer.json", help="JSON results")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        say("transfer.py needs CUDA (this measures the daemon's GPU data path)")
        return 2
    shapes = SHAPES
    chunk_sizes = [int(x) for x in args.chunk_sizes.split(",") if x]
    if args.quick:
        shapes, chunk_sizes = [SHAPES[0]], [64, 256]
    elif args.shapes:
        want = [w.strip().lower() for w in args.shapes.split(",") if w.strip()]
        shapes = [s for s in SHAPES if any(w in s.name.lower() for w in want)]
    k = args.outstanding
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(dev)

    daemon = None
    endpoint = args.endpoint
    clients: list[KVDepotClient] = []
    doc: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "cuda": torch.version.cuda,
                 "python": sys.version.split()[0], "args": vars(args), "results": []}
    t_run = time.perf_counter()
    try:
        zmq_rtt = zmq_echo_rtt_us()
        doc["zmq_echo_rtt"] = zmq_rtt
        say(f"bare ZMQ ipc round trip: median {zmq_rtt['median_us']:.1f} us (p10 {zmq_rtt['p10_us']:.1f}, "
            f"p90 {zmq_rtt['p90_us']:.1f})")
        if endpoint is None:
            daemon = DaemonProc(args.l1_bytes, shlex.split(args.daemon_args), args.daemon_log)
            say(f"starting daemon: {' '.join(daemon.cmd)}  (KVDEPOT_KERNELS_SO={daemon.kernels_so or 'unset'})")
            t0 = time.monotonic()
            daemon.wait_ready()
            say(f"daemon ready in {time.monotonic() - t0:.1f} s; waiting up to {args.warmup_s:.0f} s for L1 pinning")
            pinned, waited = daemon.wait_pinned(args.warmup_s)
            if daemon.pin:
                say(f"L1 {'pinned' if pinned else 'NOT fully pinned (see the daemon log)'} after {waited:.1f} s")
            else:
                say("L1 not pinned (--no-pin-l1): copies to and from L1 run at pageable speed")
            doc["daemon"] = {"cmd": daemon.cmd, "l1_pinned": pinned, "pin_wait_s": waited,
                             "kernels_so": daemon.kernels_so}
            endpoint = daemon.endpoint
        else:
            doc["daemon"] = {"endpoint": endpoint, "external": True}
        clients = [KVDepotClient(endpoint, timeout_s=120, name=f"bench-{i}", spin_us=args.spin_us) for i in range(2 * k)]
        streams = [torch.cuda.Stream(dev) for _ in range(2 * k)]

        points = [(s, cs) for s in shapes for cs in chunk_sizes]
        max_bytes = max(chunks_for(s, cs, args.bytes_per_point, k) * s.token_bytes * cs for s, cs in points)
        host = [torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        devbuf = [torch.randint(0, 256, (max_bytes,), dtype=torch.uint8, device=dev) for _ in range(2)]
        ctx = Ctx(args, dev, clients, streams, host, devbuf, zmq_rtt["median_us"])
        say(f"device {doc['device']}, torch {torch.__version__}; {k} requests outstanding per direction; "
            f"up to {max_bytes / 1e9:.2f} GB per measurement")
        say(HEADER)
        for shape in shapes:
            cs_list = [cs for cs in chunk_sizes if all(cs % g.tokens_per_block == 0 for g in shape.groups)]
            if not cs_list:
                continue
            max_tokens = max(chunks_for(shape, cs, args.bytes_per_point, k) * cs for cs in cs_list)
            num_blocks = [2 * max_tokens // g.tokens_per_block + 16 for g in shape.groups]
            cache = ShmKVCache(list(shape.groups), num_blocks, shape.layout, device=dev)
            cache.storage.random_()
            specs = (cache.storage_specs(), cache.layer_specs(), cache.group_specs())  # IPC handle exported once
            blocks = Blocks(shape, max_tokens, num_blocks)
            pages = Pages(cache)
            for cs in cs_list:
                try:
                    r = bench_point(ctx, shape, cache, specs, blocks, pages, cs)
                except Exception as exc:  # noqa: BLE001 - report the point and go on with the next
                    say(f"{shape.name:<19} {cs:>5} FAILED: {type(exc).__name__}: {exc}")
                    doc.setdefault("errors", []).append({"shape": shape.name, "chunk_tokens": cs,
                                                         "error": f"{type(exc).__name__}: {exc}"})
                    write_json(args.out, doc)
                    continue
                doc["results"].append(r)
                if "transfer_engine" not in doc:
                    with contextlib.suppress(Exception):
                        doc["transfer_engine"] = clients[0].describe().transfer_engine
                say(format_row(r))
                say(baseline_line(r))
                write_json(args.out, doc)
            del pages, blocks, cache
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        doc["targets"] = evaluate_targets(doc["results"])
        doc["total_s"] = time.perf_counter() - t_run
        write_json(args.out, doc)
        say(f"\ndaemon transfer engine: {doc.get('transfer_engine', '?')}")
        say("targets:")
        for t in doc["targets"]:
            say(f"  {'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {t['value']:.3g} (limit {t['limit']:.3g})")
        say(f"results written to {args.out} ({doc['total_s']:.0f} s in all)")
        return 0
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                c.close()
        if daemon is not None:
            rc = daemon.stop()
            tail = daemon.log_tail(200)
            bad = [ln for ln in tail.splitlines() if " ERROR " in ln or " WARNING " in ln or "Traceback" in ln]
            if rc not in (0, None) or bad:
                say(f"daemon exit code {rc}; log {daemon.log_path}:\n" + "\n".join(bad[-20:] or tail.splitlines()[-20:]))


if __name__ == "__main__":
    sys.exit(main())
