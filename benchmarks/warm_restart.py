"""The L2 write rate write-through needs, next to the same directory's raw disk rate (no GPU).

A daemon with L2 on ``--dir`` and an L1 large enough to hold everything; one CPU engine (a
sealed memfd) stores ``--total-bytes`` of Llama-3.1-8B chunks (``--chunk-tokens`` tokens, 128
KiB per token) as fast as it can. Reported: the store rate (what write-through must keep up
with when engines store at full speed), the L2 write-through rate (payload bytes from the first
store until every chunk is in L2), the writes dropped, and the raw sequential write rate of
the same directory (`tiers.raw_disk`, 4 threads, O_DIRECT where it works). Then the daemon is
SIGKILLed, restarted on the same L2, and the chunks that hit are counted.

    python benchmarks/warm_restart.py [--dir DIR] [--total-bytes 2g] [--chunk-tokens 16] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

from kvdepot.client import KVDepotClient
from kvdepot.client.kvcache import KVGroupShape, ShmKVCache
from kvdepot.config import parse_bytes
from tiers import raw_disk

GROUP = KVGroupShape(gid=0, num_layers=32, num_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
BATCH_CHUNKS = 16  # chunks per Store


def _start(workdir: str, l2: str, l1_bytes: int, tag: str) -> tuple[subprocess.Popen, str]:
    endpoint = f"ipc://{workdir}/kvd.sock"
    out = open(os.path.join(workdir, f"daemon-{tag}.out"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvdepot", "serve", "--endpoint", endpoint, "--l1-bytes",
                             str(l1_bytes), "--l2-path", l2, "--l2-bytes", str(4 * l1_bytes)],
                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while "kvdepot ready on" not in open(out.name, errors="replace").read():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"daemon did not start: {open(out.name).read()}")
        time.sleep(0.05)
    return proc, endpoint


def _l2(c: KVDepotClient):
    return next(t for t in c.describe().tiers if t.name == "l2")


def run(workdir: str, total_bytes: int, chunk_tokens: int) -> dict:
    chunk_bytes = GROUP.num_layers * GROUP.token_bytes * chunk_tokens
    chunks = max(BATCH_CHUNKS, total_bytes // chunk_bytes // BATCH_CHUNKS * BATCH_CHUNKS)
    l1_bytes = chunks * chunk_bytes * 5 // 4 + (256 << 20)
    l2 = os.path.join(workdir, "l2")
    proc, endpoint = _start(workdir, l2, l1_bytes, "1")
    cache = ShmKVCache([GROUP], BATCH_CHUNKS * chunk_tokens // GROUP.tokens_per_block, "LBNHC")
    res: dict = {"chunk_bytes": chunk_bytes, "chunks": chunks}
    prompts = []
    try:
        with KVDepotClient(endpoint, timeout_s=60.0, name="warm-restart") as c:
            reg = c.register("warm-restart", "tp0of1", chunk_tokens, cache.storage_specs(), cache.layer_specs(),
                             cache.group_specs(), storage_fds=cache.storage_fds())
            ids = [list(range(BATCH_CHUNKS * chunk_tokens // GROUP.tokens_per_block))]
            t0 = time.perf_counter()
            for b in range(chunks // BATCH_CHUNKS):
                keys = reg.keys([b * 1_000_003 + i for i in range(BATCH_CHUNKS * chunk_tokens)])
                assert c.store(reg, keys, ids).stored == BATCH_CHUNKS
                prompts.append(keys)
            stored_s = time.perf_counter() - t0
            while True:
                info = _l2(c)
                if info.num_objects + info.dropped_writes >= chunks and not info.queue_depth:
                    break
                time.sleep(0.002)
            written_s = time.perf_counter() - t0
            payload = chunks * chunk_bytes
            res.update(store_gbps=payload / stored_s / 1e9, l2_write_through_gbps=payload / written_s / 1e9,
                       l2_lag_after_last_store_s=written_s - stored_s, dropped_writes=info.dropped_writes,
                       l2_objects=info.num_objects)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc, endpoint = _start(workdir, l2, l1_bytes, "2")
        with KVDepotClient(endpoint, timeout_s=60.0, name="warm-restart") as c:
            res["hits_after_sigkill"] = sum(c.lookup(keys, chunk_tokens) for keys in prompts)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        cache.close()
    raw = raw_disk(workdir, min(total_bytes, 2 << 30), 4, direct=True)
    res["raw_write_gbps"] = raw["write_gbps"]
    res["write_through_vs_raw"] = res["l2_write_through_gbps"] / raw["write_gbps"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="", help="directory on the disk to measure (default: a temporary one)")
    ap.add_argument("--total-bytes", type=parse_bytes, default=2 << 30)
    ap.add_argument("--chunk-tokens", type=int, default=16, help="tokens per chunk (16: 2 MiB chunks)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.dir or None, prefix="kvd-warm-") as workdir:
        res = run(workdir, a.total_bytes, a.chunk_tokens)
    print(f"{res['chunks']} chunks of {res['chunk_bytes'] >> 20} MiB: store {res['store_gbps']:.2f} GB/s, "
          f"L2 write-through {res['l2_write_through_gbps']:.2f} GB/s (done {res['l2_lag_after_last_store_s']:.2f} s "
          f"after the last store, {res['dropped_writes']} dropped), raw disk write {res['raw_write_gbps']:.2f} GB/s "
          f"({res['write_through_vs_raw']:.0%}); after SIGKILL {res['hits_after_sigkill']} of {res['chunks']} hit")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
