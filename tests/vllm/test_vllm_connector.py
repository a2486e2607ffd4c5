"""The kvdepot vLLM connector against vLLM 0.33's real scheduler, KV-cache planning, connector
factory and worker-side call sequence, with real bytes moving through a `kvdepot serve`
daemon over shared memory (see ``vllm_harness`` for which parts are vLLM's code); the daemon's
failures are `test_vllm_connector_faults.py`'s.

Every forward pass of the toy model checks each KV byte it attends to against the KV the toy
model defines for that prefix, and its sampled token depends on those bytes: a wrong load fails
the test, and equal outputs mean equal tokens.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402
from connector_testing import CHUNK, first_output, stored_chunks, wait_for_lookup_answer  # noqa: E402
from kvdepot.protocol import messages as m  # noqa: E402


# ---------------------------------------------------------------------- (a) + (b)


def test_cold_request_stores_and_a_request_sharing_the_prefix_loads_the_same_bytes(shared_daemon, cfg, engines):
    a = engines(cfg(shared_daemon.endpoint, layout="LBNHC"))
    prompt = H.tokens(1, 200)  # 3 whole chunks + 8 tokens
    ra = a.add(prompt, max_tokens=3)
    first_output(a, ra)
    reference = {name: a.kv_of(ra, name, range(3 * CHUNK)) for name in a.kv_caches}
    a.run()
    assert a.runs[ra].computed == 200 + 2  # cold: vLLM computed everything
    w = a.worker_conn
    assert w.stats["stored_chunks"] == 3 and w.stats["store_failures"] == 0  # whole prompt chunks only
    assert stored_chunks(shared_daemon.endpoint, a) == 3

    # a second vLLM instance with another physical layout (HND) and other block ids
    b = engines(cfg(shared_daemon.endpoint, layout="LBHNC"))
    b.add(H.tokens(99, 40), max_tokens=1)  # occupy some blocks so B's ids differ from A's
    b.run()
    rb = b.add(prompt, max_tokens=3)
    b.run()
    run = b.runs[rb]
    assert run.computed == 200 - 3 * CHUNK + 2, "B must load the 3 cached chunks and compute the rest"
    assert run.outputs == a.runs[ra].outputs, "loaded KV must give exactly the tokens of a full computation"
    assert b.worker_conn.stats["loaded_chunks"] == 3
    for (name, lo, hi), got in run.loaded_bytes.items():
        assert (lo, hi) == (0, 200 - 8)
        assert got.equal(reference[name]), f"layer {name}: loaded bytes differ from A's KV"
    assert stored_chunks(shared_daemon.endpoint, a) == 3
    assert stored_chunks(shared_daemon.endpoint, b) == 0  # nothing stored twice


def test_call_sequence_vllm_makes(shared_daemon, cfg, engines):
    """The connector calls vLLM's scheduler and worker mixin make, in their order, for a cold
    request and for a request that loads."""
    import recording_connector as rc

    config = cfg(shared_daemon.endpoint, connector="RecordingKVDepotConnector", module="recording_connector")
    rc.CALLS.clear()
    e = engines(config)
    prompt = H.tokens(2, 130)
    r1 = e.add(prompt, max_tokens=1, req_id="cold")
    e.run()
    r2 = e.add(H.tokens(3, 5) + prompt, max_tokens=1, req_id="other")  # no shared prefix: lookup misses
    e.run()
    calls = [(role[0], name, arg) for role, name, arg in rc.CALLS]
    sched = [c for c in calls if c[0] == "S"]
    names = [c[1] for c in sched]
    # cold request: lookup sent at arrival, answered before it is scheduled, stores planned
    i = names.index("on_new_request")
    assert sched[i][2] == r1
    matched = [c[2] for c in sched if c[1] == "get_num_new_matched_tokens" and c[2][0] == r1]
    assert all(res == (None, False) for _, _, res in matched[:-1]) and matched[-1][2] == (0, False)
    assert ("S", "update_state_after_alloc", (r1, 0)) in sched
    metas = [c[2] for c in sched if c[1] == "build_connector_meta"]
    assert any(stores == [r1] for _, stores, _ in metas)
    fin = [c for c in sched if c[1] == "request_finished_all_groups"]
    assert fin[0][2] == (r1, True)  # blocks kept until the workers confirm no store is still running
    assert any(release == [r1] for _, _, release in metas)
    # worker: the mixin's order within a step
    worker = [c[1] for c in calls if c[0] == "W"]
    assert worker[:2] == ["get_mem_pool_context", "register_kv_caches"]
    # (every step: vLLM 0.33 starts async loads after the forward. Its attention layers call
    # wait_for_layer_load before and save_kv_layer after each layer only while the connector's
    # has_connector_metadata() is True: for kvdepot only while store pieces wait for staging-ring
    # room, which never happens on CPU engines (no ring), so no per-layer calls at all here)
    steps = 0
    for i, name in enumerate(worker):
        if name != "bind_connector_metadata":
            continue
        step = worker[i:worker.index("clear_connector_metadata", i) + 1]
        assert step == ["bind_connector_metadata", "start_load_kv", "wait_for_save", "get_transfer_results",
                        "get_block_ids_with_load_errors", "clear_connector_metadata"], step
        steps += 1
    assert steps >= 2
    sending = [c[2][0] for c in calls if c[1] == "get_transfer_results" and c[2][0]]
    assert [r1] in sending
    assert r2 in e.runs


def test_load_call_sequence(shared_daemon, cfg, engines):
    import recording_connector as rc

    e = engines(cfg(shared_daemon.endpoint, connector="RecordingKVDepotConnector", module="recording_connector"))
    prompt = H.tokens(4, 150)
    e.add(prompt, max_tokens=1, cache_salt="seq")
    e.run()
    # a second instance: its own prefix cache is empty, so everything cached comes from the daemon
    f = engines(cfg(shared_daemon.endpoint, connector="RecordingKVDepotConnector", module="recording_connector"))
    mover = f.worker_conn.mover
    post = mover.post
    mover.post = lambda cmd: (rc.CALLS.append(("WORKER", "post", type(cmd).__name__)), post(cmd))
    rc.CALLS.clear()
    r = f.add(prompt, max_tokens=1, cache_salt="seq", req_id="warm")
    f.run()
    calls = [(role[0], name, arg) for role, name, arg in rc.CALLS]
    matched = [c[2] for c in calls if c[1] == "get_num_new_matched_tokens"]
    assert matched[-1] == (r, 0, (2 * CHUNK, True))  # async load of the two whole chunks
    names = [(c[0], c[1]) for c in calls]
    alloc = names.index(("S", "update_state_after_alloc"))
    assert calls[alloc][2] == (r, 2 * CHUNK)
    meta = names.index(("S", "build_connector_meta"), alloc)
    assert calls[meta][2][0] == [r]  # the load job
    # the worker posts the load to its transfer thread in that step's bind_connector_metadata
    # (before the forward; recorded as each call returns), not in start_load_kv after it, and
    # reports it finished in the first get_transfer_results after its answer came
    posted = names.index(("W", "post"), meta)
    assert calls[posted][2] == "Load" and names[posted + 1] == ("W", "bind_connector_metadata")
    w = names.index(("W", "start_load_kv"), meta)
    assert ("W", "post") not in names[posted + 1:w + 1], "start_load_kv posted the load again"
    results = [i for i in range(w, len(calls)) if names[i] == ("W", "get_transfer_results")]
    done = [i for i in results if calls[i][2][1]]
    assert done and calls[done[0]][2][1] == [r] and calls[done[0]][2][2] == []
    res = done[0]
    assert ("S", "update_connector_output") in names[res:]
    assert f.runs[r].computed == 150 - 2 * CHUNK
    # its load ended and it stored nothing (150 tokens: no third whole chunk): vLLM frees its
    # blocks when it finishes, without waiting for the workers' finished_sending
    assert [c[2] for c in calls if c[1] == "request_finished_all_groups"] == [(r, False)]
    assert not any(c[2][2] for c in calls if c[1] == "build_connector_meta")  # nothing released
    assert not any(c[2][0] for c in calls if c[1] == "get_transfer_results")  # nothing reported sent

    # a request that loads and then stores (a third whole chunk computed here) keeps its blocks
    # until the workers report its store ended (a third instance: f's own prefix cache has the
    # two chunks now, so it would load nothing)
    g = engines(cfg(shared_daemon.endpoint, connector="RecordingKVDepotConnector", module="recording_connector"))
    rc.CALLS.clear()
    r3 = g.add(prompt + H.tokens(9, 3 * CHUNK - 150), max_tokens=1, cache_salt="seq", req_id="warm-longer")
    g.run()
    calls = [(role[0], name, arg) for role, name, arg in rc.CALLS]
    assert [c[2] for c in calls if c[1] == "get_num_new_matched_tokens"][-1][2][0] > 0  # it loaded
    assert any(c[2][1] == [r3] for c in calls if c[1] == "build_connector_meta")  # and stored
    assert [c[2] for c in calls if c[1] == "request_finished_all_groups"] == [(r3, True)]
    assert any(c[2][0] == [r3] for c in calls if c[1] == "get_transfer_results")


# ---------------------------------------------------------------------- (c) hybrid


@pytest.mark.parametrize("budget", [2048, 60], ids=["one-step-prefill", "chunked-prefill"])
def test_hybrid_model_two_groups_of_different_block_sizes(shared_daemon, cfg, engines, budget):
    """Full attention (16 tokens per block) + sliding window 16 (32 tokens per block): per-gid
    block ids per chunk, vLLM's null blocks in the sliding-window table (read by stores,
    guarded on loads)."""
    specs = H.hybrid_specs(sliding_window=16)
    a = engines(cfg(shared_daemon.endpoint, max_num_batched_tokens=budget), specs)
    assert [g.kv_cache_spec.block_size for g in a.groups] == [16, 32]
    prompt = H.tokens(5, 300)
    ra = a.add(prompt, max_tokens=3)
    a.run()
    assert a.worker_conn.stats["stored_chunks"] == 4

    b = engines(cfg(shared_daemon.endpoint, max_num_batched_tokens=budget), specs)
    null_before = b.null_block_bytes()
    rb = b.add(prompt, max_tokens=3)
    b.run()
    assert b.worker_conn.stats["loaded_chunks"] == 4
    # the sliding-window table held vLLM's null block: left out of the load (block id -1)
    assert b.worker_conn.stats["null_blocks_left_alone"] >= 1
    assert b.runs[rb].computed == 300 - 4 * CHUNK + 2
    assert b.runs[rb].outputs == a.runs[ra].outputs
    null_after = b.null_block_bytes()
    assert all(null_after[k].equal(v) for k, v in null_before.items()), "a load wrote vLLM's null block"


# ---------------------------------------------------------------------- (d) vLLM's own prefix cache


def test_prefix_partly_in_vllms_prefix_cache_is_not_overwritten(shared_daemon, cfg, engines):
    a = engines(cfg(shared_daemon.endpoint))
    prompt = H.tokens(7, 230)  # 3 whole chunks cached in the daemon
    ra = a.add(prompt, max_tokens=2)
    a.run()

    b = engines(cfg(shared_daemon.endpoint))
    rc_ = b.add(prompt[:100] + H.tokens(8, 20), max_tokens=1)  # shares 100 tokens with the prompt
    b.run()
    # vLLM's prefix cache of B now holds the KV of prompt[:96] (6 full blocks); poison the part
    # of it inside chunk 1 (tokens 64..95): a load that wrote it would restore the right bytes
    table = b.runs[rc_].table[0]
    poisoned = table[4:6]
    saved = {name: t.view(H.torch.int8)[poisoned].clone() for name, t in b.kv_caches.items()}
    for t in b.kv_caches.values():
        t.view(H.torch.int8)[poisoned] = 77

    rb = b.add(prompt, max_tokens=2)
    st = b.sched_conn
    seen = []
    orig = st._load_job

    def spy(req_id, block_ids, local, end):
        job = orig(req_id, block_ids, local, end)
        seen.append(job)
        return job

    st._load_job = spy
    for _ in range(200):  # step until the load ran (the step that plans it also executes it)
        b.step()
        if seen:
            break
        time.sleep(0.002)
    job = seen[0]
    assert (job.local_tokens, job.end_tokens) == (96, 3 * CHUNK)
    assert (job.first_chunk, job.skip_tokens) == (1, 32)  # retrieve chunks 1, 2; skip 32 tokens of chunk 1
    blocks_b = b.scheduler.kv_cache_manager.get_block_ids(rb)[0]
    assert blocks_b[4:6] == poisoned, "B must reuse vLLM's cached blocks for its local hit"
    for name, t in b.kv_caches.items():
        assert bool((t.view(H.torch.int8)[poisoned] == 77).all()), f"the load overwrote cached blocks ({name})"
        t.view(H.torch.int8)[poisoned] = saved[name]
    b.run()
    assert b.runs[rb].computed == 230 - 3 * CHUNK + 1
    assert b.runs[rb].outputs == a.runs[ra].outputs


# ---------------------------------------------------------------------- keys


def test_cache_salt_isolates_tenants(shared_daemon, cfg, engines):
    a = engines(cfg(shared_daemon.endpoint))
    prompt = H.tokens(15, 140)
    a.add(prompt, max_tokens=1, cache_salt="tenant-a")
    a.run()
    b = engines(cfg(shared_daemon.endpoint))
    other = b.add(prompt, max_tokens=1, cache_salt="tenant-b")
    b.run()
    assert b.runs[other].computed == 140, "another tenant must not see tenant-a's KV"
    c = engines(cfg(shared_daemon.endpoint))
    same = c.add(prompt, max_tokens=1, cache_salt="tenant-a")
    c.run()
    assert c.runs[same].computed == 140 - 2 * CHUNK


def test_generated_tokens_stored_only_when_configured(shared_daemon, cfg, engines):
    prompt = H.tokens(16, 100)  # 1 whole prompt chunk; 100 + 60 generated tokens reach 2 chunks
    e = engines(cfg(shared_daemon.endpoint, extra={"model_id": "gen-off"}))
    e.add(prompt, max_tokens=60)
    e.run()
    assert e.worker_conn.stats["stored_chunks"] == 1
    f = engines(cfg(shared_daemon.endpoint,
                                   extra={"model_id": "gen-on", "store_generated": True}))
    r = f.add(prompt, max_tokens=60)
    f.run()
    assert f.worker_conn.stats["stored_chunks"] == 2
    # a follow-up turn (prompt = previous prompt + answer) loads both chunks
    g = engines(cfg(shared_daemon.endpoint,
                                   extra={"model_id": "gen-on", "store_generated": True}))
    follow = g.add(f.runs[r].tokens[:150], max_tokens=1)
    g.run()
    assert g.runs[follow].computed == 150 - 2 * CHUNK


def test_full_prompt_hit_recomputes_only_the_last_token(shared_daemon, cfg, engines):
    a = engines(cfg(shared_daemon.endpoint))
    prompt = H.tokens(18, 2 * CHUNK)  # exactly two chunks
    ra = a.add(prompt, max_tokens=2)
    a.run()
    b = engines(cfg(shared_daemon.endpoint))
    rb = b.add(prompt, max_tokens=2)
    b.run()
    assert b.runs[rb].computed == 1 + 1  # vLLM recomputes the last prompt token, then one decode step
    assert b.runs[rb].outputs == a.runs[ra].outputs


def test_reset_cache_after_a_weight_update_drops_the_models_chunks(shared_daemon, cfg, engines):
    a = engines(cfg(shared_daemon.endpoint))
    prompt = H.tokens(19, 140)
    a.add(prompt, max_tokens=1)
    a.run()
    assert a.scheduler.reset_prefix_cache(reset_connector=True)  # vLLM's call after new weights
    r = a.add(prompt, max_tokens=1)
    a.run()
    assert a.runs[r].computed == 140, "neither vLLM's nor kvdepot's old KV may be used"
    b = engines(cfg(shared_daemon.endpoint))
    rb = b.add(prompt, max_tokens=1)
    b.run()
    assert b.runs[rb].computed == 140, "the daemon no longer holds the model's chunks"


def test_messages_on_the_wire_are_protocol_messages(shared_daemon, cfg, engines):
    """Loads and stores use the daemon's Store / Retrieve with per-gid block ids, parent and
    skip_tokens (a spy on the worker's channel)."""
    a = engines(cfg(shared_daemon.endpoint))
    sent = []
    client = a.worker_conn.client
    orig = client.conn.submit

    def spy(req):
        sent.append(req)
        return orig(req)

    client.conn.submit = spy
    a.add(H.tokens(17, 200), max_tokens=1)
    a.run()
    stores = [s for s in sent if isinstance(s, m.Store)]
    assert len(stores) == 1 and len(stores[0].keys) == 3 and stores[0].parent == b""
    assert [len(ids) for ids in stores[0].block_ids] == [3 * CHUNK // 16]


# ---------------------------------------------------------------------- tensor parallelism


@pytest.mark.parametrize("rank_processes", [False, True], ids=["one-process", "rank-processes"])
def test_tensor_parallel_ranks_store_and_load_their_own_shards(shared_daemon, cfg, engines, rank_processes):
    """TP=2: each rank registers its own shard and stores its own KV; another TP=2 instance
    loads each rank's chunks into that rank. The toy KV differs per rank, so a rank given the
    other rank's shard fails its forward. ``rank-processes``: rank 1 in a process of its own,
    fed the pickled SchedulerOutput (connector metadata included), as vLLM's multiprocess
    executor runs workers."""
    a = engines(cfg(shared_daemon.endpoint), tp=2, rank_processes=rank_processes)
    assert a.worker_conn.shard == "tp0of2"
    prompt = H.tokens(5, 200)
    ra = a.add(prompt, max_tokens=3)
    a.run()
    assert a.runs[ra].computed == 200 + 2
    for rank in range(2):
        stats = a.worker_stats(rank)
        assert stats["stored_chunks"] == 3 and stats["store_failures"] == 0
        assert stored_chunks(shared_daemon.endpoint, a, rank) == 3

    b = engines(cfg(shared_daemon.endpoint, layout="LBHNC"), tp=2, rank_processes=rank_processes)
    b.add(H.tokens(98, 40), max_tokens=1)  # other block ids than A's
    b.run()
    rb = b.add(prompt, max_tokens=3)
    b.run()
    run = b.runs[rb]
    assert run.computed == 200 - 3 * CHUNK + 2, "both ranks must load the 3 cached chunks"
    assert run.outputs == a.runs[ra].outputs
    assert [b.worker_stats(rank)["loaded_chunks"] for rank in range(2)] == [3, 3]


def test_tensor_parallel_prefix_hits_only_where_every_shard_is_cached(shared_daemon, cfg, engines):
    """A chunk cached for rank 0 only is no hit for a TP=2 instance: the scheduler asks for the
    chunks of every shard, and the request is computed in full."""
    a = engines(cfg(shared_daemon.endpoint), tp=2)
    a.workers[1].registrar.disable("test: rank 1 stores nothing")
    prompt = H.tokens(6, 200)
    a.add(prompt, max_tokens=2)
    a.run()
    assert a.workers[0].stats["stored_chunks"] == 3
    assert a.workers[1].stats["stored_chunks"] == 0

    b = engines(cfg(shared_daemon.endpoint), tp=2)
    rb = b.add(prompt, max_tokens=2)
    b.run()
    assert b.runs[rb].computed == 200 + 1
    assert [w.stats["loaded_chunks"] for w in b.workers] == [0, 0]


def test_transfers_run_off_the_engine_thread_and_no_per_layer_calls(shared_daemon, cfg, engines):
    """Every request the worker sends to the daemon leaves from its transfer thread, never from
    the engine's thread (a step only posts work), and vLLM's attention layers make no per-layer
    connector calls (has_connector_metadata() is False while stores and loads run)."""
    import threading

    a = engines(cfg(shared_daemon.endpoint))
    engine_thread = threading.get_ident()
    senders, per_layer = [], []

    def spy_on(engine):
        client, conn = engine.worker_conn.client.conn, engine.worker_conn
        submit, has = client.submit, conn.has_connector_metadata

        def spy(req):
            senders.append((type(req).__name__, threading.get_ident()))
            return submit(req)

        def has_spy():
            per_layer.append(has())
            return per_layer[-1]

        client.submit, conn.has_connector_metadata = spy, has_spy

    spy_on(a)
    prompt = H.tokens(21, 200)
    ra = a.add(prompt, max_tokens=2)
    a.run()
    b = engines(cfg(shared_daemon.endpoint))
    spy_on(b)
    rb = b.add(prompt, max_tokens=2)
    b.run()
    kinds = {k for k, _ in senders}
    assert {"Store", "Retrieve"} <= kinds, senders
    assert all(t != engine_thread for _, t in senders), "the engine thread sent a request to the daemon"
    assert per_layer and not any(per_layer)
    assert a.runs[ra].computed == 200 + 1
    assert b.runs[rb].computed == 200 - 3 * CHUNK + 1 and b.runs[rb].outputs == a.runs[ra].outputs


def test_a_steps_stores_and_loads_of_several_requests_go_in_one_request(shared_daemon, cfg, engines, monkeypatch):
    """Several requests' pieces queued together go to the daemon as one request
    (`KVDepotClient.submit_store_many` / `submit_retrieve_many`: one message, one reply), each
    request's chunks chained onto its own parent, and every request loads exactly its own bytes."""
    from kvdepot.client import KVDepotClient

    runs = {"store": [], "load": []}
    store_many, retrieve_many = KVDepotClient.submit_store_many, KVDepotClient.submit_retrieve_many

    def counting_store(self, reg, items, *a, **kw):
        runs["store"].append(len(items))
        return store_many(self, reg, items, *a, **kw)

    def counting_retrieve(self, reg, items, *a, **kw):
        runs["load"].append(len(items))
        return retrieve_many(self, reg, items, *a, **kw)

    monkeypatch.setattr(KVDepotClient, "submit_store_many", counting_store)
    monkeypatch.setattr(KVDepotClient, "submit_retrieve_many", counting_retrieve)
    a = engines(cfg(shared_daemon.endpoint, layout="LBNHC"))
    prompts = [H.tokens(40 + i, 2 * CHUNK + 3) for i in range(4)]
    ids = [a.add(p, max_tokens=2) for p in prompts]
    for r in ids:  # all four lookups answered before the first step: all four prefill in it
        wait_for_lookup_answer(a, r)
    a.run()
    assert a.worker_conn.stats["stored_chunks"] == 8 and a.worker_conn.stats["store_failures"] == 0
    assert stored_chunks(shared_daemon.endpoint, a) == 8
    assert runs["store"] and max(runs["store"]) >= 2, runs

    b = engines(cfg(shared_daemon.endpoint, layout="LBHNC"))
    b.add(H.tokens(98, 40), max_tokens=1)  # other block ids than A's
    b.run()
    got = [b.add(p, max_tokens=2) for p in prompts]
    for r in got:  # (a lookup answered a step later would put its load in a step of its own)
        wait_for_lookup_answer(b, r)
    b.run()
    assert runs["load"] and max(runs["load"]) >= 2, runs
    for ra, rb in zip(ids, got):
        assert b.runs[rb].computed == 3 + 1, "each request loads its 2 chunks and computes the rest"
        assert b.runs[rb].outputs == a.runs[ra].outputs
    assert b.worker_conn.stats["loaded_chunks"] == 8
