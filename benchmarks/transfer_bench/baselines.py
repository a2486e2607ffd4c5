"""What the daemon's data path is compared with, in this process and on the same blocks: batched
DMA of raw pages (`cuMemcpyBatchAsync`) and per-layer torch `index_select` + one copy; and the
block sets (`Blocks`) and page views (`Pages`) the measurements use."""

from __future__ import annotations

import ctypes

import torch

from kvdepot.client.kvcache import ShmKVCache
from transfer_bench.shapes import Shape
from transfer_bench.timing import timed

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
