"""Gated retrieves (`KVDepotClient.submit_retrieve`'s ``scatter_on``, `Retrieve.landed`): the
engine enqueues its scatter before sending the request, behind a GPU wait for the landed word
the daemon's DMA stream writes after its copies. Every outcome writes exactly the chunks the
reply counts and leaves every other block alone, and no outcome leaves the engine's stream
waiting: full hits, partial hits, misses, skipped leading tokens, refused requests, a daemon
that stops answering. Skipped cleanly without CUDA."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
from gpu_daemon import serve

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CHUNK = 32
NUM_BLOCKS = 96
FILL = 0x5A
OBJECT_BYTES = (3 + 2) * 2 * 2 * 64 * 2 * CHUNK  # (layers of both groups) * K/V * heads * head dim * bf16 * tokens


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    yield from serve(tmp_path_factory.mktemp("gated-daemon"), "1g")


def _engine(endpoint, staging_bytes=8 << 20, timeout_s=30.0):
    from kvdepot.client import KVDepotClient
    from kvdepot.client.kvcache import KVGroupShape, ShmKVCache

    groups = [KVGroupShape(0, 3, 2, 64, 16, torch.bfloat16), KVGroupShape(1, 2, 2, 64, 32, torch.bfloat16)]
    cache = ShmKVCache(groups, NUM_BLOCKS, "LBNHC", device=torch.device("cuda"))
    c = KVDepotClient(endpoint, timeout_s=timeout_s)
    reg = c.register("gated-test", "tp0of1", CHUNK, cache.storage_specs(), cache.layer_specs(),
                     cache.group_specs(), device="cuda", local_storages=[cache.storage], staging_bytes=staging_bytes)
    assert reg.staging is not None and reg.staging.landed_active, "the daemon does not write landed words"
    return c, cache, groups, reg


def _disjoint(rng, groups, n_chunks, count):
    per_group = [rng.sample(range(NUM_BLOCKS), count * n_chunks * CHUNK // g.tokens_per_block) for g in groups]
    return [[ids[r * len(ids) // count:(r + 1) * len(ids) // count] for ids in per_group] for r in range(count)]


def _tokens(cache, ids):
    return [cache.read_tokens(li, ids[gid], as_bytes=True).clone() for li, gid in enumerate(cache.layer_gids)]


def _chunk_blocks(groups, ids, j):
    """Chunk j's block ids per group."""
    return [x[j * (CHUNK // g.tokens_per_block):(j + 1) * (CHUNK // g.tokens_per_block)] for g, x in zip(groups, ids)]


def _blank(cache, rng, groups, n_chunks):
    """Every block FILL; returns fresh target block ids for ``n_chunks`` chunks."""
    cache.storage.fill_(FILL)
    torch.cuda.synchronize()
    return _disjoint(rng, groups, n_chunks, 1)[0]


def _drained(stream, wait_s=10.0) -> bool:
    """Whether everything enqueued on ``stream`` ran within ``wait_s`` (a gate left closed would
    hold it forever)."""
    ev = torch.cuda.Event()
    ev.record(stream)
    deadline = time.monotonic() + wait_s
    while not ev.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _stored(c, cache, groups, reg, rng, n_chunks):
    """Store ``n_chunks`` chunks of random bytes; returns (keys, per chunk the bytes of its blocks)."""
    keys = reg.keys([rng.randrange(50000) for _ in range(n_chunks * CHUNK)])
    src = _disjoint(rng, groups, n_chunks, 1)[0]
    cache.storage.copy_(torch.randint(0, 256, (cache.size_bytes,), dtype=torch.uint8, device="cuda"))
    refs = [_tokens(cache, _chunk_blocks(groups, src, j)) for j in range(n_chunks)]
    assert c.store(reg, keys, src, after=torch.cuda.current_stream()).stored == n_chunks
    return keys, refs


def _check(cache, groups, dst, refs, written: int, skipped_chunks: int = 0):
    """Chunks [skipped_chunks, written) of ``dst`` hold their bytes; every other block FILL."""
    for j in range(len(refs)):
        got = _tokens(cache, _chunk_blocks(groups, dst, j))
        if skipped_chunks <= j < written:
            for a, b in zip(got, refs[j]):
                assert torch.equal(a, b), f"chunk {j}"
        else:
            for a in got:
                assert bool((a == FILL).all()), f"chunk {j} was written"


def test_gated_retrieves_write_exactly_the_chunks_their_reply_counts(daemon):
    """Full hits, partial hits (the daemon's count in the landed word stops the scatter), misses
    (the engine opens the gate itself), leading chunks skipped, and the ring wrapping under
    many of them: each chunk counted is exact, no other block is touched, the stream drains."""
    c, cache, groups, reg = _engine(daemon, staging_bytes=4 * 3 * OBJECT_BYTES)  # four 3-chunk regions
    try:
        rng = random.Random(5)
        s = torch.cuda.Stream()
        keys, refs = _stored(c, cache, groups, reg, rng, 3)
        unknown = reg.keys([rng.randrange(50000) for _ in range(CHUNK)])
        cases = [  # (keys, chunks written, chunks skipped)
            (keys, 3, 0),
            (keys[:2] + unknown, 2, 0),
            (unknown + keys[1:], 0, 0),
        ]
        for round_ in range(12):  # the ring (four 3-chunk regions' worth) wraps several times
            for want_keys, written, _ in cases:
                dst = _blank(cache, rng, groups, 3)
                p = c.submit_retrieve(reg, want_keys, dst, scatter_on=s)
                assert p._gated
                assert p.result(s) == written
                assert _drained(s)
                _check(cache, groups, dst, refs, written)
        dst = _blank(cache, rng, groups, 3)  # the first chunk's tokens left alone
        assert c.retrieve(reg, keys, dst, skip_tokens=CHUNK, before=s) == 3
        assert _drained(s)
        _check(cache, groups, dst, refs, 3, skipped_chunks=1)
        # the one chunk found is skipped: the daemon copies nothing and writes no word
        dst = _blank(cache, rng, groups, 3)
        assert c.retrieve(reg, keys[:1] + unknown + unknown, dst, skip_tokens=CHUNK, before=s) == 1
        assert _drained(s)
        _check(cache, groups, dst, refs, 1, skipped_chunks=1)
    finally:
        c.unregister(reg)
        c.close()


def test_stores_end_on_their_landed_word_and_their_own_lookups_see_them(daemon):
    """`Store.landed`: a staged store whose every chunk is copied returns once the daemon's
    DMA stream wrote the region's word, before the daemon's commit and reply; the client's next
    lookup waits for that reply, so it finds every chunk, and a retrieve brings every byte back.
    A store of chunks already present, or partly so, ends on its reply (no word). The ring
    wraps under such stores (their regions free on the word)."""
    c, cache, groups, reg = _engine(daemon, staging_bytes=4 * 3 * OBJECT_BYTES)
    try:
        rng = random.Random(11)
        s = torch.cuda.Stream()
        for round_ in range(10):  # the ring (four 3-chunk regions' worth) wraps
            before = c.conn.stores_landed
            keys, refs = _stored(c, cache, groups, reg, rng, 3)
            assert c.lookup(keys, CHUNK) == 3, round_
            dst = _blank(cache, rng, groups, 3)
            assert c.retrieve(reg, keys, dst, before=s) == 3
            assert _drained(s)
            _check(cache, groups, dst, refs, 3)
            # present: nothing copied, no word; the reply says so
            src = _disjoint(rng, groups, 3, 1)[0]
            r = c.store(reg, keys, src, after=torch.cuda.current_stream())
            assert (r.stored, r.present) == (0, 3)
            more = reg.keys([rng.randrange(50000) for _ in range(CHUNK)])
            r = c.store(reg, keys[:2] + more, src, after=torch.cuda.current_stream())
            assert (r.stored, r.present) == (1, 2)
            assert c.conn.stores_landed - before <= 1
        assert c.conn.stores_landed >= 1, "no store ended on its landed word"
        print(f"\nstores that ended on their landed word: {c.conn.stores_landed} of 10")
    finally:
        c.unregister(reg)
        c.close()


def test_a_refused_gated_retrieve_raises_and_leaves_the_stream_and_blocks_alone(daemon):
    from kvdepot.protocol.errors import KVDepotError

    c, cache, groups, reg = _engine(daemon)
    try:
        rng = random.Random(6)
        s = torch.cuda.Stream()
        keys, refs = _stored(c, cache, groups, reg, rng, 1)
        dst = _blank(cache, rng, groups, 1)
        bad = [list(dst[0]), [NUM_BLOCKS + 7] * len(dst[1])]  # out of range: the daemon refuses it
        p = c.submit_retrieve(reg, keys, bad, scatter_on=s)
        assert p._gated
        with pytest.raises(KVDepotError):
            p.result(s)
        assert _drained(s)
        _check(cache, groups, dst, refs, 0)
        assert c.retrieve(reg, keys, dst, before=s) == 1  # and the next one is served
        assert _drained(s)
        _check(cache, groups, dst, refs, 1)
        # refused again, and nobody takes its result: unregistering lets its scatter run (writing nothing)
        cache.storage.fill_(FILL)
        torch.cuda.synchronize()
        assert c.submit_retrieve(reg, keys, bad, scatter_on=s)._gated
        c.unregister(reg)
        reg = None
        assert _drained(s)
        _check(cache, groups, dst, refs, 0)
    finally:
        if reg is not None:
            c.unregister(reg)
        c.close()


def test_a_daemon_that_stops_answering_never_holds_the_engines_stream(tmp_path):
    """The daemon is stopped (SIGSTOP) with a gated retrieve sent: the client's timeout opens
    the gate, the stream drains with the blocks untouched; once the daemon runs again its late
    copy may land, and the region is reused only after a Drain says so."""
    from kvdepot.protocol.errors import ErrorCode, KVDepotError

    gen = serve(tmp_path, "1g", with_process=True)
    endpoint, proc = next(gen)
    pid = proc.pid
    # a ring of three 2-chunk regions: the lost one comes round again at once
    c, cache, groups, reg = _engine(endpoint, staging_bytes=3 * 2 * OBJECT_BYTES, timeout_s=1.0)
    try:
        rng = random.Random(7)
        s = torch.cuda.Stream()
        keys, refs = _stored(c, cache, groups, reg, rng, 2)
        dst = _blank(cache, rng, groups, 2)
        os.kill(pid, signal.SIGSTOP)
        try:
            p = c.submit_retrieve(reg, keys, dst, scatter_on=s)
            assert p._gated
            with pytest.raises(KVDepotError) as e:
                p.result(s)
            assert e.value.code == ErrorCode.TIMEOUT
            assert _drained(s)
            _check(cache, groups, dst, refs, 0)
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.5)  # its late copy lands now (and its landed word, after the scatter ran)
        for _ in range(20):  # the ring works on: retrieves until the lost region was drained and reused
            dst = _blank(cache, rng, groups, 2)
            assert c.retrieve(reg, keys, dst, before=s) == 2
            assert _drained(s)
            _check(cache, groups, dst, refs, 2)
        assert c.conn.drains_answered >= 1
    finally:
        c.unregister(reg)
        c.close()
        for _ in gen:  # the daemon's clean exit is checked
            pass
