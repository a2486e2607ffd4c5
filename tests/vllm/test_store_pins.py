"""Models with a sliding-window group: the scheduler pins the sliding-window blocks every store
reads (vLLM's ``BlockPool.touch``) until every worker reported the save ended
(``KVDepotWorkerMeta`` through vLLM's ``kv_connector_worker_meta``), so vLLM gives none of them to
another request while a gather may still read it, and the workers gather those stores when they
like, as a full-attention model's."""

from __future__ import annotations

import collections
import types

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402
from connector_testing import collect_scheduler_stats  # noqa: E402
from kvdepot.client.vllm import stats as kvstats  # noqa: E402
from kvdepot.client.vllm.pieces import PinnedSaves  # noqa: E402
from kvdepot.client.vllm.plan import KVDepotMetadata, KVDepotWorkerMeta, StoreJob  # noqa: E402
from kvdepot.client.vllm.pins import StorePins  # noqa: E402
from kvdepot.client.vllm.worker import WorkerConnector  # noqa: E402

CHUNK = 64


def test_vllm_never_hands_out_a_pinned_block_and_every_pin_is_dropped(daemon, tmp_path, monkeypatch):
    """Through vLLM's real scheduler and block pool (chunked prefill of a hybrid model with a
    16-token window and a KV cache of 40 blocks, so blocks that leave the window are wanted
    again at once): each save pins exactly the sliding-window blocks its stores read; no block
    vLLM allocates is pinned at that moment; some pinned blocks were held by the pin alone
    (their request had let go of them), so the pins did something; once every request ended no
    pin is left and the pool has every block back. The pins' counters reach vLLM's scheduler
    stats (``vllm:kvdepot_blocks_{pinned,unpinned}_total``), pinned as many as let go."""
    monkeypatch.setattr(kvstats, "EMIT_INTERVAL_S", 0.0)  # every step that changed something
    cfg = H.make_vllm_config(H.model_dir(tmp_path), daemon.endpoint, chunk_size=CHUNK,
                             max_num_batched_tokens=48, max_model_len=256, extra={"model_id": "store-pins"})
    e = H.Engine(cfg, H.hybrid_specs(sliding_window=16), num_blocks=40)
    try:
        side = e.sched_conn
        pool = e.scheduler.kv_cache_manager.block_pool
        free_at_start = pool.get_num_free_blocks()
        assert side._pins.pool is pool
        seen = {"allocations": 0, "pinned_saves": 0, "held_by_pin_alone": 0, "metas": 0}
        get_new = pool.get_new_blocks

        def allocate(*a, **k):
            got = get_new(*a, **k)
            pinned = {id(b) for blocks in side._pins.saves.values() for b in blocks}
            assert not any(id(b) in pinned for b in got), "vLLM handed out a block a store still reads"
            seen["allocations"] += len(got)
            return got

        pool.get_new_blocks = allocate
        build = e.sched_conn.build_connector_meta

        def spy(so):
            meta = build(so)
            assert meta.stores_pinned and meta.written_block_ids is None
            seen["metas"] += 1
            seen["pinned_saves"] += bool(meta.pin_seq)
            # the save pins exactly the sliding-window blocks its stores read (vLLM's null block
            # aside), the same KVCacheBlock objects vLLM's pool holds
            read = sorted(b for job in meta.stores for i in side._sliding_gids for b in job.block_ids[i]
                          if b != meta.null_block_id)
            pinned = [b for b in side._pins.saves.get(meta.pin_seq, ()) if not b.is_null]
            assert sorted(b.block_id for b in pinned) == read
            assert all(pool.blocks[b.block_id] is b and b.ref_cnt >= 2 for b in pinned)
            seen["held_by_pin_alone"] += sum(b.ref_cnt == 1 for blocks in side._pins.saves.values() for b in blocks)
            return meta

        e.sched_conn.build_connector_meta = spy
        emitted = collect_scheduler_stats(e)  # what vLLM's scheduler passes on to its metrics
        for i in range(3):
            e.add(H.tokens(60 + i, 200), max_tokens=4)
        e.run(timeout_s=60)
        assert seen["pinned_saves"] >= 3 and seen["allocations"] >= 20, seen
        assert seen["held_by_pin_alone"] > 0, "no pinned block left its request's window: nothing tested"
        assert side._pins.saves == {} and side._pins.reports == {} and side.pinned_blocks == 0
        assert pool.get_num_free_blocks() == free_at_start, "a pin was never dropped"
        assert side.stats["blocks_pinned"] == side.stats["blocks_unpinned"] > 0
        left = e.sched_conn.get_kv_connector_stats()  # what the last step left unreported
        for k in ("blocks_pinned", "blocks_unpinned"):
            sent = sum(d.get(k, 0) for d in emitted) + (left.data.get(k, 0) if left is not None else 0)
            assert sent == side.stats[k], k
        w = e.worker_conn
        assert w.stores_may_wait and w.stats["stored_chunks"] >= 6 and w.stats["forwards_waiting_for_gathers"] == 0
    finally:
        e.close()


def test_a_pinned_hybrid_models_prefix_loads_back_bit_exact(daemon, tmp_path):
    """Engine A stores with pinned sliding-window blocks reused at once; engine B (HND layout,
    other block ids) loads the prefix and gets A's bytes (every byte each of its tokens attends
    to is checked)."""
    model = H.model_dir(tmp_path)
    specs = H.hybrid_specs(sliding_window=16)

    def make(layout):
        return H.Engine(H.make_vllm_config(model, daemon.endpoint, chunk_size=CHUNK, max_num_batched_tokens=48,
                                           max_model_len=256, layout=layout, extra={"model_id": "store-pins-ab"}),
                        specs, num_blocks=40)

    a = make("LBNHC")
    try:
        prompt = H.tokens(70, 2 * CHUNK + 9)
        ra = a.add(prompt, max_tokens=3)
        for i in range(2):
            a.add(H.tokens(71 + i, 150), max_tokens=2)  # others that take the freed blocks
        a.run(timeout_s=60)
        ref = a.runs[ra]
        assert a.worker_conn.stats["stored_chunks"] >= 2
    finally:
        a.close()
    b = make("LBHNC")
    try:
        rb = b.add(prompt, max_tokens=3)
        b.run(timeout_s=60)
        run = b.runs[rb]
        assert b.worker_conn.stats["loaded_chunks"] == 2
        # the harness's forward checks every KV byte each token attends to against the KV of a
        # full computation (`vllm_harness.expected_kv`), the loaded ones included
        assert run.computed == 9 + 2 and run.outputs == ref.outputs
    finally:
        b.close()


def test_pins_drop_once_every_worker_reported_the_save():
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    stats = {"blocks_pinned": 3, "blocks_unpinned": 0}
    pins = StorePins(pool, [1], workers=2, stats=stats)
    held, left, other = pool.get_new_blocks(3)  # one reference each: their request's
    pool.touch((held, left, other))  # the pins
    pool.free_blocks([left])  # left: its request let go (vLLM's remove_skipped_blocks)
    free_before = pool.get_num_free_blocks()
    pins.saves = {1: [held, left], 2: [other]}
    rank0, rank1 = KVDepotWorkerMeta({1: 1}), KVDepotWorkerMeta({1: 1, 2: 1})
    assert rank0.aggregate(rank1).saves_ended == {1: 2, 2: 1}  # vLLM's KVOutputAggregator, one step
    pins.unpin(rank0.saves_ended)  # rank 1 has not reported save 1 yet
    assert pool.get_num_free_blocks() == free_before and pins.reports == {1: 1} and held.ref_cnt == 2
    pins.unpin(rank1.saves_ended)
    # the request still holds ``held``: one reference less; ``left`` is back in vLLM's free queue
    assert held.ref_cnt == 1 and left.ref_cnt == 0 and pool.get_num_free_blocks() == free_before + 1
    assert stats == {"blocks_pinned": 3, "blocks_unpinned": 2}
    assert pins.saves == {2: [other]} and pins.reports == {2: 1} and other.ref_cnt == 2 and pins.held == 1
    assert left in pool.get_new_blocks(pool.get_num_free_blocks())  # given out again


def test_a_pinned_save_a_worker_does_not_send_is_reported_at_once():
    w = object.__new__(WorkerConnector)
    w.stores_chunks = True  # (every rank of a dense model stores)
    w.mover = types.SimpleNamespace(started=False)  # the transfer thread never started (disabled)
    w._active, w._saves_ended = False, set()
    job = StoreJob("r", [b"k" * 16], b"", b"s" * 16, 0, [[1], [2]], "")
    w._meta = KVDepotMetadata(stores=[job], stores_pinned=True, pin_seq=7)
    w.wait_for_save()
    assert w.build_connector_worker_meta().saves_ended == {7: 1}
    assert w.build_connector_worker_meta() is None  # reported once


def test_a_pinned_save_ends_when_its_last_piece_did():
    p1, p2, other = object(), object(), object()
    ops, queue = [p1, other], collections.deque([p2])  # in flight, queued
    saves = PinnedSaves()
    saves.add(3, [p1, p2])
    saves.add(4, [])

    def live():
        return {id(p) for p in ops} | {id(p) for p in queue}

    side_stream = None  # CPU engine: no stream the gathers run on
    assert saves.ended(live, side_stream) == {4} and saves  # a save with nothing sent ends at once
    queue.clear()
    assert saves.ended(live, side_stream) == set()  # p1 still in flight
    ops.remove(p1)
    assert saves.ended(live, side_stream) == {3} and not saves


@pytest.mark.parametrize("rank_processes", [False, True], ids=["one-process", "rank-processes"])
def test_tensor_parallel_pins_drop_once_both_ranks_reported(daemon, tmp_path, rank_processes):
    """TP=2 hybrid model: each rank reports its saves (``rank-processes``: rank 1's report comes
    back pickled, as from vLLM's multiprocess executor) and vLLM's ``KVOutputAggregator`` merges
    them; no allocation hands out a pinned block, and every pin is dropped at the end."""
    cfg = H.make_vllm_config(H.model_dir(tmp_path), daemon.endpoint, chunk_size=CHUNK,
                             max_num_batched_tokens=48, max_model_len=256, extra={"model_id": "store-pins-tp2"})
    e = H.Engine(cfg, H.hybrid_specs(sliding_window=16), num_blocks=40, tp=2, rank_processes=rank_processes)
    try:
        side = e.sched_conn
        pool = e.scheduler.kv_cache_manager.block_pool
        free_at_start = pool.get_num_free_blocks()
        assert side._workers == 2
        get_new = pool.get_new_blocks

        def allocate(*a, **k):
            got = get_new(*a, **k)
            pinned = {id(b) for blocks in side._pins.saves.values() for b in blocks}
            assert not any(id(b) in pinned for b in got), "vLLM handed out a block a store still reads"
            return got

        pool.get_new_blocks = allocate
        for i in range(3):
            e.add(H.tokens(80 + i, 200), max_tokens=4)
        e.run(timeout_s=60)
        assert side._pins.saves_pinned >= 3 and side._pins.saves == {} and side._pins.reports == {}
        assert pool.get_num_free_blocks() == free_at_start, "a pin was never dropped"
        assert [e.worker_stats(r)["stored_chunks"] for r in range(2)] == [9, 9]
    finally:
        e.close()


def test_a_failed_transfer_thread_ends_its_pinned_saves():
    """`TransferThread._fail_all`: nothing of theirs is sent any more, so each pinned save ends
    (on CPU at once; on CUDA once an event after the gathers queued so far ran)."""
    saves = PinnedSaves()
    piece = object()
    saves.add(1, [piece])
    assert saves.ended(lambda: {id(piece)}, None) == set()  # in flight
    saves.abandon()  # the thread dropped every op and queued piece
    assert saves.ended(lambda: set(), None) == {1} and not saves
