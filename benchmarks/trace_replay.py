"""Replay a Mooncake-format request trace through a real daemon: prefix hit ratio per tier
configuration, next to LRU and Belady computed on the same trace (no GPU).

Each request's ``hash_ids`` (one per 512-token block, prefix-chained) become chunk keys; an
engine process does what vLLM does per request: LOOKUP the chain, RETRIEVE the hit chunks
(chunks in L2 are read back into L1 first), STORE the rest. The hit ratio is hit tokens over
prompt tokens. The engine's KV is a one-layer model (16 KiB per 512-token chunk) so the replay
takes minutes; capacities are given in tokens, as for a real model. By default the replay waits
for L2's write queue to drain before each request (a disk that keeps up with the trace's real
rate, 4 requests/s); ``--no-pace`` replays back to back and counts the writes dropped.

Configurations: L1 = ``--l1-tokens``; L1 + L2 of ``--l2-factor`` x L1; L1 unbounded. References
on the same chunk sequence: LRU at L1 and at L1 + L2 capacity, Belady (evict the chunk used
furthest in the future) at L1 capacity, and unbounded.

    python benchmarks/trace_replay.py [--trace F] [--l1-tokens 3000000] [--l2-factor 10] [--out r.json]
"""

from __future__ import annotations

import argparse
import gzip
import heapq
import json
import shutil
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import torch

from kvdepot.client import KVDepotClient
from kvdepot.client.kvcache import KVGroupShape, ShmKVCache
from transfer_bench.procs import DaemonProc

TRACE = Path(__file__).resolve().parent / "data" / "mooncake_fast25_synthetic_trace.jsonl.gz"
BLOCK_TOKENS = 512  # the trace's block
GROUP = KVGroupShape(0, 1, 1, 8, 16, torch.bfloat16)  # 32 bytes per token: 16 KiB per chunk


def load_trace(path: Path, limit: int = 0) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit] if limit else rows


# ---------------------------------------------------------------------------- references


def hit_tokens(r: dict, hit_blocks: int) -> int:
    return min(hit_blocks * BLOCK_TOKENS, r["input_length"])


def simulate_lru(trace: list[dict], capacity: int | None) -> float:
    """Prefix hit ratio of an LRU cache of ``capacity`` chunks (None: unbounded); a request's
    chain is touched tail first (parents most recent), as the daemon does."""
    cache: OrderedDict[tuple, None] = OrderedDict()
    hit = total = 0
    for r in trace:
        chain = list(enumerate(r["hash_ids"]))
        n = 0
        while n < len(chain) and chain[n] in cache:
            n += 1
        hit += hit_tokens(r, n)
        total += r["input_length"]
        for c in reversed(chain):
            cache[c] = None
            cache.move_to_end(c)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return hit / total


def simulate_belady(trace: list[dict], capacity: int) -> float:
    """Prefix hit ratio of a cache of ``capacity`` chunks that evicts the chunk whose next use
    is furthest in the future (Belady's MIN, per chunk)."""
    seq = [(i, h) for r in trace for i, h in enumerate(r["hash_ids"])]
    nxt = [0] * len(seq)
    last: dict = {}
    for t in range(len(seq) - 1, -1, -1):
        nxt[t] = last.get(seq[t], 1 << 60)
        last[seq[t]] = t
    cache: dict = {}  # chunk -> its next use
    heap: list = []  # (-next use, chunk), lazily deleted
    hit = total = 0
    t = 0
    for r in trace:
        chain = list(enumerate(r["hash_ids"]))
        n = 0
        while n < len(chain) and chain[n] in cache:
            n += 1
        hit += hit_tokens(r, n)
        total += r["input_length"]
        for c in chain:
            cache[c] = nxt[t]
            heapq.heappush(heap, (-nxt[t], c))
            t += 1
            while len(cache) > capacity:
                neg, victim = heapq.heappop(heap)
                if cache.get(victim) == -neg:
                    del cache[victim]
    return hit / total


# ---------------------------------------------------------------------------- the daemon


def replay(trace: list[dict], workdir: Path, l1_tokens: int, l2_tokens: int, pace: bool) -> dict:
    """Run the trace through a fresh daemon with these capacities; hit ratio and tier figures."""
    max_blocks = max(len(r["hash_ids"]) for r in trace) * BLOCK_TOKENS // GROUP.tokens_per_block
    cache = ShmKVCache([GROUP], max_blocks, "LBNHC")
    chunk_bytes = GROUP.num_layers * GROUP.token_bytes * BLOCK_TOKENS
    l1_bytes = (l1_tokens // BLOCK_TOKENS) * chunk_bytes
    args = []
    if l2_tokens:
        args = ["--l2-path", str(workdir / "l2"), "--l2-bytes", str((l2_tokens // BLOCK_TOKENS) * (chunk_bytes + 4096))]
    d = DaemonProc(str(l1_bytes), args, None, pin=False)
    d.wait_ready()
    c = KVDepotClient(d.endpoint, timeout_s=60.0, name="trace-replay")
    try:
        reg = c.register("trace-model", "tp0of1", BLOCK_TOKENS, cache.storage_specs(), cache.layer_specs(),
                         cache.group_specs(), storage_fds=cache.storage_fds())
        per_chunk = BLOCK_TOKENS // GROUP.tokens_per_block
        hit = total = retrieved = stored = 0
        t0 = time.perf_counter()
        for r in trace:
            # one token id per block id: equal ids at equal positions give equal chunk keys
            tokens = [h for h in r["hash_ids"] for _ in range(BLOCK_TOKENS)]
            keys = reg.keys(tokens)
            n = c.lookup(keys, BLOCK_TOKENS, num_tokens=r["input_length"], model="trace-model")
            got = c.retrieve(reg, keys[:n], [list(range(n * per_chunk))]) if n else 0
            retrieved += got
            hit += hit_tokens(r, got)
            total += r["input_length"]
            if got < len(keys):
                rest = keys[got:]
                s = c.store(reg, rest, [list(range(len(rest) * per_chunk))], parent=keys[got - 1] if got else b"")
                stored += s.stored
            if pace and l2_tokens:
                while next(t for t in c.describe().tiers if t.name == "l2").queue_depth:
                    time.sleep(0.001)
        wall_s = time.perf_counter() - t0
        info = c.describe()
        c.unregister(reg)
    finally:
        c.close()
        cache.close()
        d.stop()
    return {"hit_ratio": hit / total, "retrieved_chunks": retrieved, "stored_chunks": stored, "wall_s": wall_s,
            "tiers": [{k: getattr(t, k) for k in ("name", "capacity_bytes", "used_bytes", "num_objects", "hit_chunks",
                                                  "evictions", "read_bytes", "written_bytes", "dropped_writes",
                                                  "errors", "corrupt_objects")} for t in info.tiers]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=0, help="replay only the first N requests")
    ap.add_argument("--l1-tokens", type=int, default=3_000_000)
    ap.add_argument("--l2-factor", type=float, default=10.0)
    ap.add_argument("--no-pace", dest="pace", action="store_false")
    ap.add_argument("--dir", default="", help="where L2 lives (default: a temporary directory)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    trace = load_trace(args.trace, args.requests)
    c1 = args.l1_tokens // BLOCK_TOKENS
    c2 = int(c1 * (1 + args.l2_factor))
    refs = {"lru_l1": simulate_lru(trace, c1), "lru_l1_l2": simulate_lru(trace, c2),
            "belady_l1": simulate_belady(trace, c1), "unbounded": simulate_lru(trace, None)}
    res = {"trace": str(args.trace), "requests": len(trace), "l1_tokens": args.l1_tokens,
           "l2_tokens": int(args.l1_tokens * args.l2_factor), "pace": args.pace, "references": refs, "daemon": {}}
    work = Path(tempfile.mkdtemp(prefix="kvdepot-replay-", dir=args.dir or None))
    try:
        distinct = len({(i, h) for r in trace for i, h in enumerate(r["hash_ids"])})
        configs = {"L1": (args.l1_tokens, 0), "L1+L2": (args.l1_tokens, res["l2_tokens"]),
                   "L1 unbounded": ((distinct + 16) * BLOCK_TOKENS, 0)}
        for name, (l1, l2) in configs.items():
            out = replay(trace, work / name.replace(" ", "_").replace("+", "_"), l1, l2, args.pace)
            res["daemon"][name] = out
            print(f"{name:<14} hit ratio {out['hit_ratio']:.4f}  ({out['wall_s']:.0f} s; "
                  + ", ".join(f"{t['name']}: {t['hit_chunks']} hits, {t['evictions']} evicted"
                              + (f", {t['dropped_writes']} writes dropped" if t['name'] != 'l1' else "")
                              for t in out["tiers"]) + ")")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    unb = res["daemon"]["L1 unbounded"]["hit_ratio"]
    res["l1_l2_vs_unbounded"] = res["daemon"]["L1+L2"]["hit_ratio"] / unb if unb else None
    print(f"references: LRU at L1 {refs['lru_l1']:.4f}, LRU at L1+L2 {refs['lru_l1_l2']:.4f}, "
          f"Belady at L1 {refs['belady_l1']:.4f}, unbounded {refs['unbounded']:.4f}")
    print(f"L1+L2 reaches {100 * res['l1_l2_vs_unbounded']:.1f}% of the unbounded daemon's hit ratio")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
