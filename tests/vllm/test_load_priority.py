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
    registrar = types.SimpleNamespace(kvreg=None, reg=reg, generation=-1)
    side = types.SimpleNamespace(cfg=types.SimpleNamespace(chunk_size=64), client=None, registrar=registrar,
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
        mv.book.queue = collections.deque(stores)
        mv.sender.load(_job("a", 2), True, 0, None)
        mv.sender.load(_job("b", 1), True, 0, None)
        order = [(p.kind, p.req_id) for p in mv.book.queue]
        assert order == [("load", "a"), ("load", "b"), ("store", "s0"), ("store", "s1"), ("store", "s2")]
        # the load's pieces are whole: keys and block ids of its chunks
        assert len(mv.book.queue[0].keys) == 2 and mv.book.queue[0].block_ids == [list(range(1, 9))]
        mv.book.queue.clear()
        mv.sender.load(_job("c", 1), True, 0, None)  # an empty queue: just queued
        assert [p.req_id for p in mv.book.queue] == ["c"]
    finally:
        mv._wake.close()


class _RingClient:
    """Stands in for `KVDepotClient`: a store takes room in the store ring, a retrieve in the
    load ring (as `KVDepotClient.submit_store` / `submit_retrieve` do), never waiting."""

    def __init__(self, staging) -> None:
        self.staging = staging
        self.generation, self.up = 0, True
        self.sent: list[tuple[str, str]] = []

    def poll(self, *a) -> None:
        pass

    def _sent(self, ring, kind: str, keys, request: str):
        region = ring.alloc(len(keys) * 256, self, wait=False)
        if region is None:
            return None
        self.sent.append((kind, request))
        return types.SimpleNamespace(done=lambda: False, rid=1, blocks_free_at_s=None)

    def submit_store(self, kvreg, keys, block_ids, parent=b"", cache_salt="", request="", after=None,
                     wait_for_room=True):
        return self._sent(self.staging.ring, "store", keys, request)

    def submit_retrieve(self, kvreg, keys, block_ids, skip_tokens=0, request="", wait_for_room=True):
        return self._sent(self.staging.load_ring, "load", keys, request)


@pytest.mark.parametrize("own_load_ring", [True, False])
def test_with_a_load_ring_of_their_own_a_waiting_load_holds_back_no_store_nor_a_store_a_load(own_load_ring):
    """`EngineStaging.load_ring`: a load finding no room in its ring lets the stores queued
    behind it go out through theirs, and stores without room let loads go; with one shared
    ring the first piece without room stops the queue, as it must (first in, first out)."""
    from kvdepot.client.staging import StagingRing

    ring = StagingRing(4 * 256)
    load_ring = StagingRing(2 * 256, base=4 * 256, shares=ring) if own_load_ring else ring
    staging = types.SimpleNamespace(ring=ring, load_ring=load_ring,
                                    rings=[ring, load_ring] if own_load_ring else [ring])
    mv = _thread()
    client = _RingClient(staging)
    mv.client = mv.side.client = mv.sender.client = client
    mv.registrar.kvreg = types.SimpleNamespace(staging=staging, object_bytes=256, chains=False)
    mv.registrar.generation, mv.side.stores_skip_when_full = 0, False
    mv.side.cfg.rpc_timeout_s = mv.side.cfg.hold_max_s = 60.0
    try:
        held = load_ring.alloc(2 * 256 if own_load_ring else 3 * 256)  # the loads' room is taken
        mv.book.queue = collections.deque([Piece("hit", "load", [b"k" * 16] * 2, [[1]], queued_at=1e18)]
                                      + [Piece(f"s{i}", "store", [bytes([i]) * 16], [[1]], queued_at=1e18)
                                         for i in range(3)])
        mv.sender.pump()
        if own_load_ring:
            assert client.sent == [("store", "s0"), ("store", "s1"), ("store", "s2")]
            assert [p.req_id for p in mv.book.queue] == ["hit"]
        else:
            assert client.sent == [] and len(mv.book.queue) == 4
        held.is_free = lambda: True
        mv.sender.pump()
        assert ("load", "hit") in client.sent
        if own_load_ring:
            # the store ring full (3 of its 4 regions taken, t0 takes the last, t1 waits): a load still goes
            more = [Piece(f"t{i}", "store", [bytes([i]) * 16] * (i + 1), [[1]], queued_at=1e18) for i in range(2)]
            mv.book.queue.extend(more)
            mv.sender.pump()
            assert [p.req_id for p in mv.book.queue] == ["t1"]
            for r in load_ring.live:
                r.is_free = lambda: True
            mv.book.queue.appendleft(Piece("hit2", "load", [b"k" * 16], [[1]], queued_at=1e18))
            mv.sender.pump()
            assert client.sent[-1] == ("load", "hit2") and [p.req_id for p in mv.book.queue] == ["t1"]
    finally:
        mv._wake.close()
