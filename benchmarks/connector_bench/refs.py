"""What `benchmarks/vllm_connector.py` measures the connector against, in the same run: the same
chunks through `KVDepotClient` used directly (engine-side staging; `direct`), and the link's best
(`roofline`: pinned ``cudaMemcpyAsync`` each way)."""

from __future__ import annotations

import os
import time

import torch

from connector_bench.model import CHUNKS_PER_STEP  # chunks per request here, as per measured step
from kvdepot.client import KVDepotClient


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def direct(reg, num_blocks: int, endpoint: str, chunk: int, requests: int, object_bytes: int, device: str,
           staging_bytes: int) -> dict:
    """The same chunk bytes through `KVDepotClient` (engine-side staging) over a closed engine's
    KV caches (``reg``: its worker's `Registration`): 16 chunks per request, 4 in flight."""
    blocks_per_chunk = [chunk // g.tokens_per_block for g in reg.groups]
    with KVDepotClient(endpoint, timeout_s=60) as c:
        c.flush()  # the engines' chunks: the direct run starts with an empty L1
        r = c.register("direct-bench", "tp0of1", chunk, reg.storages, reg.layers, reg.groups, device=device,
                       local_storages=reg.local if device == "cuda" else None, staging_bytes=staging_bytes,
                       storage_fds=reg.storage_fds)
        keys = [[os.urandom(16) for _ in range(CHUNKS_PER_STEP)] for _ in range(requests)]
        ids = [[[(1 + (i * CHUNKS_PER_STEP * n + j)) % (num_blocks - 1) + 1 for j in range(CHUNKS_PER_STEP * n)]
                for n in blocks_per_chunk] for i in range(requests)]
        out = {}
        for op in ("store", "retrieve"):
            _sync()
            t0, inflight, moved = time.perf_counter(), [], 0
            wait = {"cpu_wait": True} if op == "retrieve" else {}  # the scatter done, not only enqueued
            for i in range(requests):
                if len(inflight) == 4:
                    moved += _chunks(inflight.pop(0).result(**wait))
                if op == "store":
                    inflight.append(c.submit_store(r, keys[i], ids[i]))
                else:
                    inflight.append(c.submit_retrieve(r, keys[i], ids[i]))
            for p in inflight:
                moved += _chunks(p.result(**wait))
            _sync()
            out[f"direct_{op}_chunks"] = moved
            out[f"direct_{op}_gbps"] = moved * object_bytes / (time.perf_counter() - t0) / 1e9
        c.unregister(r)
    return out


def _chunks(result) -> int:
    """Chunks a store (`StoreReply`) or a retrieve (int) moved."""
    return result if isinstance(result, int) else result.stored


def roofline(nbytes: int) -> dict:
    """The link's best: the fastest of 10 pinned copies of ``nbytes`` each way (after a warm-up)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()

    def best(fn):
        ts = []
        for _ in range(11):
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            ts.append(time.perf_counter() - t0)
        return nbytes / min(ts[1:]) / 1e9

    return {"roofline_d2h_gbps": best(lambda: host.copy_(dev, non_blocking=True)),
            "roofline_h2d_gbps": best(lambda: dev.copy_(host, non_blocking=True))}
