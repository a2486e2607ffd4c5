"""Several STOREs and RETRIEVEs outstanding on one client (`submit_store` / `submit_retrieve`),
their replies collected in another order than they were sent, against a real daemon; and
what a timeout does to the other outstanding requests."""

from __future__ import annotations

import random

import pytest
import torch

from kvdepot.client import KVDepotClient
from kvdepot.client.kvcache import KVGroupShape, ShmKVCache
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError

CHUNK = 32
GROUPS = [KVGroupShape(0, 3, 2, 64, 16, torch.bfloat16)]


def _register(client, cache):
    return client.register("pipelined-model", "tp0of1", CHUNK, cache.storage_specs(), cache.layer_specs(),
                           cache.group_specs(), storage_fds=cache.storage_fds())


def test_outstanding_requests_complete_out_of_order(daemon):
    rng = random.Random(7)
    n_req, bpc = 6, CHUNK // 16
    with ShmKVCache(GROUPS, 40, "LBNHC") as a, ShmKVCache(GROUPS, 40, "LBHNC") as b, \
            KVDepotClient(daemon.endpoint) as client:
        a.storage.copy_(torch.randint(0, 256, (a.size_bytes,), dtype=torch.uint8))
        reg_a, reg_b = _register(client, a), _register(client, b)
        prompts = [[rng.randrange(30000) for _ in range(CHUNK)] for _ in range(n_req)]
        keys = [reg_a.keys(p) for p in prompts]
        assert keys == [reg_b.keys(p) for p in prompts]
        ids_a = [rng.sample(range(40), bpc) for _ in range(n_req)]
        free_b = rng.sample(range(40), n_req * bpc)  # requests must not share destination blocks
        ids_b = [free_b[i * bpc:(i + 1) * bpc] for i in range(n_req)]

        stores = [client.submit_store(reg_a, keys[i], [ids_a[i]]) for i in range(n_req)]
        for i in (3, 0, 5, 1, 4, 2):  # another order than sent
            r = stores[i].result()
            assert (r.stored, r.present, r.skipped) == (1, 0, 0)

        gets = [client.submit_retrieve(reg_b, keys[i], [ids_b[i]]) for i in range(n_req)]
        assert [gets[i].result() for i in (5, 4, 3, 2, 1, 0)] == [1] * n_req

        for i in range(n_req):
            for layer in range(GROUPS[0].num_layers):
                assert torch.equal(a.read_tokens(layer, ids_a[i], as_bytes=True),
                                   b.read_tokens(layer, ids_b[i], as_bytes=True)), (i, layer)


def test_a_timeout_loses_every_outstanding_request(daemon):
    with ShmKVCache(GROUPS, 8, "LBNHC") as a, KVDepotClient(daemon.endpoint) as client:
        reg = _register(client, a)
        keys = reg.keys(list(range(CHUNK)))
        first = client.submit_store(reg, keys, [[0, 1]])
        second = client.submit_store(reg, keys, [[0, 1]])
        with pytest.raises(KVDepotError) as exc:
            first.result(timeout_s=0)  # gives up at once: the socket is rebuilt
        assert exc.value.code == ErrorCode.TIMEOUT
        with pytest.raises(KVDepotError) as exc:
            second.result()
        assert exc.value.code == ErrorCode.TIMEOUT and "lost" in str(exc.value)
        # the client works again (whether the two stores reached the daemon before the socket
        # was dropped is not defined)
        assert client.ping() == client.conn.boot_id
        assert client.store(reg, reg.keys(list(range(CHUNK, 2 * CHUNK))), [[2, 3]]).stored == 1


def test_next_chunks_chain_onto_a_store_still_in_flight(daemon):
    """An engine that does not wait for its stores sends a request's next chunks while the
    previous ones are still being copied: they chain onto the parent in flight (never skipped
    as parent_missing), and become visible with it."""
    big = [KVGroupShape(0, 8, 8, 128, 16, torch.bfloat16)]  # 1 MiB chunks: the copies take a while
    with ShmKVCache(big, 64, "LBNHC") as a, ShmKVCache(big, 64, "LBHNC") as b, \
            KVDepotClient(daemon.endpoint) as client:
        a.storage.copy_(torch.randint(0, 256, (a.size_bytes,), dtype=torch.uint8))
        reg_a, reg_b = _register(client, a), _register(client, b)
        keys = reg_a.keys(list(range(8 * CHUNK)))
        bpc = CHUNK // 16
        ids = list(range(8 * bpc))
        first = client.submit_store(reg_a, keys[:4], [ids[:4 * bpc]], request="r")
        second = client.submit_store(reg_a, keys[4:], [ids[4 * bpc:]], parent=keys[3], request="r")
        r2, r1 = second.result(), first.result()
        assert (r1.stored, r1.skipped) == (4, 0)
        assert (r2.stored, r2.present, r2.skipped) == (4, 0, 0)
        assert client.lookup(keys, CHUNK) == 8
        dst = list(range(63, 63 - 8 * bpc, -1))
        assert client.retrieve(reg_b, keys, [dst]) == 8
        for layer in range(big[0].num_layers):
            assert torch.equal(a.read_tokens(layer, ids, as_bytes=True), b.read_tokens(layer, dst, as_bytes=True))


def _freed_by_a_drain(region, wait_s: float = 10.0) -> None:
    """A region whose request's reply was lost: the first look sends a `Drain` and returns at
    once (not free yet); it frees once the Drain is answered, within ``wait_s``."""
    import time

    assert not region.is_free()
    deadline = time.monotonic() + wait_s
    while not region.is_free():
        assert time.monotonic() < deadline, "the Drain was not answered"
        time.sleep(0.01)


def test_a_staging_region_lost_in_a_timeout_is_settled_by_a_drain(daemon):
    """A staged request whose reply was lost in a timeout keeps its ring region taken (the
    daemon may still copy it); the client then sends a `Drain` of its own accord (never
    blocking) and frees the region once it is answered. The ring here is a stand-in on a
    CPU registration: the daemon's Drain bookkeeping is the same for every registration."""
    import dataclasses
    import types

    from kvdepot.client.pending import PendingStore
    from kvdepot.client.staging import StagingRing

    with ShmKVCache(GROUPS, 8, "LBNHC") as cache, KVDepotClient(daemon.endpoint) as client:
        reg = _register(client, cache)
        staged = dataclasses.replace(reg, staging=types.SimpleNamespace(ring=StagingRing(4096)))
        ring = staged.staging.ring
        region = ring.alloc(256, client.conn)
        rid = client.submit(m.Ping(rid=0))  # stands in for the staged store
        pending = PendingStore(client.conn, rid, region, 1, None, staged)
        client.conn._reset(ErrorCode.TIMEOUT)  # its reply is lost with the connection
        _freed_by_a_drain(region)
        assert ring.drained_through == region.seq and client.conn.drains_answered == 1
        with pytest.raises(KVDepotError) as e:
            pending.result()
        assert e.value.code == ErrorCode.TIMEOUT
        assert ring.alloc(4096, client, wait=False) is not None  # the whole ring is usable again


def test_a_retrieve_lost_in_the_loads_ring_is_settled_by_a_drain_of_the_shared_numbers(daemon):
    """With a ring for retrieves of their own (`EngineStaging.load_ring`), a retrieve whose reply
    was lost keeps its region in that ring until a `Drain` through its number was answered; the
    two rings number their regions in one sequence, so the one Drain (by number) settles it and
    both rings know. Stand-in rings on a CPU registration, as above."""
    import dataclasses
    import types

    from kvdepot.client.pending import PendingRetrieve
    from kvdepot.client.staging import StagingRing

    with ShmKVCache(GROUPS, 8, "LBNHC") as cache, KVDepotClient(daemon.endpoint) as client:
        reg = _register(client, cache)
        stores = StagingRing(4096)
        loads = StagingRing(4096, base=4096, shares=stores)
        staged = dataclasses.replace(reg, staging=types.SimpleNamespace(ring=stores, load_ring=loads,
                                                                        rings=[stores, loads]))
        stores.alloc(256, client.conn).release()  # number 1, in the store ring
        region = loads.alloc(256, client.conn)  # number 2, in the loads' ring
        assert (region.seq, region.offset) == (2, 4096)
        rid = client.submit(m.Ping(rid=0))  # stands in for the staged retrieve
        pending = PendingRetrieve(client.conn, rid)
        pending._staged(staged, region, [[0]], 1, 0)
        client.conn._reset(ErrorCode.TIMEOUT)  # its reply is lost with the connection
        _freed_by_a_drain(region)
        assert stores.drained_through == loads.drained_through == 2 and client.conn.drains_answered == 1
        with pytest.raises(KVDepotError) as e:
            pending.result()
        assert e.value.code == ErrorCode.TIMEOUT
        assert loads.alloc(4096, client, wait=False).offset == 4096  # the whole loads' ring is usable again
