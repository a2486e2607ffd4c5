"""A load goes ahead of the stores waiting in the worker's transfer queue for staging-ring room:
a request waits for its load (time to first token), nobody waits for a store. Queued pieces
hold no ring room yet, so nothing ahead of a load can be needed to free it; stores keep their
order among themselves (a chunk's parent first), loads theirs."""

from __future__ import annotations

import collections
import types

import pytest

pytest.importorskip("vllm")

import vllm_harness  # noqa: E402,F401 - imports vLLM the way every test here does (stubs, warnings)

from kvdepot.client.vllm.layout import TransferGroup  # noqa: E402
from kvdepot.client.vllm.mover import TransferThread  # noqa: E402
from kvdepot.client.vllm.pieces import Piece  # noqa: E402
from kvdepot.client.vllm.plan import LoadJob  # noqa: E402


def _thread() -> TransferThread:
    reg = types.SimpleNamespace(ratio=[1], groups=[types.SimpleNamespace(tokens_per_block=16)],
                                expand=lambda gid, ids: list(ids))
    side = types.SimpleNamespace(cfg=types.SimpleNamespace(chunk_size=64), client=None, kvreg=None, reg=reg,
                                 shard="tp0of1", groups=[TransferGroup(0, 0, 16, ("l0",), False)],
                                 stats=collections.Counter())
    return TransferThread(side)


def _job(rid: str, chunks: int) -> LoadJob:
    return LoadJob(req_id=rid, chain=[bytes([i]) * 16 for i in range(chunks)], seed=b"s" * 16, first_chunk=0,
                   skip_tokens=0, block_ids=[list(range(1, 4 * chunks + 1))], local_tokens=0,
                   end_tokens=64 * chunks, fail_block_ids=[[]])


def test_loads_go_ahead_of_queued_stores_in_their_own_order():
    mv = _thread()
    try:
        stores = [Piece(f"s{i}", "store", [bytes([i]) * 16], [[1, 2, 3, 4]]) for i in range(3)]
        mv._queue = collections.deque(stores)
        mv._load(_job("a", 2), True, 0, None)
        mv._load(_job("b", 1), True, 0, None)
        order = [(p.kind, p.req_id) for p in mv._queue]
        assert order == [("load", "a"), ("load", "b"), ("store", "s0"), ("store", "s1"), ("store", "s2")]
        # the load's pieces are whole: keys and block ids of its chunks
        assert len(mv._queue[0].keys) == 2 and mv._queue[0].block_ids == [list(range(1, 9))]
        mv._queue.clear()
        mv._load(_job("c", 1), True, 0, None)  # an empty queue: just queued
        assert [p.req_id for p in mv._queue] == ["c"]
    finally:
        mv._wake.close()
