"""Sliding-window models on CUDA with fence words: the engine thread gathers a step's stores
itself in ``wait_for_save``, on its own stream (`Sender.stage_saves`), so no later forward
waits for the transfer thread; the thread only sends them (`Sender.send_staged`). Driven
here with a stand-in client (the gathers need a GPU: tests/gpu/test_vllm_gpu.py runs the real
ones); what is checked is the bookkeeping: pieces, parents, skipped and given-up regions."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")

import vllm_harness  # noqa: E402,F401 - imports vLLM the way every test here does (stubs, warnings)
from kvdepot.client.hashing import shard_keys, shard_mask  # noqa: E402
from kvdepot.client.staging import StagingRing  # noqa: E402
from kvdepot.client.vllm import commands as cmds  # noqa: E402
from kvdepot.client.vllm.mover import TransferThread  # noqa: E402
from kvdepot.client.vllm.pieces import PostedSave  # noqa: E402
from kvdepot.client.vllm.plan import KVDepotMetadata, StoreJob  # noqa: E402
from kvdepot.client.vllm.worker import WorkerConnector  # noqa: E402
from kvdepot.protocol.errors import ErrorCode, KVDepotError  # noqa: E402

CHUNK, TPB, OBJECT_BYTES = 64, 16, 256  # 4 blocks per chunk; the ring (16 objects) takes 4 per piece


class _Client:
    def __init__(self, ring: StagingRing) -> None:
        self.ring = ring
        self.generation, self.up = 0, True
        self.staged: list[tuple] = []  # (block ids, chunks, stream) per gather call
        self.runs: list[list[int]] = []  # per `stage_store_pieces` call: its pieces' chunks
        self.sent: list[dict] = []
        self.abandoned: list = []
        self.refuse = False

    def stage_store(self, kvreg, block_ids, num_chunks, after=None, wait_for_room=True):
        region = self.ring.alloc(num_chunks * OBJECT_BYTES, self, wait=wait_for_room, fenced=True)
        if region is not None:
            self.staged.append((block_ids, num_chunks, after))
        return region

    def stage_store_pieces(self, kvreg, block_ids, piece_chunks, after):
        regions = self.ring.alloc_pieces([n * OBJECT_BYTES for n in piece_chunks], self, fenced=True)
        if regions is not None:
            self.staged.append((block_ids, sum(piece_chunks), after))
            self.runs.append(list(piece_chunks))
        return regions

    def abandon_region(self, kvreg, region):
        self.abandoned.append(region)
        region.release()

    def submit_store(self, kvreg, keys, block_ids, parent=b"", cache_salt="", request="", after=None,
                     early=False, wait_for_room=True, staged=None):
        if self.refuse:
            self.abandon_region(kvreg, staged)
            raise KVDepotError(ErrorCode.UNAVAILABLE, "daemon gone")
        self.sent.append(dict(keys=list(keys), block_ids=block_ids, parent=parent, request=request, staged=staged))
        return types.SimpleNamespace(done=lambda: False, rid=1, blocks_free_at_s=None)

    def submit_store_many(self, kvreg, items, cache_salt="", request="", after=None, wait_for_room=True,
                          staged=None):
        self.sent.append(dict(items=list(items), cache_salt=cache_salt, staged=staged))
        return types.SimpleNamespace(done=lambda: False, rid=1, blocks_free_at_s=None)

    def mark_down(self):
        self.up = False


def _thread(ring_objects: int = 16, chains: bool = False):
    ring = StagingRing(ring_objects * OBJECT_BYTES)
    client = _Client(ring)
    kvreg = types.SimpleNamespace(staging=types.SimpleNamespace(fence_active=True, ring=ring, load_ring=ring, rings=[ring]),
                                  object_bytes=OBJECT_BYTES, chains=chains)
    reg = types.SimpleNamespace(device="cuda", ratio=[1, 1], groups=[types.SimpleNamespace(tokens_per_block=TPB)] * 2,
                                expand=lambda g, ids: list(ids))
    registrar = types.SimpleNamespace(reg=reg, kvreg=kvreg, generation=0, ready=lambda: True)
    side = types.SimpleNamespace(cfg=types.SimpleNamespace(chunk_size=CHUNK, rpc_timeout_s=1.0), client=client,
                                 shard="tp0of1", registrar=registrar, stores_may_wait=False,
                                 stores_skip_when_full=True,
                                 groups=[types.SimpleNamespace(has_null_blocks=False)] * 2,
                                 stats={"store_failures": 0, "stores_skipped_ring_full": 0})
    return TransferThread(side), client, side


def _job(req: str, chunks: int, first_block: int, parent: bytes = b"") -> StoreJob:
    chain = [bytes([i + 1]) * 16 for i in range(chunks)]
    ids = list(range(first_block, first_block + chunks * CHUNK // TPB))
    return StoreJob(req_id=req, chain=chain, parent=parent, seed=b"s" * 16, first_chunk=0,
                    block_ids=[ids, [b + 1000 for b in ids]], cache_salt="")


def test_staged_pieces_gather_on_the_given_stream_and_go_out_with_their_parents():
    mv, client, side = _thread()
    stream = object()
    jobs = [_job("a", 6, 0, parent=b"p" * 16), _job("b", 2, 100)]
    staged = mv.sender.stage_saves(jobs, stream)
    assert staged is not None
    # a: pieces of 4 + 2 chunks (a quarter of the ring each at most), gathered by one call into
    # regions end to end; b: one piece
    assert [(n, s is stream) for _, n, s in client.staged] == [(6, True), (2, True)] and client.runs == [[4, 2]]
    assert client.staged[0][0] == [list(range(0, 24)), list(range(1000, 1024))]
    a1, a2 = staged.per_job[0][0].region, staged.per_job[0][1].region
    assert (a2.offset, a2.seq) == (a1.offset + a1.size_bytes, a1.seq + 1)
    assert staged.per_job[0][1].block_ids == [list(range(16, 24)), list(range(1016, 1024))]
    mv.sender.send_staged(jobs, staged)
    mask = shard_mask(b"s" * 16, "tp0of1")
    keys_a = shard_keys(jobs[0].chain, [mask])[0]
    parent_a = shard_keys([b"p" * 16], [mask])[0][0]
    assert [(s["request"], s["keys"], s["parent"]) for s in client.sent[:2]] == [
        ("a", keys_a[:4], parent_a), ("a", keys_a[4:], keys_a[3])]
    assert client.sent[2]["parent"] == b"" and len(mv.book.ops) == 3
    assert [s["staged"] for s in client.sent] == list(client.ring.live)


def test_a_piece_without_ring_room_skips_the_rest_of_its_request():
    mv, client, side = _thread(ring_objects=9)  # pieces of 2 chunks; room for 9 chunks
    jobs = [_job("a", 6, 0), _job("b", 5, 100)]
    staged = mv.sender.stage_saves(jobs, object())
    # b's second piece found no room: its third (1 chunk, it would fit) is not gathered
    assert [len(p) for p in staged.per_job] == [3, 2]
    assert staged.per_job[1][1].region is None
    mv.sender.send_staged(jobs, staged)
    assert [s["request"] for s in client.sent] == ["a", "a", "a", "b"]
    assert side.stats["stores_skipped_ring_full"] == 1 and "b" in mv.book.stopped


def test_regions_of_a_restarted_daemon_or_a_stopped_request_are_given_up_not_sent():
    mv, client, side = _thread()
    jobs = [_job("a", 2, 0), _job("b", 2, 100)]
    staged = mv.sender.stage_saves(jobs, object())
    client.generation = 1  # the daemon restarted between the gather and the send
    mv.sender.send_staged(jobs, staged)
    assert not client.sent and len(client.abandoned) == 2 and side.stats["store_failures"] == 2
    mv.book.stopped.add("c")
    staged = mv.sender.stage_saves([_job("c", 2, 0)], object())
    assert staged is None  # the registration is not the live daemon's: the thread's way
    side.registrar.generation = 1
    # the transfer thread's gather skips what it stopped (its earlier chunks were skipped)
    staged = mv.sender.stage_saves([_job("c", 2, 0)], object(), mv.book.stopped)
    assert staged.per_job == [None]
    # the engine thread's reads none of the thread's state: it gathers, the send gives it up
    staged = mv.sender.stage_saves([_job("c", 2, 0)], object())
    assert len(staged.per_job[0]) == 1 and staged.per_job[0][0].region is not None
    mv.sender.send_staged([_job("c", 2, 0)], staged)
    assert not client.sent and len(client.abandoned) == 3


def test_a_refused_send_gives_up_its_region_and_stops_the_request():
    mv, client, side = _thread()
    jobs = [_job("a", 6, 0)]
    staged = mv.sender.stage_saves(jobs, object())
    client.refuse = True
    mv.sender.send_staged(jobs, staged)
    assert len(client.abandoned) == 2 and not client.sent and "a" in mv.book.stopped
    assert side.stats["store_failures"] == 2


def test_without_fence_words_the_thread_gathers_and_the_forward_may_wait():
    mv, client, side = _thread()
    side.registrar.kvreg.staging.fence_active = False
    assert mv.sender.stage_saves([_job("a", 2, 0)], object()) is None


def _sliding_worker(mover):
    from kvdepot.client.vllm import worker as worker_mod

    w = object.__new__(WorkerConnector)
    w.stores_chunks = True  # (every rank of a dense model stores)
    stream = object()
    w.mover, w.stats = mover, {"forwards_waiting_for_gathers": 0, "saves_gathered_by_bind": 0}
    w.cfg = types.SimpleNamespace(rpc_timeout_s=1.0)
    registrar = types.SimpleNamespace(reg=types.SimpleNamespace(device="cuda"))
    w.stores_may_wait, w.registrar, w._cuda, w._active = False, registrar, True, True
    w._saves_posted, w._sliding_saves, w._gather_in_wait = 0, [], 0
    w._gather_retry = worker_mod.GATHER_IN_WAIT_RETRY
    w._current_stream = lambda: stream
    if isinstance(mover, TransferThread):
        mover._thread = object()  # "started": driven by hand here, no thread runs
    return w, stream


def test_wait_for_save_of_a_sliding_window_model_posts_its_stream_and_gathers_nothing_itself():
    posted = []
    w, stream = _sliding_worker(types.SimpleNamespace(
        started=True, post=posted.append,
        sender=types.SimpleNamespace(stage_saves=lambda jobs, s: pytest.fail("gathered on the engine thread"))))
    w._engine_event = lambda: pytest.fail("an event was made on the engine thread")
    jobs = [_job("a", 2, 0)]
    w._meta = KVDepotMetadata(stores=jobs)
    w.wait_for_save()
    (cmd,) = posted
    assert type(cmd) is cmds.SavePosted and cmd.jobs == jobs and cmd.release is None
    assert isinstance(cmd.posted, PostedSave) and cmd.posted.stream is stream and cmd.posted.owner is None
    assert [(s.seq, s.posted) for s in w._sliding_saves] == [(1, cmd.posted)]


def test_wait_for_save_gathers_on_the_engine_thread_after_bind_had_to():
    """After `bind_connector_metadata` gathered a save the thread had not taken (``_gather_in_wait`` saves to go),
    the engine thread gathers in wait_for_save; without fence words the thread gathers after
    its event."""
    posted = []
    w, stream = _sliding_worker(types.SimpleNamespace(
        started=True, post=posted.append,
        sender=types.SimpleNamespace(stage_saves=lambda jobs, s: ("staged", jobs, s))))
    w._gather_in_wait = 2
    jobs = [_job("a", 2, 0)]
    w._meta = KVDepotMetadata(stores=jobs)
    w.wait_for_save()
    assert posted == [cmds.SaveStaged(jobs, None, ("staged", jobs, stream))] and w._sliding_saves == []
    w.mover.sender.stage_saves = lambda jobs, s: None  # no fence words: the thread's way, bind checks it
    w._engine_event = lambda: "event"
    w.wait_for_save()
    assert posted[-1] == cmds.SaveAfterEvent(jobs, None, "event") and [s.seq for s in w._sliding_saves] == [2]


def test_the_transfer_thread_gathers_a_posted_save_on_the_engine_stream_and_bind_then_waits_for_nothing():
    mv, client, side = _thread()
    w, stream = _sliding_worker(mv)
    mv.post = lambda cmd: mv._handle(cmd)  # the thread takes the save before the next bind
    jobs = [_job("a", 2, 0)]
    w._meta = KVDepotMetadata(stores=jobs)
    w.wait_for_save()
    assert [(n, s is stream) for _, n, s in client.staged] == [(2, True)] and len(client.sent) == 1
    assert mv.gathered(1) == (True, None)  # on the engine's stream: nothing to wait for
    w._current_stream = lambda: pytest.fail("bind touched the stream")
    w._order_after_gathers({0, 1, 2})  # even where the next forward writes its blocks
    assert w._sliding_saves == [] and w.stats == {"forwards_waiting_for_gathers": 0, "saves_gathered_by_bind": 0}


def test_bind_gathers_a_save_the_thread_has_not_taken_before_a_forward_that_writes_its_blocks():
    """The thread has not taken the save when the next forward may write one of its blocks:
    bind claims it and gathers it on the engine's stream itself; the thread later only sends
    what bind staged. A save whose blocks the forward leaves alone stays the thread's."""
    mv, client, side = _thread()
    w, stream = _sliding_worker(mv)
    inbox = []
    mv.post = inbox.append
    a, b = [_job("a", 2, 0)], [_job("b", 2, 100)]
    for jobs in (a, b):
        w._meta = KVDepotMetadata(stores=jobs)
        w.wait_for_save()
    w._order_after_gathers({1, 500})  # writes a block of a's, none of b's
    assert [(n, s is stream) for _, n, s in client.staged] == [(2, True)] and client.staged[0][0][0] == list(range(8))
    assert not client.sent and [s.seq for s in w._sliding_saves] == [2]
    assert w.stats == {"forwards_waiting_for_gathers": 0, "saves_gathered_by_bind": 1}
    for cmd in inbox:  # the thread takes both: sends a's as staged, gathers b's itself
        mv._handle(cmd)
    assert len(client.staged) == 2 and [s["request"] for s in client.sent] == ["a", "b"]
    assert client.sent[0]["staged"] is list(client.ring.live)[0]
    w._order_after_gathers({100})
    assert w._sliding_saves == [] and w.stats["saves_gathered_by_bind"] == 1
    # the thread was late once: the next saves are gathered in wait_for_save (costs the engine
    # thread less than bind's claim), then the thread is tried again
    from kvdepot.client.vllm.worker import GATHER_IN_WAIT_RETRY

    for i in range(GATHER_IN_WAIT_RETRY + 1):
        w._meta = KVDepotMetadata(stores=[_job(f"c{i}", 1, 200 + 4 * i)])
        w.wait_for_save()
    assert [type(cmd) is cmds.SaveStaged for cmd in inbox[2:]] == [True] * GATHER_IN_WAIT_RETRY + [False]
    assert type(inbox[-1]) is cmds.SavePosted and [s.seq for s in w._sliding_saves] == [3 + GATHER_IN_WAIT_RETRY]


def test_each_further_miss_of_the_thread_doubles_the_saves_gathered_in_wait_for_save():
    """vLLM's async scheduling gives the thread no GPU wait between a save and the next bind:
    after each further miss the thread is tried half as often (up to a limit), so that the
    claims in bind cost next to nothing there; a save the thread took in time resets it."""
    from kvdepot.client.vllm.worker import GATHER_IN_WAIT_RETRY as R, GATHER_IN_WAIT_RETRY_MAX

    mv, client, side = _thread(ring_objects=64)
    w, stream = _sliding_worker(mv)
    inbox = []
    mv.post = inbox.append
    runs = []
    for miss in range(8):
        w._meta = KVDepotMetadata(stores=[_job(f"m{miss}", 1, 0)])
        w.wait_for_save()  # posted for the thread, which never takes it in time
        w._order_after_gathers({0})  # bind claims it
        runs.append(w._gather_in_wait)
        for cmd in inbox:
            mv._handle(cmd)
        inbox.clear()
        w._gather_in_wait = 0  # (as if that many saves were gathered in wait_for_save)
    assert runs == [min(R << i, GATHER_IN_WAIT_RETRY_MAX) for i in range(8)]
    w._meta = KVDepotMetadata(stores=[_job("t", 1, 0)])
    w.wait_for_save()
    mv._handle(inbox.pop())  # the thread takes this one before the next bind
    w._order_after_gathers({0})
    assert w._gather_retry == R and w.stats["saves_gathered_by_bind"] == 8


def test_bind_waits_for_a_save_the_thread_is_gathering():
    mv, client, side = _thread()
    w, _ = _sliding_worker(mv)
    inbox = []
    mv.post = inbox.append
    w._meta = KVDepotMetadata(stores=[_job("a", 2, 0)])
    w.wait_for_save()
    posted = inbox[0].posted
    assert posted.claim("thread", blocking=True)  # the thread holds it (mid-gather)
    waited = []

    def saves_gathered(count, timeout_s):
        waited.append(count)
        return None

    mv.saves_gathered = saves_gathered
    w._order_after_gathers({1})
    assert waited == [1] and not client.staged and w.stats["forwards_waiting_for_gathers"] == 1
    assert not posted.claim("engine", blocking=False)  # still the thread's


def test_without_fence_words_a_posted_save_is_gathered_on_the_side_stream_after_an_engine_event(monkeypatch):
    """No fence words (or another daemon generation): whoever claims the save records an event
    on the engine's stream, the thread gathers on its own stream after it, and bind waits for
    that as before."""
    from kvdepot.client.vllm import mover as mover_mod, pieces as pieces_mod, worker as worker_mod

    recorded = []

    class _Ev:
        def record(self, stream):
            recorded.append(stream)

    fake_cuda = types.SimpleNamespace(Event=_Ev, Stream=mover_mod.torch.cuda.Stream)
    monkeypatch.setattr(mover_mod, "torch", types.SimpleNamespace(cuda=fake_cuda))
    monkeypatch.setattr(worker_mod, "torch", types.SimpleNamespace(cuda=fake_cuda))
    monkeypatch.setattr(pieces_mod, "torch", types.SimpleNamespace(cuda=fake_cuda))
    mv, client, side = _thread()
    side.registrar.kvreg.staging.fence_active = False
    w, stream = _sliding_worker(mv)
    saved = []
    mv.sender.save = lambda jobs, event: saved.append(event)
    mv.sender.await_unstaged = lambda ops: None
    inbox = []
    mv.post = inbox.append
    w._meta = KVDepotMetadata(stores=[_job("a", 2, 0)])
    w.wait_for_save()
    w.wait_for_save()
    mv._handle(inbox[0])  # the thread: no fence words -> an event on the engine's stream, then _save
    assert recorded == [stream] and len(saved) == 1 and isinstance(saved[0], _Ev) and inbox[0].posted.owner == "thread"
    waited = []
    mv.saves_gathered = lambda count, timeout_s: (waited.append(count), mv._handle(inbox[1]))[1]
    w._current_stream = lambda: types.SimpleNamespace(wait_event=lambda ev: None)
    w._order_after_gathers({1})  # save 2 not taken: bind claims it, records the event, waits
    assert inbox[1].posted.owner == "engine" and isinstance(inbox[1].posted.event, _Ev) and waited == [2]
    assert recorded == [stream, stream] and saved[-1] is inbox[1].posted.event and w._sliding_saves == []
    assert w.stats == {"forwards_waiting_for_gathers": 1, "saves_gathered_by_bind": 1}


def test_wait_for_save_of_a_dense_model_leaves_the_event_to_the_transfer_thread():
    """Blocks of a model without sliding-window groups stay with the request until its stores
    ended: wait_for_save posts the engine's stream, and the thread records the event on it when
    it takes the save (no CUDA call on the engine thread)."""
    w = object.__new__(WorkerConnector)
    w.stores_chunks = True  # (every rank of a dense model stores)
    posted = []
    stream = object()
    w.mover = types.SimpleNamespace(started=True, post=posted.append)
    w._post_quiet = posted.append  # (saves and releases: `TransferThread.post_quiet`)
    registrar = types.SimpleNamespace(reg=types.SimpleNamespace(device="cuda"))
    w.stores_may_wait, w.registrar, w._cuda, w._active = True, registrar, True, True
    w._saves_posted, w._sliding_saves, w._released = 0, [], None
    w._current_stream = lambda: stream
    w._engine_event = lambda: pytest.fail("an event was made on the engine thread")
    jobs = [_job("a", 2, 0)]
    w._meta = KVDepotMetadata(stores=jobs)
    w.wait_for_save()
    assert posted == [cmds.SaveOnStream(jobs, None, stream, 0)] and w._sliding_saves == []
    registrar = types.SimpleNamespace(reg=types.SimpleNamespace(device="cpu"))
    w.registrar, w._cuda = registrar, False  # CPU engines: nothing to order on a stream
    w.wait_for_save()
    assert posted[-1] == cmds.SaveOnStream(jobs, None, None, 0)


def test_a_steps_releases_go_with_its_save_once_and_alone_when_it_saves_nothing():
    """One wake-up of the transfer thread per store step: the finished requests of the step
    ride on its "save" command, and get_transfer_results posts them only for a step without
    stores; never twice."""
    w = object.__new__(WorkerConnector)
    w.stores_chunks = True  # (every rank of a dense model stores)
    posted = []
    w.mover = types.SimpleNamespace(started=True, post=posted.append, merge_rest=lambda out: out)
    w._post_quiet = posted.append  # (saves and releases: `TransferThread.post_quiet`)
    registrar = types.SimpleNamespace(reg=types.SimpleNamespace(device="cpu"))
    w.stores_may_wait, w.registrar, w._cuda, w._active = True, registrar, False, True
    w._saves_posted, w._sliding_saves, w._released, w._invalid_blocks = 0, [], None, set()
    w._outbox = ()  # nothing ended
    jobs = [_job("a", 2, 0)]
    w._meta = KVDepotMetadata(stores=jobs, release=["r1"])
    w.wait_for_save()
    res = w.get_transfer_results(set())
    assert (res.finished_sending, res.finished_recving, res.failed_recving) == (set(), set(), set())
    assert posted == [cmds.SaveOnStream(jobs, ["r1"], None, 0)]
    w._meta = KVDepotMetadata(release=["r2"])  # a step with nothing to store
    w.wait_for_save()
    w.get_transfer_results(set())
    w.get_transfer_results(set())
    assert posted[1:] == [cmds.Release(["r2"])]


def test_a_wait_for_save_that_raises_before_posting_leaves_the_releases_to_get_transfer_results():
    w = object.__new__(WorkerConnector)
    w.stores_chunks = True  # (every rank of a dense model stores)
    posted = []
    w.mover = types.SimpleNamespace(started=True, post=posted.append, merge_rest=lambda out: out,
                                    sender=types.SimpleNamespace(
                                        stage_saves=lambda jobs, s: pytest.fail("dense models never stage here")))
    w._post_quiet = posted.append  # (saves and releases: `TransferThread.post_quiet`)
    registrar = types.SimpleNamespace(reg=types.SimpleNamespace(device="cuda"))
    w.stores_may_wait, w.registrar, w._cuda, w._active = True, registrar, True, True
    w._saves_posted, w._sliding_saves, w._released, w._invalid_blocks = 0, [], None, set()
    w._outbox = ()

    def broken():
        raise RuntimeError("no current stream")

    w._current_stream = broken
    w._meta = KVDepotMetadata(stores=[_job("a", 2, 0)], release=["r1"])
    with pytest.raises(RuntimeError):
        w.wait_for_save()
    w.get_transfer_results(set())
    assert posted == [cmds.Release(["r1"])]


def test_a_save_commands_releases_count_even_when_its_save_fails():
    """The transfer thread books the releases of a "save" after its stores were queued, and
    also when handling the save raised: a lost release would keep the request's blocks forever."""
    mv, client, side = _thread()

    def boom(*a):
        raise RuntimeError("save failed")

    mv._handle_save = boom
    with pytest.raises(RuntimeError):
        mv._handle(cmds.SaveAfterEvent([_job("a", 2, 0)], ["r1"], None))
    assert mv._release == {"r1"}


def test_one_piece_stores_of_several_requests_share_one_gather_and_one_request():
    """A daemon that takes several runs per request: the step's one-piece stores (one-chunk
    requests, many per step) are gathered by one call into one region and sent as one request,
    a run per request; a store of several pieces keeps its own."""
    mv, client, side = _thread(chains=True)
    jobs = [_job("a", 1, 0, parent=b"p" * 16), _job("big", 6, 40), _job("b", 2, 100), _job("c", 1, 200)]
    staged = mv.sender.stage_saves(jobs, object())
    # one gather for a, b and c (4 chunks: a piece), then one for big's two pieces
    assert [n for _, n, _ in client.staged] == [4, 6] and client.runs == [[4, 2]]
    assert client.staged[0][0][0] == list(range(0, 4)) + list(range(100, 108)) + list(range(200, 204))
    mv.sender.send_staged(jobs, staged)
    together = client.sent[0]
    mask = shard_mask(b"s" * 16, "tp0of1")
    assert [it.keys for it in together["items"]] == [shard_keys(j.chain, [mask])[0] for j in (jobs[0], jobs[2], jobs[3])]
    assert together["items"][0].parent == shard_keys([b"p" * 16], [mask])[0][0]
    assert [it.parent for it in together["items"][1:]] == [b"", b""]
    assert [s.get("request") for s in client.sent[1:]] == ["big", "big"]
    assert sorted((op.piece.req_id, op.run) for op in mv.book.ops) == [("a", 0), ("b", 1), ("big", -1), ("big", -1),
                                                                   ("c", 2)]


def test_a_job_of_several_pieces_is_gathered_by_one_call_wherever_its_pieces_fit():
    """All of a job's pieces are placed as they would be one by one (end to end, or the later
    ones wrapped to the ring's start) and gathered by one call; where not all fit, each piece
    is staged alone as before (the rest of the job skipped)."""
    mv, client, side = _thread(ring_objects=12)  # pieces of 3 chunks
    first = client.ring.alloc(4 * OBJECT_BYTES, object())  # [0, 4)
    client.ring.alloc(5 * OBJECT_BYTES, object())  # [4, 9)
    first.release()  # free: [9, 12) and [0, 4)
    staged = mv.sender.stage_saves([_job("a", 6, 0)], object())
    assert client.runs == [[3, 3]] and [p.region.offset for p in staged.per_job[0]] == [9 * OBJECT_BYTES, 0]

    mv, client, side = _thread(ring_objects=12)
    held = client.ring.alloc(4 * OBJECT_BYTES, object())  # [0, 4)
    client.ring.alloc(6 * OBJECT_BYTES, object())  # [4, 10)
    held.release()  # free: [10, 12) and [0, 4): the 3 + 2 chunks of b do not both fit
    staged = mv.sender.stage_saves([_job("b", 5, 0)], object())
    assert client.runs == [] and [n for _, n, _ in client.staged] == [3]  # the first piece alone fits
    assert staged.per_job[0][1].region is None  # the second found no room: the rest of b is skipped


def test_get_transfer_results_returns_what_the_thread_published_merged_and_nothing_else():
    """The transfer thread builds vLLM's ``KVConnectorTransferResults`` when it publishes
    (`TransferThread._publish`), over the sets it publishes, so that the engine thread only hands
    it over: two publications taken in one step come back as one result holding both, a later
    one alone, and a step with nothing published gets the shared empty result."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    from kvdepot.client.vllm.worker import NO_RESULTS

    side = types.SimpleNamespace(cfg=None, client=None, stats={}, registrar=types.SimpleNamespace())
    t = TransferThread(side)
    w = object.__new__(WorkerConnector)
    w.stores_chunks = True  # (every rank of a dense model stores)
    w.mover, w._outbox, w._post_quiet = t, t.outbox, t.post_quiet
    w._active, w._meta, w._released, w._invalid_blocks, w._saves_ended = True, None, None, set(), set()
    assert w.get_transfer_results() is NO_RESULTS
    t._release = {"r1"}
    t._publish()
    t._release = {"r2"}
    t.book.loads.recving = {"r9"}  # a load that ended
    t._publish()
    assert len(t.outbox) == 2
    got = w.get_transfer_results()
    assert isinstance(got, KVConnectorTransferResults)
    assert got.finished_sending == {"r1", "r2"} and got.finished_recving == {"r9"} and not got.failed_recving
    assert not t.outbox and w.get_transfer_results() is NO_RESULTS
    t._release = {"r3"}
    t._publish()
    got = w.get_transfer_results()
    assert got.finished_sending == {"r3"} and not got.finished_recving
