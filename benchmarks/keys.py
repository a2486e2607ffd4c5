"""What chunk keys cost the vLLM scheduler: every shard's keys of one long prompt (no GPU).

The scheduler hashes each new prompt once (`kvdepot.client.hashing`: one BLAKE2b chain over
the tokens, then one XOR mask per tensor-parallel shard). Printed next to the same run's
floor: one BLAKE2b pass over the prompt's packed token bytes (what reading every token
through the hash costs at least) and the per-shard chains that version 1 of the keys computed
(every token hashed once per shard); and the keys the vLLM connector makes by default, from
vLLM's own block hashes (`chain_from_block_hashes`: no token read).

    python benchmarks/keys.py [--tokens 131072] [--chunk-size 256] [--tp 8] [--out r.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import time
from array import array

from kvdepot.client.hashing import (chain_from_block_hashes, chain_hashes, namespace_seed, shard_keys, shard_mask,
                                    shard_name)


def _best_ms(fn, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(128256) for _ in range(args.tokens)]
    shards = [shard_name(r, args.tp) for r in range(args.tp)]
    seed = namespace_seed("meta-llama/Llama-3.1-70B", "0" * 32, "tenant")

    def keys() -> list[list[bytes]]:
        return shard_keys(chain_hashes(seed, tokens, args.chunk_size), [shard_mask(seed, s) for s in shards])

    def floor() -> bytes:
        return hashlib.blake2b(array("I", tokens).tobytes(), digest_size=16).digest()

    def per_shard_chains() -> None:  # hashing v1: every token once per shard
        for s in shards:
            chain_hashes(shard_mask(seed, s), tokens, args.chunk_size)

    # the vLLM connector's default (``key_source`` auto): chain values taken from vLLM's own
    # SHA-256 block hashes (16-token blocks), no token read
    block = 16
    block_hashes = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(args.tokens // block)]

    def keys_from_block_hashes() -> list[list[bytes]]:
        chain = chain_from_block_hashes(block_hashes, args.chunk_size // block, 0, args.tokens // args.chunk_size)
        return shard_keys(chain, [shard_mask(seed, s) for s in shards])

    got = keys()
    assert len(got) == args.tp and all(len(k) == args.tokens // args.chunk_size for k in got)
    res = {}
    assert [len(k) for k in keys_from_block_hashes()] == [len(k) for k in got]
    for name, fn in (("keys", keys), ("floor_one_pass", floor), ("v1_per_shard_chains", per_shard_chains),
                     ("keys_from_block_hashes", keys_from_block_hashes)):
        best, med = _best_ms(fn, args.repeats)
        res[name] = {"best_ms": round(best, 3), "median_ms": round(med, 3)}
    print(f"{args.tokens} tokens, {args.chunk_size}-token chunks, TP={args.tp} ({args.tp} key chains of "
          f"{args.tokens // args.chunk_size} keys), best / median of {args.repeats}:")
    for name, r in res.items():
        print(f"  {name:22s} {r['best_ms']:7.3f} / {r['median_ms']:7.3f} ms")
    ratio = res["keys"]["median_ms"] / res["floor_one_pass"]["median_ms"]
    print(f"  keys / one-pass floor: {ratio:.2f}x (median); target: keys <= 2 ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": res, "keys_over_floor": round(ratio, 3)}, f, indent=1)


if __name__ == "__main__":
    main()
