"""A dense model's store job for a request new in the step names vLLM's block id list and the
chunks' range (`StoreJob.lazy`); the worker's transfer thread slices the ids, so the engine
thread touches none of them. A range holding vLLM's null block (which no group without sliding
windows holds) is never stored: the job is skipped and the request's later chunks with it."""

from __future__ import annotations

import collections
import types

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402
from connector_testing import CHUNK as HARNESS_CHUNK  # noqa: E402

from kvdepot.client.vllm.layout import TransferGroup  # noqa: E402
from kvdepot.client.vllm.mover import TransferThread  # noqa: E402
from kvdepot.client.vllm.plan import StoreJob  # noqa: E402

CHUNK = 64  # tokens; 4 blocks of 16


def _job(rid: str, table: list[int], first: int, end: int, lazy: bool = True) -> StoreJob:
    chain = [bytes([first + i]) * 16 for i in range(end - first)]
    lo, hi = first * 4, end * 4
    return StoreJob(req_id=rid, chain=chain, parent=b"" if first == 0 else b"p" * 16, seed=b"s" * 16,
                    first_chunk=first, block_ids=None if lazy else [table[lo:hi]], cache_salt="",
                    lazy=([(table, lo, hi)], 0) if lazy else None)


def test_slice_block_ids_fills_the_ids_once_and_refuses_the_null_block():
    table = list(range(300, 316))
    job = _job("a", table, 1, 3)
    assert job.block_ids is None
    assert job.slice_block_ids() and job.block_ids == [table[4:12]] and job.lazy is None
    table.extend([1000, 1001])  # vLLM appends to the list later: the job keeps its ids
    assert job.slice_block_ids() and job.block_ids == [list(range(304, 312))]
    bad = _job("b", [300, 301, 0, 303, 304, 305, 306, 307], 0, 2)
    assert not bad.slice_block_ids() and bad.block_ids is None


def test_the_transfer_thread_skips_a_lazy_job_with_the_null_block_and_the_requests_later_chunks():
    reg = types.SimpleNamespace(ratio=[1], groups=[types.SimpleNamespace(tokens_per_block=16)],
                                expand=lambda gid, ids: list(ids))
    registrar = types.SimpleNamespace(kvreg=None, reg=reg, ready=lambda: True)
    side = types.SimpleNamespace(cfg=types.SimpleNamespace(chunk_size=CHUNK), client=None,
                                 registrar=registrar, shard="tp0of1", stores_skip_when_full=False,
                                 groups=[TransferGroup(0, 0, 16, ("l0",), False)], stats=collections.Counter())
    mv = TransferThread(side)
    mv.sender.pump = lambda **kw: None  # queued only: what matters is what would be sent
    mv.planner.piece_chunks = lambda kind="store": 16
    try:
        good = _job("good", list(range(100, 116)), 0, 4)
        bad = _job("bad", [200, 201, 202, 203, 0, 205, 206, 207], 0, 2)
        later = _job("bad", list(range(200, 216)), 2, 4)  # the same request's next chunks, no null among them
        mv.sender.save([good, bad, later], None)
        assert [p.req_id for p in mv.book.queue] == ["good"]
        assert mv.book.queue[0].block_ids == [list(range(100, 116))]
        assert side.stats["store_failures"] == 2 and "bad" in mv.book.stopped
        assert all(0 not in ids for p in mv.book.queue for ids in p.block_ids)
    finally:
        mv._wake.close()


def test_a_dense_models_new_request_gets_a_lazy_store_job_with_the_ids_of_its_table(shared_daemon, cfg, engines):
    """Through vLLM's scheduler: the store job of a request new in the step is lazy, and its
    ids, sliced, are the request's blocks of those chunks (what the eager path would give)."""
    a = engines(cfg(shared_daemon.endpoint))
    side = a.sched_conn
    assert side._lazy_stores
    made = []
    orig = side._store_job

    def spy(req_id, num_scheduled, block_state, new_table=None, st=None):
        job = orig(req_id, num_scheduled, block_state, new_table, st)
        if job is not None:
            assert job.block_ids is None and job.lazy is not None  # nothing sliced on the engine thread
            made.append((job, [list(t) for t in new_table] if new_table is not None else None))
        return job

    side._store_job = spy
    a.add(H.tokens(23, 200), max_tokens=1)
    a.run()
    assert made and all(job.lazy is None for job, _ in made)  # sliced by the transfer thread by now
    job, table = made[0]
    per = HARNESS_CHUNK // 16
    assert table is not None and job.block_ids == [table[0][job.first_chunk * per:(job.first_chunk + len(job.chain)) * per]]
