"""The CUDA path the vLLM connector's worker takes, without vLLM: stores gathered on the
engine's stream and never waited for (the next "forward" on that stream overwrites the blocks
at once), a full staging ring answered with None instead of a wait, retrieves whose daemon
event is queried (never waited on) before the scatter, and a block id of -1 (vLLM's null
block) left unwritten by the scatter kernel. Skipped cleanly without CUDA."""

from __future__ import annotations

import random
import time

import pytest
import torch
from gpu_daemon import serve

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CHUNK = 64
NUM_BLOCKS = 96
GROUPS_ARGS = [(0, 4, 2, 128, 16), (1, 2, 2, 128, 32)]  # (gid, layers, heads, head dim, tokens per block)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    yield from serve(tmp_path_factory.mktemp("nonblocking-daemon"), "2g")


def _engine(daemon, layout, staging_bytes=64 << 20):
    from kvdepot.client import KVDepotClient
    from kvdepot.client.kvcache import KVGroupShape, ShmKVCache

    groups = [KVGroupShape(*a, torch.bfloat16) for a in GROUPS_ARGS]
    cache = ShmKVCache(groups, NUM_BLOCKS, layout, device=torch.device("cuda"))
    c = KVDepotClient(daemon, timeout_s=30, connect=False)
    reg = c.register("nonblocking-test", "tp0of1", CHUNK, cache.storage_specs(), cache.layer_specs(),
                     cache.group_specs(), device="cuda", local_storages=[cache.storage], staging_bytes=staging_bytes)
    assert reg.staging is not None, "engine-side staging is off (no kernel library?)"
    return c, cache, groups, reg


def _poll_until(client, pendings, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not all(p.done() for p in pendings):
        assert time.monotonic() < deadline, "no answer"
        client.poll(0.001)


def _tokens_of(cache, groups, ids):
    return [cache.read_tokens(li, ids[gid], as_bytes=True).clone()
            for li, gid in enumerate(cache.layer_gids)]


def test_stores_never_wait_and_the_next_forward_may_overwrite_at_once(daemon):
    rng = random.Random(3)
    a, cache_a, groups, reg_a = _engine(daemon, "LBNHC")
    b, cache_b, _, reg_b = _engine(daemon, "LBHNC")
    try:
        a.flush()
        s = torch.cuda.Stream()
        n_req = 6
        want, keys, pendings = [], [], []
        ids = [[rng.sample(range(1, NUM_BLOCKS), 2 * CHUNK // g.tokens_per_block) for g in groups]
               for _ in range(n_req)]
        with torch.cuda.stream(s):
            for r in range(n_req):
                # "forward": this step's KV into the request's blocks, on the engine's stream
                cache_a.storage.random_(0, 256, generator=None)
                want.append(_tokens_of(cache_a, groups, ids[r]))
                k = reg_a.keys([r * 7919 + t for t in range(2 * CHUNK)])
                keys.append(k)
                t0 = time.perf_counter()
                p = a.submit_store(reg_a, k, ids[r], request=f"r{r}", after=s, wait_for_room=False)
                assert p is not None and time.perf_counter() - t0 < 0.05
                pendings.append(p)
            cache_a.storage.zero_()  # the next forward reuses the blocks before any reply came
        _poll_until(a, pendings)
        assert [p.result().stored for p in pendings] == [2] * n_req
        # retrieve into other blocks of another layout; gid 1's first block is "vLLM's null block"
        null = 0
        cache_b.storage.fill_(0x5A)
        torch.cuda.synchronize()
        null_before = _tokens_of(cache_b, groups, [[null], [null]])
        got_ids, gets = [], []
        free = [rng.sample(range(1, NUM_BLOCKS), n_req * 2 * CHUNK // g.tokens_per_block) for g in groups]
        for r in range(n_req):  # destinations: no block in two retrieves
            dst = [f[r * len(f) // n_req:(r + 1) * len(f) // n_req] for f in free]
            got_ids.append(dst)
            holed = [list(dst[0]), [-1] + list(dst[1][1:])] if r == 0 else dst
            p = b.submit_retrieve(reg_b, keys[r], holed, request=f"g{r}", wait_for_room=False)
            assert p is not None
            gets.append(p)
        _poll_until(b, gets)  # done(): reply in and the daemon's event completed (queried)
        with torch.cuda.stream(s):
            assert [p.result(before=s) for p in gets] == [2] * n_req
        s.synchronize()
        for r in range(n_req):
            got = _tokens_of(cache_b, groups, got_ids[r])
            for li, gid in enumerate(cache_b.layer_gids):
                if r == 0 and gid == 1:  # the first block was left alone: only the rest matches
                    per = groups[1].tokens_per_block
                    assert torch.equal(got[li][per:], want[r][li][per:]), (r, li)
                    assert not torch.equal(got[li][:per], want[r][li][:per])
                else:
                    assert torch.equal(got[li], want[r][li]), (r, li)
        assert all(torch.equal(x, y) for x, y in zip(null_before, _tokens_of(cache_b, groups, [[null], [null]])))
    finally:
        a.close()
        b.close()


def test_a_full_ring_is_answered_with_none_never_a_wait(daemon):
    rng = random.Random(4)
    probe_c, _, _, probe = _engine(daemon, "LBNHC", 1 << 20)
    ob = probe.object_bytes
    probe_c.unregister(probe)
    probe_c.close()
    a, cache, groups, reg = _engine(daemon, "LBNHC", 3 * ob + 256)  # room for three chunks
    try:
        s = torch.cuda.Stream()
        ids = [rng.sample(range(NUM_BLOCKS), CHUNK // g.tokens_per_block) for g in groups]
        held = []
        # no poll between the submits: no reply is taken, so no region frees (a store waits
        # for its own gather before it is sent, so a long kernel ahead of it would be waited
        # for: that is not the ring)
        for r in range(5):
            t0 = time.perf_counter()
            p = a.submit_store(reg, reg.keys([r + 1] * CHUNK), ids, after=s, wait_for_room=False)
            if p is None:
                assert time.perf_counter() - t0 < 0.05, "a full ring must not be waited for"
            held.append(p)
        assert [p is not None for p in held] == [True, True, True, False, False]
        _poll_until(a, [p for p in held if p is not None], timeout_s=60)
        assert a.submit_store(reg, reg.keys([9] * CHUNK), ids, after=s, wait_for_room=False) is not None
    finally:
        a.close()


def test_several_prompts_per_request_staged_store_and_retrieve_exactly_their_bytes(daemon):
    """`submit_store_many` / `submit_retrieve_many` with engine-side staging: one region, one
    gather and one scatter for several prompts' runs; each run chains onto its own parent, a
    run whose chunks the daemon lacks is left alone by the one scatter, and so are a run's
    skipped tokens; every other byte of the target engine stays as it was."""
    from kvdepot.client import RetrieveItem, StoreItem

    rng = random.Random(17)
    a, cache_a, groups, reg_a = _engine(daemon, "LBNHC")
    b, cache_b, _, reg_b = _engine(daemon, "LBHNC")
    try:
        assert reg_a.chains
        a.flush()
        bpc = [CHUNK // g.tokens_per_block for g in groups]
        free_a = [rng.sample(range(NUM_BLOCKS), NUM_BLOCKS) for _ in groups]
        free_b = [rng.sample(range(NUM_BLOCKS), NUM_BLOCKS) for _ in groups]

        def take(free, chunks):
            out = []
            for g, f in enumerate(free):
                out.append(f[:chunks * bpc[g]])
                del f[:chunks * bpc[g]]
            return out

        sizes = (1, 3, 2, 2)
        keys = [reg_a.keys([rng.randrange(1 << 20) for _ in range(k * CHUNK)]) for k in sizes]
        ids_a = [take(free_a, k) for k in sizes]
        cache_a.storage.random_(0, 256)  # the "forward", on the current stream
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())  # the gather follows it
        ghost = reg_a.keys([rng.randrange(1 << 20) for _ in range(CHUNK)])[0]
        items = [StoreItem(keys[0], ids_a[0]), StoreItem(keys[1], ids_a[1]),
                 StoreItem(keys[2][1:], [x[bpc[g]:] for g, x in enumerate(ids_a[2])], parent=ghost),
                 StoreItem(keys[3], ids_a[3])]
        p = a.submit_store_many(reg_a, items, after=s, wait_for_room=False)
        assert p is not None
        r = p.result()
        assert [(c.stored, c.present, c.skipped) for c in r.chains] == [(1, 0, 0), (3, 0, 0), (0, 0, 1), (2, 0, 0)]

        cache_b.storage.random_(0, 256)
        torch.cuda.synchronize()
        before = cache_b.storage.clone()
        ids_b = [take(free_b, k) for k in sizes]
        skip = 32  # prompt 1: its first 32 tokens are B's already (a multiple of both groups' 16 / 32)
        pr = b.submit_retrieve_many(reg_b, [RetrieveItem(keys[0], ids_b[0]),
                                            RetrieveItem(keys[1], ids_b[1], skip_tokens=skip),
                                            RetrieveItem(keys[2], ids_b[2]), RetrieveItem(keys[3], ids_b[3])])
        assert pr.result(s) == 6 and pr.chains_retrieved == [1, 3, 0, 2]
        s.synchronize()

        # expected: B as before, with exactly the retrieved blocks' tokens copied from A
        got = cache_b.storage.clone()
        cache_b.storage.copy_(before)
        for i, k_written, sk in ((0, 1, 0), (1, 3, skip), (3, 2, 0)):
            for li, gid in enumerate(cache_a.layer_gids):
                tpb = groups[gid].tokens_per_block
                xs = ids_a[i][gid][sk // tpb:k_written * bpc[gid]]
                ys = ids_b[i][gid][sk // tpb:k_written * bpc[gid]]
                cache_b.write_tokens(li, ys, cache_a.read_tokens(li, xs, as_bytes=True), as_bytes=True)
        torch.cuda.synchronize()
        assert torch.equal(got, cache_b.storage)
    finally:
        torch.cuda.synchronize()
        a.close()
        b.close()


def test_pieces_gathered_by_one_call_store_exactly_their_bytes_after_the_forward_overwrote_them(daemon):
    """`stage_store_pieces`: one gather for three requests' regions end to end, each sent with
    its own region (its fence word written after the one gather), the next "forward" on the
    same stream overwriting the blocks at once; another engine retrieves the chunks and gets
    the bytes as they were before the overwrite."""
    rng = random.Random(23)
    a, cache_a, groups, reg_a = _engine(daemon, "LBNHC")
    b, cache_b, _, reg_b = _engine(daemon, "LBHNC")
    try:
        a.flush()
        bpc = [CHUNK // g.tokens_per_block for g in groups]
        sizes = (2, 3, 1)
        n = sum(sizes)
        ids_a = [rng.sample(range(NUM_BLOCKS), n * k) for k in bpc]
        keys = reg_a.keys([rng.randrange(1 << 20) for _ in range(n * CHUNK)])
        cache_a.storage.random_(0, 256)
        stream = torch.cuda.current_stream()
        regions = a.stage_store_pieces(reg_a, ids_a, sizes, stream)
        assert regions is not None and [r.seq for r in regions] == list(range(regions[0].seq, regions[0].seq + 3))
        assert [r.offset for r in regions[1:]] == [r.offset + r.size_bytes for r in regions[:-1]]
        want = _tokens_of(cache_a, groups, ids_a)  # enqueued after the gather on the same stream
        cache_a.storage.random_(0, 256)  # the next forward: the gather ran before it, in stream order
        pendings, first = [], 0
        for k, region in zip(sizes, regions):
            ids = [x[first * m:(first + k) * m] for x, m in zip(ids_a, bpc)]
            parent = keys[first - 1] if first else b""
            pendings.append(a.submit_store(reg_a, keys[first:first + k], ids, parent=parent, staged=region))
            first += k
        assert [p.result().stored for p in pendings] == list(sizes)

        ids_b = [rng.sample(range(NUM_BLOCKS), n * k) for k in bpc]
        assert b.retrieve(reg_b, keys, ids_b) == n
        torch.cuda.synchronize()
        got = _tokens_of(cache_b, groups, ids_b)
        assert all(torch.equal(x, y) for x, y in zip(got, want))
    finally:
        torch.cuda.synchronize()
        a.close()
        b.close()
