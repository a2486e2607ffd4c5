"""Models with a sliding-window group: vLLM frees the blocks that leave the window while their
request runs, so a forward may write a block an earlier step's store has not gathered yet. The
scheduler names the blocks each step may write that their request did not hold before
(``written_block_ids``); a worker's forward waits only for the gathers of stores that read one
of those, on the GPU if the transfer thread queued them already, on the CPU if not."""

from __future__ import annotations

import dataclasses
import types

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402
from kvdepot.client.vllm import commands as cmds  # noqa: E402
from kvdepot.client.vllm.plan import KVDepotMetadata, StoreJob  # noqa: E402
from kvdepot.client.vllm.scheduler import written_blocks  # noqa: E402
from kvdepot.client.vllm.worker import written_set  # noqa: E402
from kvdepot.client.vllm.worker import WorkerConnector, _SlidingSave  # noqa: E402

CHUNK = 64


@pytest.fixture(autouse=True)
def _without_store_pins(monkeypatch):
    """These tests are of the ordering used where the scheduler does not pin the stores' blocks
    (vLLM before 0.33, without the worker-metadata channel): `test_store_pins.py` has the
    pinned way."""
    from kvdepot.client.vllm import scheduler

    monkeypatch.setattr(scheduler, "KVConnectorWorkerMetadata", None)


def test_written_block_ids_cover_every_block_a_step_gives_a_request(daemon, tmp_path):
    """Through vLLM's real scheduler (chunked prefill of a hybrid model, so requests run over
    several steps while the sliding-window group gives blocks back): every block a request
    holds after a step's scheduling and did not hold before is in that step's
    ``written_block_ids``; vLLM's null block is never in the set a worker makes of them."""
    cfg = H.make_vllm_config(H.model_dir(tmp_path), daemon.endpoint, chunk_size=CHUNK,
                             max_num_batched_tokens=48, max_model_len=256, extra={"model_id": "sliding-written"})
    e = H.Engine(cfg, H.hybrid_specs(sliding_window=16), num_blocks=40)
    try:
        sched, conn = e.scheduler, e.sched_conn
        null = sched.kv_cache_manager.block_pool.null_block.block_id
        held: dict[str, set[int]] = {}
        checked = {"steps": 0, "new_blocks": 0, "freed_blocks": 0}
        build = conn.build_connector_meta

        def spy(so):
            meta = build(so)
            now = {rid: {b for ids in sched.kv_cache_manager.get_block_ids(rid) for b in ids}
                   for rid in sched.requests}
            new = set().union(*(now[r] - held.get(r, set()) for r in now)) - {null}
            written = written_set(meta.written_block_ids, meta.null_block_id)
            assert written is not None and new <= written, (new, meta)
            assert null not in written
            checked["steps"] += 1
            checked["new_blocks"] += len(new)
            checked["freed_blocks"] += sum(len(held[r] - now.get(r, set()) - {null}) for r in held)
            held.clear()
            held.update(now)
            return meta

        conn.build_connector_meta = spy
        for i in range(3):
            e.add(H.tokens(40 + i, 200), max_tokens=4)
        e.run(timeout_s=60)
        assert checked["steps"] >= 10 and checked["new_blocks"] >= 20, checked
        assert checked["freed_blocks"] > 0, "no block left a window while its request ran: nothing tested"
        assert e.worker_conn.stats["stored_chunks"] >= 6
    finally:
        e.close()


def test_written_blocks_reads_every_field_of_the_scheduler_output():
    so = types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(block_ids=([1, 2], [0, 3]))],
        scheduled_cached_reqs=types.SimpleNamespace(new_block_ids=[([4], [5]), None]),
        new_block_ids_to_zero=[6], kv_cache_block_copies=[types.SimpleNamespace(src_block_id=9, dst_block_id=7)])
    got = written_blocks(so)
    assert isinstance(got, list) and sorted(got) == [0, 1, 2, 3, 4, 5, 6, 7]  # a flat list, null block and all
    assert written_set(got, 0) == {1, 2, 3, 4, 5, 6, 7} and written_set(None, 0) is None


class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class _Mover:
    """The transfer thread's side of the handshake: which saves were handled, with which events."""

    def __init__(self) -> None:
        self.handled = 0
        self.events: dict[int, _Event] = {}
        self.cpu_waits: list[int] = []

    def gathered(self, seq):
        return (True, self.events.get(seq)) if seq <= self.handled else (False, None)

    def saves_gathered(self, count, timeout_s):
        self.cpu_waits.append(count)
        self.handled = max(self.handled, count)  # the thread got there
        self.events.setdefault(count, _Event(False))
        return self.events[count]

    def forget_gathered(self, seq):
        for k in [k for k in self.events if k <= seq]:
            self.events.pop(k)


def _worker():
    w = object.__new__(WorkerConnector)
    w.stores_chunks = True  # (every rank of a dense model stores)
    w.mover, w.stats = _Mover(), {"forwards_waiting_for_gathers": 0}
    w.cfg = types.SimpleNamespace(rpc_timeout_s=1.0)
    w._sliding_saves = []
    waits = []
    w._current_stream = lambda: types.SimpleNamespace(wait_event=waits.append)
    return w, waits


def _save(seq, blocks):
    return _SlidingSave(seq, [StoreJob("r", [b"k"], b"", b"s", 0, [list(blocks)], "")])


def test_a_forward_waits_only_for_gathers_that_read_a_block_it_may_write():
    w, waits = _worker()
    mv = w.mover
    w._sliding_saves = [_save(1, [10, 11]), _save(2, [20, 21]), _save(3, [30])]
    mv.handled, mv.events = 2, {1: _Event(True), 2: _Event(False)}
    # save 1's gathers ran (forgotten); save 2 is queued on the GPU, save 3 not handled yet:
    # this step writes none of their blocks -> no wait at all
    w._order_after_gathers({40, 41})
    assert waits == [] and mv.cpu_waits == [] and [s.seq for s in w._sliding_saves] == [2, 3]
    assert 1 not in mv.events
    # this step writes a block of save 2: a GPU wait on its event, no CPU wait
    ev2 = mv.events[2]
    w._order_after_gathers({21})
    assert waits == [ev2] and mv.cpu_waits == [] and [s.seq for s in w._sliding_saves] == [3]
    # a block of save 3, which the thread has not gathered: the CPU waits for it, then the GPU
    w._order_after_gathers({30, 99})
    assert mv.cpu_waits == [3] and len(waits) == 2 and waits[-1] is not ev2  # save 3's own event
    assert w._sliding_saves == [] and w.stats["forwards_waiting_for_gathers"] == 2
    assert mv.events == {}  # nothing kept for saves the engine no longer asks about


def test_waiting_for_a_later_save_covers_the_earlier_ones_and_none_means_wait():
    w, waits = _worker()
    mv = w.mover
    w._sliding_saves = [_save(1, [1]), _save(2, [2]), _save(3, [3])]
    mv.handled, mv.events = 3, {1: _Event(False), 2: _Event(False), 3: _Event(False)}
    w._order_after_gathers({3})  # save 3's gathers follow 1's and 2's on the side stream
    assert len(waits) == 1 and w._sliding_saves == [] and mv.events == {}
    # no written_block_ids (an older scheduler): every save not known gathered is waited for
    w._sliding_saves = [_save(4, [4])]
    w._order_after_gathers(None)
    assert mv.cpu_waits == [4] and len(waits) == 2 and w._sliding_saves == []


def test_a_save_gathered_on_the_engine_stream_does_not_cover_an_earlier_one_on_the_side_stream():
    """Around a daemon restart (no fence words for a while) a save's gathers may be on the
    thread's side stream (event not done yet) and a later one's on the engine's stream: the
    later one being ordered says nothing of the earlier, which stays tracked until its own
    event ran or a forward waits for it."""
    from kvdepot.client.vllm.pieces import PostedSave

    w, waits = _worker()
    mv = w.mover
    later = _save(2, [20])
    later.posted = PostedSave(object())
    later.posted.owner = "thread"
    w._gather_retry = 16
    w._sliding_saves = [_save(1, [10]), later]
    mv.handled, mv.events = 2, {1: _Event(False)}  # save 2: on the engine's stream (no event)
    w._order_after_gathers({99})  # writes neither's blocks
    assert [s.seq for s in w._sliding_saves] == [1] and 1 in mv.events and waits == []
    ev1 = mv.events[1]
    w._order_after_gathers({10})  # now save 1's block: the GPU waits for its side-stream event
    assert waits == [ev1] and w._sliding_saves == [] and mv.cpu_waits == []


def test_metadata_of_dense_models_carries_no_written_blocks():
    assert KVDepotMetadata().written_block_ids is None



def test_cpu_sliding_window_save_counts_as_gathered_only_once_the_daemon_copied_it(daemon, tmp_path):
    """CPU engines: the daemon copies a store's blocks out of shared memory itself, so a
    sliding-window model's save may count as gathered (and a conflicting forward go on) only
    once the daemon answered the store, not when it was sent."""
    cfg = H.make_vllm_config(H.model_dir(tmp_path), daemon.endpoint, chunk_size=CHUNK,
                             max_num_batched_tokens=48, max_model_len=256, extra={"model_id": "sliding-cpu"})
    e = H.Engine(cfg, H.hybrid_specs(sliding_window=16), num_blocks=40)
    try:
        mv = e.worker_conn.mover
        handle, checked = mv._handle, []

        def spy(cmd):
            before = {id(op) for op in mv.book.ops}
            handle(cmd)
            if isinstance(cmd, cmds.Save):
                new = [op for op in mv.book.ops if id(op) not in before and op.piece.kind == "store"]
                checked.append(all(op.pending.done() for op in new))

        mv._handle = spy
        for i in range(3):
            e.add(H.tokens(70 + i, 200), max_tokens=4)
        e.run(timeout_s=60)
        assert len(checked) >= 3 and all(checked), checked
        assert e.worker_conn.stats["stored_chunks"] >= 6
    finally:
        e.close()


@pytest.mark.parametrize("hybrid", [True, False])
def test_worker_sizes_its_staging_ring_from_its_chunk_bytes_and_step_budget(daemon, tmp_path, monkeypatch, hybrid):
    """``staging_bytes`` 0 (the default): a sliding-window model's ring holds two steps' stores
    (vLLM's ``max_num_batched_tokens``), in chunk bytes of this worker's own layout, which are
    those the daemon computed for its registration; a dense model's stays at the floor. A set
    value is used as given. (The floor is lowered here: these test models' chunks are small.)"""
    import kvdepot.client.vllm.config as config

    monkeypatch.setattr(config, "STAGING_MIN_BYTES", 4096)
    specs = H.hybrid_specs(sliding_window=16) if hybrid else H.dense_specs()
    cfg = H.make_vllm_config(H.model_dir(tmp_path), daemon.endpoint, chunk_size=CHUNK, max_num_batched_tokens=1000,
                             max_model_len=256, extra={"model_id": f"ring-{hybrid}"})
    e = H.Engine(cfg, specs, num_blocks=40)
    try:
        w = e.worker_conn
        step_chunks = 16  # ceil(1000 / 64)
        assert w.registrar.staging_bytes() == (2 * step_chunks * w.registrar.kvreg.object_bytes if hybrid else 4096)
        w.registrar.cfg = dataclasses.replace(w.registrar.cfg, staging_bytes=3 << 20)
        assert w.registrar.staging_bytes() == 3 << 20
    finally:
        e.close()
