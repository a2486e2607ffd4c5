"""The worker's planner (`kvdepot.client.vllm.planner.Planner`) without a socket or a GPU: this
shard's keys of a chain, registered block ids (vLLM's null block left alone), the split of a
job into pieces of at most a quarter of the ring it goes through, and the loads a sliding
window's stores cannot serve."""

from __future__ import annotations

import collections
import types

import pytest

pytest.importorskip("vllm")

import vllm_harness  # noqa: E402, F401  (vLLM imported the way the other connector tests do)

from kvdepot.client.hashing import shard_keys, shard_mask  # noqa: E402
from kvdepot.client.vllm.layout import TransferGroup  # noqa: E402
from kvdepot.client.vllm.plan import StoreJob  # noqa: E402
from kvdepot.client.vllm.planner import Planner  # noqa: E402

CHUNK = 64  # tokens: 4 blocks of 16


def _side(groups, ratio=(1,), kvreg=None, shard="tp1of2"):
    reg = types.SimpleNamespace(ratio=list(ratio), groups=[types.SimpleNamespace(tokens_per_block=16 // r)
                                                           for r in ratio],
                                expand=lambda g, ids: [b * ratio[g] + i for b in ids for i in range(ratio[g])])
    return types.SimpleNamespace(cfg=types.SimpleNamespace(chunk_size=CHUNK), shard=shard, groups=groups,
                                 registrar=types.SimpleNamespace(reg=reg, kvreg=kvreg), stats=collections.Counter())


def _staged(ring_bytes: int, load_ring_bytes: int, object_bytes: int):
    staging = types.SimpleNamespace(ring=types.SimpleNamespace(size_bytes=ring_bytes),
                                    load_ring=types.SimpleNamespace(size_bytes=load_ring_bytes))
    return types.SimpleNamespace(staging=staging, object_bytes=object_bytes)


def _job(n_chunks: int, first_block: int = 100) -> StoreJob:
    return StoreJob(req_id="r", chain=[bytes([i]) * 16 for i in range(n_chunks)], parent=b"", seed=b"s" * 16,
                    first_chunk=0, block_ids=[list(range(first_block, first_block + 4 * n_chunks))], cache_salt="")


def test_keys_are_this_shards_keys_and_the_mask_cache_stays_bounded():
    planner = Planner(_side([TransferGroup(0, 0, 16, ("l0",), False)]))
    chain = [bytes([i]) * 16 for i in range(3)]
    seed = b"q" * 16
    assert planner.keys(chain, seed) == shard_keys(chain, [shard_mask(seed, "tp1of2")])[0]
    assert planner.keys(chain, seed) != shard_keys(chain, [shard_mask(seed, "tp0of2")])[0]
    for i in range(5000):
        planner.keys(chain[:1], i.to_bytes(16, "little"))
    assert len(planner._masks) <= 4097


def test_pieces_are_a_quarter_of_the_ring_they_go_through():
    unstaged = Planner(_side([TransferGroup(0, 0, 16, ("l0",), False)]))
    assert unstaged.piece_chunks() == unstaged.piece_chunks("load") == 1 << 30
    staged = Planner(_side([TransferGroup(0, 0, 16, ("l0",), False)], kvreg=_staged(64 << 20, 16 << 20, 1 << 20)))
    assert staged.piece_chunks() == 16 and staged.piece_chunks("load") == 4
    tiny = Planner(_side([TransferGroup(0, 0, 16, ("l0",), False)], kvreg=_staged(1 << 20, 1 << 20, 1 << 20)))
    assert tiny.piece_chunks() == 1  # never 0 chunks

    job = _job(37)
    pieces = staged.store_pieces(job)
    assert [(s, e) for s, e, _ in pieces] == [(0, 16), (16, 32), (32, 37)]
    for s, e, ids in pieces:  # 4 blocks per chunk, in order
        assert ids == [list(range(100 + 4 * s, 100 + 4 * e))]


def test_block_ids_expand_to_registered_blocks_and_leave_the_null_block_alone():
    side = _side([TransferGroup(0, 0, 16, ("l0",), True)], ratio=(2,))
    planner = Planner(side)
    assert planner.block_ids(side.registrar.reg, 0, [3, 5], None) == [6, 7, 10, 11]
    assert planner.block_ids(side.registrar.reg, 0, [3, 0, 5], null_id=0) == [6, 7, -1, -1, 10, 11]
    assert side.stats["null_blocks_left_alone"] == 1
    dense = _side([TransferGroup(0, 0, 16, ("l0",), False)])
    assert Planner(dense).block_ids(dense.registrar.reg, 0, [0, 1], null_id=0) == [0, 1]  # a dense group has no null block


def test_a_load_asking_for_blocks_a_sliding_window_store_left_out_is_refused():
    window = TransferGroup(0, 0, 16, ("l0",), True, window_blocks=2)  # stores keep each chunk's last 2 of 4
    planner = Planner(_side([window]))
    assert window.kept_from(CHUNK) == 2
    assert planner.window_blocks_only([[-1, -1, 7, 8, -1, -1, 9, 10]], [4])
    assert not planner.window_blocks_only([[-1, 6, 7, 8]], [4])
