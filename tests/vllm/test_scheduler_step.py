"""What the scheduler-side connector does per step: a decode step looks at no request once
every prompt's whole chunks are stored (its cost does not grow with the requests running)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402


def test_decode_steps_look_at_no_request_once_prompts_are_stored(daemon, tmp_path):
    """Without ``store_generated`` only requests whose prompt has unstored whole chunks can
    store: ``build_connector_meta`` looks at those alone (it looked at every scheduled request
    before: 58 us per decode step with 256 running, dev VM, hot)."""
    cfg = H.make_vllm_config(H.model_dir(tmp_path), daemon.endpoint, chunk_size=64, extra={"model_id": "step"})
    a = H.Engine(cfg, H.dense_specs())
    try:
        sched = a.sched_conn
        looked: list[str] = []
        store_job = sched._store_job

        def spy(req_id, n, state, new_table=None, st=None):
            looked.append(req_id)
            return store_job(req_id, n, state, new_table, st)

        sched._store_job = spy
        ids = [a.add(H.tokens(40 + i, 140), max_tokens=12) for i in range(4)]  # 2 whole chunks each
        while any(a.runs[r].computed < 140 for r in ids):
            a.step()
        prefill_looks = len(looked)
        assert prefill_looks >= 4 and not sched._unstored
        a.run()
        assert len(looked) == prefill_looks, "decode steps looked at requests with nothing to store"
        assert a.worker_conn.stats["stored_chunks"] == 8
    finally:
        a.close()


def test_steps_with_nothing_to_move_share_one_metadata_and_one_result(daemon, tmp_path):
    """A step with nothing for the workers (decode, once the prompts are stored) gets the
    scheduler's one shared `KVDepotMetadata`, of empty tuples, and the workers' one shared
    result of empty frozensets: no object is built for such a step (each cost a decode step
    3-7 us of cold caches). A step that stores, and the one that reports its store ended, get
    their own; the requests still finish and their blocks go back to vLLM."""
    from kvdepot.client.vllm.worker import NOTHING_ENDED

    cfg = H.make_vllm_config(H.model_dir(tmp_path), daemon.endpoint, chunk_size=64, extra={"model_id": "idle"})
    a = H.Engine(cfg, H.dense_specs())
    try:
        metas, results = [], []
        build, gtr = a.sched_conn.build_connector_meta, a.worker_conn.get_transfer_results
        a.sched_conn.build_connector_meta = lambda so: metas.append(build(so)) or metas[-1]
        a.worker_conn.get_transfer_results = lambda ids: results.append(gtr(ids)) or results[-1]
        ids = [a.add(H.tokens(60 + i, 140), max_tokens=24) for i in range(2)]
        a.run(*ids)
        stores = [m for m in metas if m.stores]
        assert stores and all(isinstance(m.stores, list) for m in stores)
        idle = [m for m in metas if not (m.stores or m.loads or m.release or m.preempted)]
        assert len(idle) >= 10 and all(m is idle[0] for m in idle), "decode steps built their own metadata"
        assert idle[0].stores == () and idle[0].loads == () and idle[0].release == ()
        sent = [r for r in results if r.finished_sending]
        assert {x for r in sent for x in r.finished_sending} == set(ids)  # their blocks were held, then freed
        empty = [r for r in results if not r.finished_sending]
        assert len(empty) >= 10 and all(r is empty[0] for r in empty)
        assert (empty[0].finished_sending, empty[0].finished_recving, empty[0].failed_recving) == NOTHING_ENDED
        assert isinstance(empty[0].failed_recving, frozenset)  # shared: whoever tried to add to it would fail
        assert a.worker_conn.get_block_ids_with_load_errors() == set()
        assert a.worker_conn.stats["stored_chunks"] == 4
        assert not a.scheduler.requests
    finally:
        a.close()


def test_requests_running_through_a_cache_reset_store_their_prompt_again(daemon, tmp_path):
    """After ``reset_cache`` (new weights) a running request's chunks are stored again, under
    the new keys, on its next step."""
    cfg = H.make_vllm_config(H.model_dir(tmp_path), daemon.endpoint, chunk_size=64, extra={"model_id": "reset"})
    a = H.Engine(cfg, H.dense_specs())
    try:
        r = a.add(H.tokens(7, 140), max_tokens=60)
        w = a.worker_conn
        deadline = time.monotonic() + 20
        while w.stats["stored_chunks"] < 2 and time.monotonic() < deadline:  # its stores are answered
            a.step()
            time.sleep(0.005)
        assert w.stats["stored_chunks"] == 2 and not a.sched_conn._unstored
        assert a.runs[r].outputs and r in a.scheduler.requests  # still decoding
        assert a.sched_conn.reset_cache()
        assert r in a.sched_conn._unstored
        a.run()
        assert w.stats["stored_chunks"] == 4  # the same 2 chunks under the fresh namespace
    finally:
        a.close()


def test_store_jobs_take_the_same_block_ids_from_vllms_block_lists_as_from_its_id_tables(daemon, tmp_path):
    """`_store_job` takes a request new in the step from the id table vLLM built for it
    (``NewRequestData.block_ids``), a running one from only the stored chunks' blocks (vLLM's
    ``KVCacheCoordinator.get_blocks``); where that call is missing it slices vLLM's whole id
    table: all three give the same ids, for a hybrid model (two KV-cache groups, one of them
    sliding-window) in the middle of a chunked prefill."""
    cfg = H.make_vllm_config(H.model_dir(tmp_path), daemon.endpoint, chunk_size=64, max_num_batched_tokens=96,
                             max_model_len=512, extra={"model_id": "ids"})
    a = H.Engine(cfg, H.hybrid_specs(sliding_window=16), num_blocks=80)
    try:
        side = a.sched_conn
        jobs_seen, new_seen = [], 0
        build = side.build_connector_meta

        def again(so, job, snapshot, *, blocks: bool):
            st = side._reqs[job.req_id]
            after = st.next_store_chunk
            st.next_store_chunk, st.store_stopped = snapshot[job.req_id]
            blocks_of = side._blocks_of
            if not blocks:
                side._blocks_of = lambda rid: None
            try:
                got = side._store_job(job.req_id, so.num_scheduled_tokens[job.req_id], so.kv_connector_block_state)
            finally:
                side._blocks_of = blocks_of
            assert got is not None and st.next_store_chunk == after
            return got

        def spy(so):
            nonlocal new_seen
            snapshot = {rid: (st.next_store_chunk, st.store_stopped) for rid, st in side._reqs.items()}
            meta = build(so)
            new = {r.req_id for r in so.scheduled_new_reqs}
            for job in meta.stores:  # the same job again, through vLLM's live blocks and its id tables
                new_seen += job.req_id in new
                for blocks in (True, False):
                    got = again(so, job, snapshot, blocks=blocks)
                    assert got.block_ids == job.block_ids and got.first_chunk == job.first_chunk
                jobs_seen.append(job)
            return meta

        a.sched_conn.build_connector_meta = spy  # (vLLM calls the connector's, bound to the side's)
        for i in range(2):
            a.add(H.tokens(60 + i, 300), max_tokens=2)
        a.run()
        assert len(jobs_seen) >= 4 and any(job.first_chunk > 0 for job in jobs_seen)
        assert 0 < new_seen < len(jobs_seen)  # both kinds of request were compared
    finally:
        a.close()


def test_lookup_answers_are_booked_on_their_requests_as_they_are_read(daemon, tmp_path):
    """Every lookup reply that came is booked on its request by the read that brings it
    (`RequestState.answer`, the client's ``on_reply``), so a later ``get_num_new_matched_tokens`` of
    another request reads neither the socket nor the client; a refused or lost lookup is
    answered 0 (recompute), and only a lost one marks the daemon down."""
    from kvdepot.protocol import messages as m
    from kvdepot.protocol.errors import ErrorCode

    cfg = H.make_vllm_config(H.model_dir(tmp_path), daemon.endpoint, chunk_size=64, extra={"model_id": "booked"})
    a = H.Engine(cfg, H.dense_specs())
    try:
        side, conn = a.sched_conn, a.sched_conn
        warm = a.add(H.tokens(70, 140), max_tokens=1)
        a.run(warm)  # its two chunks stored: the requests below hit them
        ids = [a.add(H.tokens(70, 140) if i < 2 else H.tokens(80 + i, 140), max_tokens=1) for i in range(4)]
        states = [side._reqs[r] for r in ids]
        assert all(st.lookup_rid is not None and not st.answered for st in states)  # sent, none read yet
        deadline = time.monotonic() + 5
        while not states[-1].answered and time.monotonic() < deadline:
            side.client.poll(0.01)  # (the reads themselves book every answer that came)
        assert all(st.answered and st.lookup_rid is None for st in states)
        assert [st.hit_chunks for st in states] == [2, 2, 0, 0]
        polls = []
        poll = side.client.poll
        side.client.poll = lambda *a, **k: polls.append(1) or poll(*a, **k)
        try:
            req = a.scheduler.requests[ids[0]]
            assert conn.get_num_new_matched_tokens(req, 0) == (128, True)
            assert conn.get_num_new_matched_tokens(a.scheduler.requests[ids[2]], 0) == (0, False)
            assert polls == [], "a booked answer was looked for on the socket"
        finally:
            side.client.poll = poll
        # a refused lookup: recompute, the daemon still up; a lost one: recompute, marked down
        st = states[3]
        st.hit_chunks, st.lookup_rid = None, 123456
        st.answer(m.ErrorReply(rid=123456, code=int(ErrorCode.MALFORMED), message="refused"))
        assert conn.get_num_new_matched_tokens(a.scheduler.requests[ids[3]], 0) == (0, False)
        assert side.client.up and st.lookup_rid is None and st.lookup_error is None
        st.hit_chunks, st.lookup_rid = None, 123457
        st.answer(m.ErrorReply(rid=123457, code=int(ErrorCode.DISCONNECTED), message="lost"))
        assert conn.get_num_new_matched_tokens(a.scheduler.requests[ids[3]], 0) == (0, False)
        assert not side.client.up
        st.answer(m.ErrorReply(rid=99, code=int(ErrorCode.DISCONNECTED), message="another lookup's"))
        assert st.lookup_error is None and st.hit_chunks == 0  # a reply to another rid is not its
    finally:
        a.close()
