"""Several prompts' stores and retrieves in one request (`Store.chains` / `Retrieve.chains`,
`KVDepotClient.submit_store_many` / `submit_retrieve_many`) against a real daemon, CPU engines
with two KV-cache groups of different block sizes: each run chains onto its own parent, a
missing parent skips only its own run, each run's leading cached chunks are written (its
skipped tokens and missing chunks left alone), every other byte of the target engine stays as
it was, and malformed runs are refused without harm."""

from __future__ import annotations

import random

import pytest
import torch

from kvdepot.client import KVDepotClient, RetrieveItem, StoreItem
from kvdepot.client.kvcache import KVGroupShape, ShmKVCache
from kvdepot.client.many import masked_block_ids
from kvdepot.client.registration import Registration
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError

CHUNK = 32
GROUPS = [KVGroupShape(0, 2, 2, 64, 16, torch.bfloat16), KVGroupShape(1, 2, 2, 64, 32, torch.bfloat16)]
BPC = [CHUNK // g.tokens_per_block for g in GROUPS]  # blocks per chunk per gid: 2, 1


def _register(client, cache, model="many-model"):
    return client.register(model, "tp0of1", CHUNK, cache.storage_specs(), cache.layer_specs(), cache.group_specs(),
                           storage_fds=cache.storage_fds())


def _blocks(free: list[list[int]], chunks: int) -> list[list[int]]:
    """Take ``chunks`` chunks' worth of blocks per gid from the free lists."""
    out = []
    for gid, f in enumerate(free):
        k = chunks * BPC[gid]
        out.append(f[:k])
        del f[:k]
    return out


def _snapshot(cache: ShmKVCache) -> torch.Tensor:
    return cache.storage.clone()


def _layers(gid: int) -> range:
    first = sum(g.num_layers for g in GROUPS[:gid])
    return range(first, first + GROUPS[gid].num_layers)


def test_store_many_and_retrieve_many_move_exactly_each_runs_bytes(daemon):
    rng = random.Random(11)
    nb = [64, 32]
    with ShmKVCache(GROUPS, nb, "LBNHC") as a, ShmKVCache(GROUPS, nb, "LBHNC") as b, \
            KVDepotClient(daemon.endpoint) as client:
        a.storage.copy_(torch.randint(0, 256, (a.size_bytes,), dtype=torch.uint8))
        b.storage.copy_(torch.randint(0, 256, (b.size_bytes,), dtype=torch.uint8))
        reg_a, reg_b = _register(client, a), _register(client, b)
        assert reg_a.chains and reg_b.chains
        free_a = [rng.sample(range(n), n) for n in nb]
        prompts = [[rng.randrange(30000) for _ in range(k * CHUNK)] for k in (1, 3, 2, 2)]
        keys = [reg_a.keys(p) for p in prompts]
        ids_a = [_blocks(free_a, len(k)) for k in keys]

        # prompt 3's first chunk goes alone first: its second chunk then chains onto a cached parent
        assert client.store(reg_a, keys[3][:1], [x[:BPC[g]] for g, x in enumerate(ids_a[3])]).stored == 1
        ghost = reg_a.keys([rng.randrange(30000) for _ in range(CHUNK)])[0]  # a parent never stored
        items = [
            StoreItem(keys[0], ids_a[0]),
            StoreItem(keys[1], ids_a[1]),
            StoreItem(keys[2][1:], [x[BPC[g]:] for g, x in enumerate(ids_a[2])], parent=ghost),
            StoreItem(keys[3][1:], [x[BPC[g]:] for g, x in enumerate(ids_a[3])], parent=keys[3][0]),
            StoreItem(keys[1][:2], [x[:2 * BPC[g]] for g, x in enumerate(ids_a[1])]),  # same chunks again
        ]
        r = client.store_many(reg_a, items)
        assert [(c.stored, c.present, c.skipped) for c in r.chains] == [(1, 0, 0), (3, 0, 0), (0, 0, 1),
                                                                         (1, 0, 0), (0, 2, 0)]
        assert (r.stored, r.present, r.skipped) == (5, 2, 1)

        # B: one lookup-free batch of retrieves, block ids of its own
        free_b = [rng.sample(range(n), n) for n in nb]
        ids_b = [_blocks(free_b, len(k)) for k in keys]
        before = _snapshot(b)
        skip = 16  # prompt 1: its first 16 tokens are B's already (one gid-0 block; gid 1's block is 32 tokens)
        with pytest.raises(KVDepotError) as exc:  # 16 is not a multiple of gid 1's 32 tokens per block
            client.retrieve_many(reg_b, [RetrieveItem(keys[1], ids_b[1], skip_tokens=skip)])
        assert exc.value.code == ErrorCode.INVALID_ARGUMENT
        skip = 32
        got = client.retrieve_many(reg_b, [
            RetrieveItem(keys[0], ids_b[0]),
            RetrieveItem(keys[1], ids_b[1], skip_tokens=skip),
            RetrieveItem(keys[2], ids_b[2]),  # chunk 0 never stored: nothing of it
            RetrieveItem(keys[3], ids_b[3]),
        ])
        assert got == [1, 3, 0, 2]

        # every block B should now hold, and nothing else changed
        want = before.clone()
        expect = {gid: [] for gid in range(len(GROUPS))}  # (a block, b block) pairs written
        for i, n_written, sk in ((0, 1, 0), (1, 3, skip), (3, 2, 0)):
            for gid in range(len(GROUPS)):
                tpb = GROUPS[gid].tokens_per_block
                first = sk // tpb
                pairs = list(zip(ids_a[i][gid], ids_b[i][gid]))[first:n_written * BPC[gid]]
                expect[gid].extend(pairs)
        b_view_after = b.storage.clone()
        b.storage.copy_(want)
        for gid, pairs in expect.items():
            for layer in _layers(gid):
                b.write_tokens(layer, [y for _, y in pairs], a.read_tokens(layer, [x for x, _ in pairs], as_bytes=True),
                               as_bytes=True)
        want = b.storage.clone()
        assert torch.equal(b_view_after, want)
        assert len(expect[0]) == (1 + 3 + 2) * BPC[0] - skip // 16


def test_malformed_runs_are_refused_and_the_daemon_keeps_serving(daemon):
    with ShmKVCache(GROUPS, [16, 8], "LBNHC") as a, KVDepotClient(daemon.endpoint) as client:
        reg = _register(client, a)
        keys = reg.keys(list(range(2 * CHUNK)))
        ids = [[0, 1, 2, 3], [0, 1]]
        bad = [
            m.Store(rid=0, registration=reg.id, keys=keys, block_ids=ids, chains=[m.Chain(1)]),
            m.Store(rid=0, registration=reg.id, keys=keys, block_ids=ids, chains=[m.Chain(0), m.Chain(0)]),
            m.Store(rid=0, registration=reg.id, keys=keys, block_ids=ids, chains=[m.Chain(0), m.Chain(2)]),
            m.Store(rid=0, registration=reg.id, keys=keys, block_ids=ids, parent=keys[0], chains=[m.Chain(0)]),
            m.Retrieve(rid=0, registration=reg.id, keys=keys, block_ids=ids, skip_tokens=32, chains=[m.Chain(0)]),
            m.Retrieve(rid=0, registration=reg.id, keys=keys, block_ids=ids, chains=[m.Chain(0), m.Chain(1, b"", 64)]),
            m.Retrieve(rid=0, registration=reg.id, keys=keys, block_ids=ids, chains=[m.Chain(0, b"", 16)]),
            m.Retrieve(rid=0, registration=reg.id, keys=keys, block_ids=ids, chains=[m.Chain(3)]),
        ]
        for req in bad:
            with pytest.raises(KVDepotError) as exc:
                client.call(req)
            assert exc.value.code == ErrorCode.INVALID_ARGUMENT, req
        assert client.describe().stored_chunks == 0
        r = client.store_many(reg, [StoreItem(keys[:1], [[0, 1], [0]]), StoreItem(keys[1:], [[2, 3], [1]],
                                                                                  parent=keys[0])])
        assert [(c.stored, c.present, c.skipped) for c in r.chains] == [(1, 0, 0), (1, 0, 0)]
        with pytest.raises(KVDepotError) as exc:
            client.submit_store_many(reg, [StoreItem([], [[], []])])
        assert exc.value.code == ErrorCode.INVALID_ARGUMENT


def test_a_daemon_without_chains_is_never_sent_them(daemon):
    with ShmKVCache(GROUPS, [16, 8], "LBNHC") as a, KVDepotClient(daemon.endpoint) as client:
        reg = _register(client, a)
        old = Registration(reg.id, reg.layout_fingerprint, reg.object_bytes, reg.boot_id, reg.request)
        assert not old.chains  # as from a daemon whose RegisterReply has no chains field
        keys = reg.keys(list(range(CHUNK)))
        for call in (lambda: client.submit_store_many(old, [StoreItem(keys, [[0, 1], [0]])]),
                     lambda: client.submit_retrieve_many(old, [RetrieveItem(keys, [[0, 1], [0]])])):
            with pytest.raises(KVDepotError) as exc:
                call()
            assert exc.value.code == ErrorCode.UNSUPPORTED
        assert client.describe().stored_chunks == 0


def test_masked_block_ids_leave_skipped_and_missing_blocks_alone():
    """What one staged scatter over a batch writes (engine-side staging; the scatter itself runs
    on a GPU, `tests/gpu/`): -1 for each run's skipped tokens' blocks and for its chunks past
    what the daemon found."""
    req = m.Register(rid=0, model="x", shard="tp0of1", chunk_size=CHUNK, storages=[], layers=[],
                     groups=[m.KVGroupSpec(0, 16), m.KVGroupSpec(1, 32)])
    reg = Registration("r", "fp", 1, "boot", req, chains=True)
    ids = [list(range(100, 112)), list(range(200, 206))]  # 6 chunks: runs of 2, 3, 1
    chains = [m.Chain(0), m.Chain(2, b"", 32), m.Chain(5)]
    got = masked_block_ids(reg, ids, chains, [2, 2, 0], 6)
    assert got[0] == [100, 101, 102, 103, -1, -1, 106, 107, -1, -1, -1, -1]
    assert got[1] == [200, 201, -1, 203, -1, -1]
    assert ids[0][4] == 104  # the caller's lists are not changed


def test_the_transfer_benchmarks_batched_streams_move_every_chunk(daemon):
    """benchmarks/transfer.py --per-message: its pipelined store and retrieve streams with several
    one-chunk prompts per request (CPU engines here; the figures come from the GPU machine)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from transfer_bench.workload import _Work, retrieve_pipelined, run_parallel, store_pipelined

    rng = random.Random(5)
    nb = [64, 32]
    with ShmKVCache(GROUPS, nb, "LBNHC") as a, ShmKVCache(GROUPS, nb, "LBHNC") as b, \
            KVDepotClient(daemon.endpoint) as client:
        a.storage.copy_(torch.randint(0, 256, (a.size_bytes,), dtype=torch.uint8))
        reg_a, reg_b = _register(client, a), _register(client, b)
        n = 10  # 3 messages of 3 and one of 1
        keys = [reg_a.keys([rng.randrange(30000) for _ in range(CHUNK)])[0] for _ in range(n)]
        free_a, free_b = [rng.sample(range(x), x) for x in nb], [rng.sample(range(x), x) for x in nb]
        src, dst = [_blocks(free_a, 1) for _ in range(n)], [_blocks(free_b, 1) for _ in range(n)]
        ws = _Work(zip(keys, src))
        run_parallel([store_pipelined(client, reg_a, None, ws, 2, per_message=3)])
        assert ws.done == n
        wr = _Work(zip(keys, dst))
        run_parallel([retrieve_pipelined(client, reg_b, None, wr, 2, per_message=3)])
        assert wr.done == n
        for gid in range(len(GROUPS)):
            for layer in _layers(gid):
                xs = [x for ids in src for x in ids[gid]]
                ys = [y for ids in dst for y in ids[gid]]
                assert torch.equal(a.read_tokens(layer, xs, as_bytes=True), b.read_tokens(layer, ys, as_bytes=True))
