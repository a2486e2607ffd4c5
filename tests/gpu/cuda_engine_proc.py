"""A CUDA engine process for tests/gpu/test_cuda_daemon.py: ``store`` or ``retrieve`` role.

Runs in its own process so CUDA IPC handles and interprocess events are real. Writes a JSON
result to ``--out``; exit code 0 means it ran (the test checks the figures).
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import time

import torch

from kvdepot.client import KVDepotClient
from kvdepot.client.kvcache import KVGroupShape, ShmKVCache

SHAPES = {
    "llama8b": [KVGroupShape(0, 8, 8, 128, 16, torch.bfloat16)],
    "hybrid": [KVGroupShape(0, 4, 8, 64, 16, torch.bfloat16), KVGroupShape(1, 4, 8, 64, 32, torch.bfloat16)],
    "mla": [KVGroupShape(0, 6, 1, 576, 16, torch.bfloat16, mla=True)],
    "fp8_ds_mla": [KVGroupShape(0, 6, 1, 656, 16, torch.uint8, mla=True)],
}
NUM_BLOCKS = 96
CHUNK = 64


def tokens(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(50000) for _ in range(n)]


def block_ids(seed: int, groups, n_chunks: int) -> list[list[int]]:
    r = random.Random(seed)
    return [r.sample(range(NUM_BLOCKS), n_chunks * CHUNK // g.tokens_per_block) for g in groups]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["store", "retrieve"])
    p.add_argument("--endpoint", required=True)
    p.add_argument("--shape", required=True)
    p.add_argument("--layout", required=True)
    p.add_argument("--ref", required=True, help="file of the stored tokens' bytes (written by store)")
    p.add_argument("--out", required=True)
    p.add_argument("--chunks", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="other tokens and bytes (0: the default ones)")
    p.add_argument("--skip-tokens", type=int, default=0)
    p.add_argument("--early", action="store_true", help="store with an early reply, then overwrite the blocks")
    p.add_argument("--cpu-wait", action="store_true", help="wait for the daemon's events on the CPU, not the stream")
    p.add_argument("--staging", choices=["engine", "daemon"], default="daemon",
                   help="engine: this process gathers / scatters through the staging ring (local_storages)")
    a = p.parse_args()
    groups = SHAPES[a.shape]
    dev = torch.device("cuda")
    cache = ShmKVCache(groups, NUM_BLOCKS, a.layout, device=dev)
    client = KVDepotClient(a.endpoint, timeout_s=60)
    reg = client.register(f"gpu-test-{a.shape}", "replicated" if "mla" in a.shape else "tp0of1", CHUNK,
                          cache.storage_specs(), cache.layer_specs(), cache.group_specs(), device=cache.register_device,
                          local_storages=[cache.storage] if a.staging == "engine" else None)
    keys = reg.keys(tokens(7 + a.seed, a.chunks * CHUNK + 5))
    stream = torch.cuda.Stream()
    result: dict = {"registration": reg.id, "staged": reg.staging is not None}
    if a.role == "store":
        ids = block_ids(11, groups, a.chunks)
        with torch.cuda.stream(stream):
            # keep the GPU busy first, so a daemon that did not wait on our event would copy zeros
            torch.cuda._sleep(200_000_000)
            cache.storage.copy_(torch.randint(0, 256, (cache.size_bytes,), dtype=torch.uint8, device=dev,
                                              generator=torch.Generator(device=dev).manual_seed(3 + a.seed)))
        if not a.early:
            r = client.store(reg, keys, ids, after=stream)  # no synchronize: ordering is the event's job
        else:
            # the reply comes at enqueue; overwriting the blocks on `stream` right after must not
            # reach the stored bytes (the stream waits for the daemon's gathers)
            # with --cpu-wait the engine also waits until the bytes are in L1 (the stored event)
            r = client.store(reg, keys, ids, after=stream, early=True, cpu_wait=a.cpu_wait, in_l1=a.cpu_wait)
        result.update(stored=r.stored, present=r.present, skipped=r.skipped, early_event=bool(r.event),
                      stored_event=bool(r.stored_event))
        if a.early:
            with torch.cuda.stream(stream):
                ref = [cache.read_tokens(li, ids[gid], as_bytes=True) for li, gid in enumerate(cache.layer_gids)]
                cache.storage.fill_(0xEE)  # after the daemon's gathers, whatever they cost
            stream.synchronize()
            ref = [t.cpu() for t in ref]
            # the store becomes visible once in L1: wait for it (the retrieving engine looks it up)
            deadline = time.monotonic() + 30
            while client.lookup(keys[:a.chunks], CHUNK) < a.chunks and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            stream.synchronize()
            ref = [cache.read_tokens(li, ids[gid], as_bytes=True).cpu() for li, gid in enumerate(cache.layer_gids)]
        torch.save(ref, a.ref)
    else:
        ids = block_ids(23, groups, a.chunks)
        cache.storage.fill_(0x5A)
        torch.cuda.synchronize()
        hit = client.lookup(keys, CHUNK, num_tokens=a.chunks * CHUNK + 5)
        n = client.retrieve(reg, keys[:hit], [i[: hit * CHUNK // g.tokens_per_block] for i, g in zip(ids, groups)],
                            skip_tokens=a.skip_tokens, before=stream, cpu_wait=a.cpu_wait)
        with torch.cuda.stream(stream):  # stream-ordered after the daemon's event
            got = [cache.read_tokens(li, ids[gid], as_bytes=True).cpu() for li, gid in enumerate(cache.layer_gids)]
        stream.synchronize()
        ref = torch.load(a.ref)
        bad = 0
        untouched_ok = True
        for li, gid in enumerate(cache.layer_gids):
            bs = groups[gid].tokens_per_block
            skip_rows = a.skip_tokens  # tokens are rows of read_tokens' first dim
            bad += int((got[li][skip_rows:] != ref[li][skip_rows:]).sum())
            untouched_ok &= bool((got[li][:skip_rows] == 0x5A).all())
            assert skip_rows % bs == 0
        result.update(hit=hit, retrieved=n, mismatched=bad, skipped_untouched=untouched_ok,
                      compared=sum(int(t.numel()) for t in ref))
    client.unregister(reg)
    client.close()
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
