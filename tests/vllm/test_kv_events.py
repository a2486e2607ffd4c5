"""KV events for routers (`kvdepot.client.vllm.events`) end to end: vLLM 0.33's scheduler with
``--kv-events-config`` on publishes what the connector's ``take_events`` yields through vLLM's own
``ZmqEventPublisher``; a subscriber decodes vLLM's ``KVEventBatch`` and sees the depot's
``BlockStored`` (medium ``CPU``, vLLM's block hashes), ``BlockRemoved`` when the daemon evicts the
chunks and when it flushes them, and ``AllBlocksCleared`` after a full flush, in that order; stores
of another model or another tenant's engine never appear."""

from __future__ import annotations

import time

import msgspec
import vllm_harness as H
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvdepot.client import KVDepotClient


class Router:
    """A KV-aware router's subscription to one engine's vLLM KV events."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self.events: list = []

    def until(self, engines, done, timeout_s: float = 10.0) -> list:
        """Step ``engines`` (vLLM publishes at each step's end) and read events until
        ``done(events read so far)``; the depot's events only (medium CPU, and clears)."""
        deadline = time.monotonic() + timeout_s
        while not done(self.depot()):
            assert time.monotonic() < deadline, \
                f"no such events within {timeout_s} s; got {[type(e).__name__ for e in self.depot()]}"
            for e in engines:
                e.step()
            while self.sock.poll(5):
                _, _, payload = self.sock.recv_multipart()
                self.events.extend(self.decode(payload).events)
        return self.depot()

    def depot(self) -> list:
        return [e for e in self.events if isinstance(e, AllBlocksCleared) or getattr(e, "medium", None) == "CPU"]

    def gpu_hashes(self) -> list:
        """vLLM's own BlockStored hashes of its GPU prefix cache, in order."""
        return [h for e in self.events if isinstance(e, BlockStored) and e.medium != "CPU" for h in e.block_hashes]

    def close(self) -> None:
        self.sock.close(0)


def stored_hashes(events) -> list:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def removed_hashes(events) -> list:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_router_sees_store_eviction_and_flush_in_order(small_daemon, cfg, engines, tmp_path):
    d = small_daemon
    router = Router(f"ipc://{tmp_path}/a-events.sock")
    a = engines(cfg(d.endpoint, kv_events_endpoint=f"ipc://{tmp_path}/a-events.sock"))
    time.sleep(0.2)  # the subscription reaches vLLM's publisher (ZMQ drops what it published before)
    # others' stores: another model on the same daemon, and the same model under another tenant
    other_model = engines(cfg(d.endpoint, extra={"model_id": "another-model"}))
    other_model.add(H.tokens(7, 200), max_tokens=1)
    other_tenant = engines(cfg(d.endpoint))
    other_tenant.add(H.tokens(7, 200), max_tokens=1, cache_salt="tenant-2")

    r = a.add(H.tokens(7, 200), max_tokens=2)  # 3 whole chunks of 64 tokens (4 blocks each)
    a.run(r)
    other_model.run()
    other_tenant.run()
    got = router.until([a], lambda ev: len(stored_hashes(ev)) >= 12)
    assert [type(e) for e in got] == [BlockStored] * len(got)
    first = stored_hashes(got)
    assert first == router.gpu_hashes()[:12], "the depot's blocks are vLLM's block hashes of the prompt"
    assert len(first) == 12 and all(e.block_size == 16 and e.token_ids for e in got)
    assert got[0].parent_block_hash is None and got[1].parent_block_hash == first[3]

    # evicted: 48 more chunks of this engine overflow the L1 (no L2): the first prompt's go
    for s in range(16):
        a.add(H.tokens(100 + s, 200), max_tokens=1)
    a.run()
    got = router.until([a], lambda ev: set(first) <= set(removed_hashes(ev)))
    removed_first = next(i for i, e in enumerate(got) if isinstance(e, BlockRemoved) and set(e.block_hashes) & set(first))
    assert removed_first > 0 and isinstance(got[0], BlockStored)
    assert not set(removed_hashes(got)) - set(stored_hashes(got)), "only blocks the router was told of are removed"

    # flushed: a tenant's flush removes its chunks key by key, a full flush clears everything
    held = set(stored_hashes(got)) - set(removed_hashes(got))
    assert held
    with KVDepotClient(d.endpoint, timeout_s=5) as c:
        c.flush(cache_salt="")
    got = router.until([a], lambda ev: held <= set(removed_hashes(ev)))
    r2 = a.add(H.tokens(300, 200), max_tokens=1)
    a.run(r2)
    got = router.until([a], lambda ev: len(stored_hashes(ev)) >= len(stored_hashes(got)) + 12)
    with KVDepotClient(d.endpoint, timeout_s=5) as c:
        c.flush()
    got = router.until([a], lambda ev: isinstance(ev[-1], AllBlocksCleared))
    assert [type(e) for e in got].count(AllBlocksCleared) == 1

    # nothing of the other model's or the other tenant's engine: every stored block is one of A's prompts
    assert len(stored_hashes(got)) == len(set(stored_hashes(got))) == 12 * (1 + 16 + 1)
    assert set(stored_hashes(got)) <= set(router.gpu_hashes())
    router.close()


def test_without_kv_events_config_the_connector_yields_nothing(shared_daemon, cfg, engines):
    a = engines(cfg(shared_daemon.endpoint))
    a.add(H.tokens(8, 200), max_tokens=1)
    a.run()
    assert a.sched_conn._events is None
    assert list(a.sched_conn.take_events()) == []
