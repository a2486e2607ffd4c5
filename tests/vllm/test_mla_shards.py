"""MLA stored once across tensor-parallel ranks (`kvdepot.client.vllm.shards`), through vLLM's
real scheduler, KV-cache planning and connector lifecycle: MLA's latent KV is the same on every
rank (``MLAAttentionSpec(max_tp_shards=1)``; the harness's toy KV is too), so one key chain per
request, rank 0 stores, every rank loads, and engines of other TP sizes share the chunks."""

from __future__ import annotations

import pytest
import vllm_harness as H
from connector_testing import CHUNK, stored_chunks
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from kvdepot.client import KVDepotClient
from kvdepot.client.vllm.shards import REPLICATED, tp_shards


def l1(endpoint: str):
    with KVDepotClient(endpoint, timeout_s=5) as c:
        return next(t for t in c.describe().tiers if t.name == "l1")


def test_mla_at_tp2_is_stored_once_and_both_ranks_load_every_byte(daemon, cfg, engines):
    """TP=2 MLA: both ranks are the ``replicated`` shard, the scheduler looks up one key chain,
    rank 0 stores 3 chunks and rank 1 none; the daemon holds 3 chunk objects (one copy's bytes);
    another TP=2 engine (other layout, other block ids) loads the 3 chunks into both ranks,
    each rank's forward checking every byte it attends to. (Ranks in processes of their own:
    `tests/gpu/test_vllm_gpu.py`, and the dense TP tests here.)"""
    a = engines(cfg(daemon.endpoint), H.mla_specs(), tp=2)
    assert a.sched_conn.shards == [REPLICATED]
    prompt = H.tokens(41, 200)
    ra = a.add(prompt, max_tokens=3)
    a.run()
    assert stored_chunks(daemon.endpoint, a, 0) == 3 and stored_chunks(daemon.endpoint, a, 1) == 0
    assert a.worker_stats(0)["stored_chunks"] == 3
    # rank 1 sends nothing (the daemon would also drop a second copy of a key it holds)
    assert a.worker_stats(1)["stores"] == 0 and a.worker_stats(1)["pieces_queued"] == 0
    with KVDepotClient(daemon.endpoint, timeout_s=5) as c:
        engine = next(e for e in c.describe().engines if e.registration == a.registration_id(0))
        assert engine.shard == REPLICATED
    tier = l1(daemon.endpoint)
    assert tier.num_objects == 3 and tier.used_bytes >= 3 * engine.object_bytes
    assert tier.used_bytes < 4 * engine.object_bytes  # one copy, not one per rank

    b = engines(cfg(daemon.endpoint, layout="LBHNC"), H.mla_specs(), tp=2)
    b.add(H.tokens(98, 40), max_tokens=1)  # other block ids than A's
    b.run()
    rb = b.add(prompt, max_tokens=3)
    b.run()
    assert b.runs[rb].computed == 200 - 3 * CHUNK + 2, "both ranks must load the 3 cached chunks"
    assert b.runs[rb].outputs == a.runs[ra].outputs
    assert [b.worker_stats(rank)["loaded_chunks"] for rank in range(2)] == [3, 3]
    assert [b.worker_stats(rank)["load_failures"] for rank in range(2)] == [0, 0]


def test_mla_chunks_stored_at_tp1_load_into_a_tp2_engine_and_back(shared_daemon, cfg, engines):
    """The replicated shard does not depend on the TP size: a TP1 engine's chunks are a TP=2
    engine's hit (both ranks load them), and a TP=2 engine's chunks a TP1 engine's."""
    one = engines(cfg(shared_daemon.endpoint), H.mla_specs())
    p1 = H.tokens(43, 200)
    r1 = one.add(p1, max_tokens=2)
    one.run()
    assert one.worker_stats(0)["stored_chunks"] == 3
    two = engines(cfg(shared_daemon.endpoint), H.mla_specs(), tp=2)
    r2 = two.add(p1, max_tokens=2)
    two.run()
    assert two.runs[r2].computed == 200 - 3 * CHUNK + 1
    assert [two.worker_stats(rank)["loaded_chunks"] for rank in range(2)] == [3, 3]
    assert two.runs[r2].outputs == one.runs[r1].outputs

    p2 = H.tokens(44, 200)
    r2b = two.add(p2, max_tokens=2)
    two.run()
    one_b = engines(cfg(shared_daemon.endpoint), H.mla_specs())
    r1b = one_b.add(p2, max_tokens=2)
    one_b.run()
    assert one_b.runs[r1b].computed == 200 - 3 * CHUNK + 1
    assert one_b.runs[r1b].outputs == two.runs[r2b].outputs


def test_dense_tp2_keys_stay_per_rank(shared_daemon, cfg, engines):
    """A dense model's ranks hold other heads: two shards, each rank storing its own."""
    a = engines(cfg(shared_daemon.endpoint), tp=2)
    assert a.sched_conn.shards == ["tp0of2", "tp1of2"]
    assert [w.shard for w in a.workers] == ["tp0of2", "tp1of2"]
    assert [w.stores_chunks for w in a.workers] == [True, True]


def _mla(n: int = 1, max_tp_shards: int | None = 1) -> list:
    return [MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=72, dtype=H.torch.bfloat16,
                             max_tp_shards=max_tp_shards)] * n


def _dense(n: int = 1) -> list:
    return [FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=H.torch.bfloat16)] * n


@pytest.mark.parametrize("specs,tp,names,writers", [
    (_mla(4), 1, (REPLICATED,), [0]),
    (_mla(4), 8, (REPLICATED,), [0]),
    (_dense(4), 1, ("tp0of1",), [0]),
    (_dense(4), 4, ("tp0of4", "tp1of4", "tp2of4", "tp3of4"), [0, 1, 2, 3]),
    # an MLA group beside a dense one (hybrid): vLLM's rule, the common replica count, is 1
    (_mla(2) + _dense(2), 2, ("tp0of2", "tp1of2"), [0, 1]),
    # KV heads in 2 shards at TP 8: 4 ranks per shard, named as a TP2 engine's, the first storing
    (_mla(2, max_tp_shards=2), 8, ("tp0of2", "tp1of2"), [0, 4]),
    (_mla(2, max_tp_shards=8), 4, ("tp0of4", "tp1of4", "tp2of4", "tp3of4"), [0, 1, 2, 3]),
])
def test_tp_shards(specs, tp, names, writers):
    s = tp_shards(specs, tp)
    assert s.names == names and len(s.names) * s.replicas == tp
    assert [r for r in range(tp) if s.stores(r)] == writers
    assert [s.of(r) for r in range(tp)] == [names[r // s.replicas] for r in range(tp)]
