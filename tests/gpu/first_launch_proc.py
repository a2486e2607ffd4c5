"""One fresh process's first gather and first scatter of the kernel library while another
stream runs a long kernel (tests/gpu/test_first_launch.py runs it; by hand:
``python tests/gpu/first_launch_proc.py``).

CUDA loads a kernel at its first launch (lazy loading) and the load may wait for the context's
running work. The kernel library loads all of its kernels when an engine is created
(``kvd_engine_create``), so neither launch below should wait for the busy stream. Prints one
JSON line: for the gather (a one-group engine) and the scatter (a two-group engine: the fused
kernel), the CPU seconds of the library call and whether its stream had finished while the busy
stream was still running, plus the busy kernel's length.
"""

from __future__ import annotations

import array
import json
import time

import torch

from kvdepot.client.kvcache import KVGroupShape, ShmKVCache
from kvdepot.gpu.kernels import KvdGroupDesc, load_kernels
from kvdepot.gpu.layout import group_layers

CHUNK = 64
BUSY_CYCLES = 4_000_000_000  # torch.cuda._sleep: about two seconds on an H100 / H200


def _engine(kernels, groups, dev):
    cache = ShmKVCache(groups, 16, "LBNHC")
    lay = group_layers(cache.layer_specs(), cache.group_specs(), CHUNK, [cache.size_bytes])
    storage = cache.storage.to(dev)
    descs = [KvdGroupDesc.from_group(g, lay.object_bytes, lay.chunk_size) for g in lay.groups]
    ptrs = [[storage.data_ptr() + off for _, off in g.offsets] for g in lay.groups]
    handle = kernels.engine_create(dev.index or 0, descs, ptrs, lay.chunk_size, lay.object_bytes)
    ids = array.array("i", [b for g in range(len(lay.groups)) for b in range(lay.blocks_per_chunk(g))])
    return handle, lay, ids, storage


def main() -> None:
    kernels = load_kernels()
    assert kernels is not None, "kernel library could not be loaded"
    dev = torch.device("cuda", torch.cuda.current_device())
    bf = torch.bfloat16
    one, lay1, ids1, keep1 = _engine(kernels, [KVGroupShape(0, 2, 2, 64, 16, bf)], dev)
    two, lay2, ids2, keep2 = _engine(kernels, [KVGroupShape(0, 2, 2, 64, 16, bf), KVGroupShape(1, 2, 2, 64, 32, bf)],
                                     dev)
    ring = torch.zeros(2 * max(lay1.object_bytes, lay2.object_bytes) + 512, dtype=torch.uint8, device=dev)
    base = (ring.data_ptr() + 255) // 256 * 256
    side, busy = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda._sleep(1000)  # torch's own kernel loaded before the busy stream runs it
    torch.cuda.synchronize()
    out = {}
    t_busy = time.perf_counter()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(BUSY_CYCLES)
    for name, call in (
            ("gather", lambda: kernels.engine_gather(one, ids1, 1, base, side.cuda_stream)),
            ("scatter", lambda: kernels.engine_scatter(two, ids2, 1, 1, base, 0, side.cuda_stream))):
        t0 = time.perf_counter()
        call()
        call_s = time.perf_counter() - t0
        while not side.query() and not busy.query():
            time.sleep(0.0005)
        out[name] = {"call_s": round(call_s, 6), "done_while_busy": bool(side.query() and not busy.query())}
    busy.synchronize()
    out["busy_s"] = round(time.perf_counter() - t_busy, 3)
    del keep1, keep2
    print(json.dumps(out))


if __name__ == "__main__":
    main()
