"""The daemon's CPU time per request on its event loop (no GPU needed).

A lone request's overhead and the request rate of small chunks (a 64-token chunk of
Llama-3.1-70B at TP=8 is 2.5 MiB: 45 us on a 55 GB/s link) both depend on how long the
daemon's single event-loop thread spends on each request. This runs a `Daemon` in this
process and feeds its dispatcher encoded frames directly (no socket), for a CUDA registration
whose data path is replaced by a stub that completes at once, so what is timed is exactly the
daemon's Python per request: decode, checks, index, L1 allocation (with eviction once L1 is
full, the steady state), metrics, the completion callback and the reply's encoding:

* staged STORE (engine-side staging: the daemon only copies ring -> L1) of one new chunk;
* staged RETRIEVE of one cached chunk;
* LOOKUP of a 16-chunk prompt whose chunks are all cached (its hit count is in the JSON).

Each figure is printed in microseconds next to a bare ZMQ ipc round trip measured in the same
run (`transfer.py`'s echo: DEALER <-> ROUTER in a subprocess), as a ratio: the issue's lone
request budget is 2 round trips for everything, daemon included.

    python benchmarks/daemon_cpu.py [--requests 5000] [--out daemon_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from kvdepot.client.kvcache import KVGroupShape, ShmKVCache
from kvdepot.gpu.layout import group_layers
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.server.daemon import Daemon, DaemonConfig
from kvdepot.server.registration import Registration

BF16 = torch.bfloat16
SHAPES = {  # name -> (group, chunk tokens): the shapes of transfer.py whose chunks are smallest / largest
    "Llama-3.1-8B TP1 256": (KVGroupShape(0, 32, 8, 128, 16, BF16), 256),
    "Llama-3.1-70B TP8 64": (KVGroupShape(0, 80, 1, 128, 16, BF16), 64),
}


class _StubPath:
    """Stands in for the daemon's CUDA device path: records the completion callbacks, which the
    benchmark runs at once (the copies "completed")."""

    def __init__(self) -> None:
        self.done: list = []

    def copy_staged(self, to_host, srcs, dsts, object_bytes, fence, done, landed=None) -> None:
        self.done.append(done)


class _StubRuntime:
    def __init__(self) -> None:
        self.p = _StubPath()

    def path(self, device: int) -> _StubPath:
        return self.p


class _Engine:
    pass


def _daemon_with_registration(group: KVGroupShape, chunk_size: int, l1_bytes: int, sock_dir: str):
    """A daemon (not serving) with one CUDA registration that has engine-side staging."""
    d = Daemon(DaemonConfig(endpoints=[f"ipc://{sock_dir}/unused.sock"], l1_capacity_bytes=l1_bytes, busy_poll_us=0,
                            pin_l1=False))
    d._cuda = _StubRuntime()
    blocks = 4 * chunk_size // group.tokens_per_block
    with ShmKVCache([group], blocks, "LBNHC") as cache:  # only its description is used
        lay = group_layers(cache.layer_specs(), cache.group_specs(), chunk_size, [cache.size_bytes])
    reg = Registration("r1", "bench", "tp0of1", os.getpid(), "cuda", lay, None, _Engine(), cuda_device=0,
                       staging_ptr=1 << 40,
                       staging_bytes=8 * lay.object_bytes)
    d.registrations[reg.id] = reg
    return d, reg, lay


def measure(group: KVGroupShape, chunk_size: int, requests: int, l1_bytes: int, sock_dir: str) -> dict:
    """Median over passes 2 and 3 (pass 1 fills L1) of the microseconds per request the loop
    spends on ``requests`` staged one-chunk STOREs, then RETRIEVEs of the chunks still cached,
    then as many 16-chunk LOOKUPs; ``l1_bytes`` below ``requests`` chunks makes stores evict.
    Also: ``object_bytes``, ``l1_objects``, ``evictions`` (all passes), ``lookup_hit_chunks``.

    Raises:
        RuntimeError: a store stored nothing or a retrieve of a cached chunk got nothing (the
            daemon changed under the benchmark).
    """
    d, reg, lay = _daemon_with_registration(group, chunk_size, l1_bytes, sock_dir)
    sent: list[bytes] = []
    d.front.send = lambda identity, frame: sent.append(frame)
    ids = [list(range(chunk_size // group.tokens_per_block))]
    keys = [os.urandom(16) for _ in range(requests)]
    stores = [codec.encode(m.Store(rid=i + 1, registration=reg.id, keys=[k], block_ids=ids, event=b"e" * 64,
                                   staging_offset=(i % 8) * lay.object_bytes)) for i, k in enumerate(keys)]
    retrieves = [codec.encode(m.Retrieve(rid=i + 1, registration=reg.id, keys=[k], block_ids=ids,
                                         staging_offset=(i % 8) * lay.object_bytes)) for i, k in enumerate(keys)]
    path = d._cuda.p

    def run(frames: list[bytes]) -> float:
        t0 = time.perf_counter()
        for f in frames:
            d.front._dispatch(b"id", f)
            for cb in path.done:
                cb(None)
            path.done.clear()
        return (time.perf_counter() - t0) / len(frames) * 1e6

    out = {"object_bytes": lay.object_bytes, "l1_bytes": l1_bytes, "l1_objects": l1_bytes // lay.object_bytes}
    store_us, retrieve_us, lookup_us = [], [], []
    for rep in range(3):  # the first pass fills L1; the later ones evict on every store (steady state)
        sent.clear()
        store_us.append(run(stores))
        replies = [codec.decode_reply(f) for f in sent]
        bad = [r for r in replies if not isinstance(r, m.StoreReply) or r.stored != 1]
        if bad:
            raise RuntimeError(f"a store did not store its chunk: {bad[0]}")
        # retrieve and look up the chunks still cached (the newest ones)
        cached = [i for i in range(requests) if d.index.ready(keys[i]) is not None]
        sent.clear()
        retrieve_us.append(run([retrieves[i] for i in cached]))
        if any(not isinstance(r, m.RetrieveReply) or r.retrieved != 1 for r in map(codec.decode_reply, sent)):
            raise RuntimeError("a retrieve of a cached chunk did not retrieve it")
        chain = [keys[i] for i in cached[-16:]]
        look = codec.encode(m.Lookup(rid=1, keys=[chain], chunk_size=chunk_size, model="bench"))
        sent.clear()
        lookup_us.append(run([look] * len(cached)))
        out["lookup_hit_chunks"] = codec.decode_reply(sent[0]).hit_chunks
        if rep < 2:
            d.index.drop_where(lambda e: True)  # start the next pass from an empty L1 again
    out["store_us"] = statistics.median(store_us[1:])
    out["retrieve_us"] = statistics.median(retrieve_us[1:])
    out["lookup_us"] = statistics.median(lookup_us[1:])
    out["evictions"] = d.index.evictions
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=5000, help="requests per pass (3 passes)")
    p.add_argument("--l1-objects", type=int, default=100,
                   help="L1 size in chunk objects (smaller than --requests: stores evict, as in steady state)")
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)

    from transfer_bench.procs import zmq_echo_rtt_us  # the bare round trip of transfer.py

    rtt = zmq_echo_rtt_us()
    print(f"bare ZMQ ipc round trip: median {rtt['median_us']:.1f} us (p10 {rtt['p10_us']:.1f}, "
          f"p90 {rtt['p90_us']:.1f})")
    doc = {"zmq_echo_rtt": rtt, "args": vars(args), "python": sys.version.split()[0], "results": {}}
    print(f"{'shape, chunk':<24} {'object':>9} | {'store us':>9} {'retrieve us':>12} {'lookup us':>10} | "
          "per round trip: store retrieve lookup")
    with tempfile.TemporaryDirectory(prefix="kvd-cpu-") as sock_dir:
        for name, (group, chunk) in SHAPES.items():
            ob = group.num_layers * group.num_heads * 2 * group.head_dim * 2 * chunk
            r = measure(group, chunk, args.requests, args.l1_objects * ob, sock_dir)
            doc["results"][name] = r
            rt = rtt["median_us"]
            print(f"{name:<24} {r['object_bytes'] / 2**20:6.2f}MiB | {r['store_us']:9.1f} {r['retrieve_us']:12.1f} "
                  f"{r['lookup_us']:10.1f} | {r['store_us'] / rt:.2f} {r['retrieve_us'] / rt:.2f} "
                  f"{r['lookup_us'] / rt:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
