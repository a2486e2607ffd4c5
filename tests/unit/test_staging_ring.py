"""The engine-side staging ring's allocator (`kvdepot.client.staging.StagingRing`): regions never
overlap, stay inside the ring and 256-byte aligned, are handed out first-in first-out, and the
allocator waits for (reclaims) the oldest regions only when there is no room."""

from __future__ import annotations

import random
import types

from kvdepot.client.staging import StagingRing


def _overlaps(live) -> bool:
    spans = sorted((r.offset, r.offset + r.size_bytes) for r in live)
    return any(a[1] > b[0] for a, b in zip(spans, spans[1:]))


def test_regions_are_aligned_disjoint_and_wrap():
    ring = StagingRing(4096)
    a = ring.alloc(1000)
    b = ring.alloc(1024)
    assert (a.offset, a.size_bytes, b.offset) == (0, 1024, 1024)
    c = ring.alloc(2048)
    assert c.offset == 2048
    a.is_free = lambda: True  # the oldest ends: the next region wraps to the start
    d = ring.alloc(512)
    assert d.offset == 0 and [r.offset for r in ring.live] == [1024, 2048, 0]
    assert ring.alloc(8192) is None  # larger than the ring: the caller goes unstaged
    assert ring.alloc(0) is None


def test_full_ring_reclaims_the_oldest_region_only():
    ring = StagingRing(3 * 256)
    regs = [ring.alloc(256) for _ in range(3)]
    calls = []

    def reclaim(r):
        calls.append(r.offset)
        r.is_free = lambda: True
        return True

    for r in regs:
        r.reclaim = lambda r=r: reclaim(r)
    e = ring.alloc(256)
    assert calls == [0] and e.offset == 0
    regs[2].is_free = lambda: True  # freed out of order: not reusable before the older region 1
    f = ring.alloc(256)
    assert calls == [0, 256] and f.offset == 256


def test_unreclaimable_oldest_region_makes_alloc_give_up():
    ring = StagingRing(512)
    ring.alloc(512)  # reclaim() of a region lost in a timeout answers False
    assert ring.alloc(256) is None


def test_random_workload_never_overlaps():
    rng = random.Random(3)
    ring = StagingRing(1 << 16)
    for _ in range(5000):
        r = ring.alloc(rng.choice([1, 256, 300, 4096, 20000, 65536]))
        assert r is not None and r.offset % 256 == 0 and r.offset + r.size_bytes <= ring.size_bytes
        assert not _overlaps(ring.live)
        r.reclaim = lambda r=r: setattr(r, "is_free", lambda: True) or True
        for x in list(ring.live):
            if rng.random() < 0.3:
                x.is_free = lambda: True


def test_another_clients_region_is_polled_never_reclaimed():
    ring = StagingRing(512, foreign_wait_s=0.01)
    r = ring.alloc(512, owner="client-a")
    r.reclaim = lambda: (_ for _ in ()).throw(AssertionError("reclaimed by another client"))
    assert ring.alloc(256, owner="client-b") is None  # gave up after foreign_wait_s
    r.is_free = lambda: True
    assert ring.alloc(256, owner="client-b").offset == 0


def test_reset_frees_regions_lost_with_a_dead_daemon():
    """A region whose request was lost (timeout, dead daemon) stays taken until `reset`, which
    `KVDepotClient.reregister` calls once a new daemon boot has the registration."""
    ring = StagingRing(1024)
    lost = ring.alloc(512)  # its reclaim() answers False: the client cannot tell if copies still run
    ring.alloc(256).release()
    assert ring.alloc(768) is None
    ring.reset()
    again = ring.alloc(768)
    assert again is not None and again.offset == 0 and list(ring.live) == [again]
    assert lost not in ring.live


def test_live_regions_have_distinct_fence_words_and_numbers_are_never_reused():
    """A store's fence value is its region's number; the word is number % (max_live + 1): the
    ring keeps at most max_live regions live, so two live regions never share a word."""
    ring = StagingRing(1 << 20, max_live=3)
    regs = [ring.alloc(256) for _ in range(3)]
    assert [r.seq for r in regs] == [1, 2, 3]
    assert ring.alloc(256, wait=False) is None  # a fourth live region would share a word
    regs[0].is_free = lambda: True
    r4 = ring.alloc(256, wait=False)
    assert r4.seq == 4 and len({r.seq % 4 for r in ring.live}) == 3
    ring.reset()  # numbers go on after a reset (a late fence write of a lost store never matches)
    assert ring.alloc(256).seq == 5


def test_a_load_ring_beside_the_store_ring_has_room_of_its_own_and_numbers_in_one_sequence():
    """`EngineStaging.load_ring`: a second ring after the first in the same buffer, for
    retrieves. A full store ring leaves its room alone; both number their regions in one
    sequence, and their live regions span at most max_live numbers (one fence word each)."""
    stores = StagingRing(1024, max_live=4)
    loads = StagingRing(1024, base=1024, shares=stores, max_live=4)
    a, b = stores.alloc(512, wait=False), stores.alloc(512, wait=False)
    assert stores.alloc(256, wait=False) is None  # the store ring is full...
    x = loads.alloc(768, wait=False)  # ...the load ring is not: its room starts at its base
    assert (x.offset, x.size_bytes) == (1024, 768)
    assert [a.seq, b.seq, x.seq] == [1, 2, 3] and stores.last_seq == loads.last_seq == 3
    assert loads.alloc(512, wait=False) is None  # no room: it never reaches past its own part
    x.is_free = lambda: True
    y = loads.alloc(512, wait=False)
    assert y.offset == 1024 and y.seq == 4  # wrapped to its own base
    # live numbers 1, 2 (stores) and 4 (loads): a fifth number would make them span 5 > max_live
    # though the load ring has room
    assert loads.alloc(256, wait=False) is None
    a.is_free = lambda: True  # the oldest number frees: 2..5 fit
    z = loads.alloc(256, wait=False)
    assert (z.offset, z.seq) == (1536, 5)
    live = [r.seq for ring in (stores, loads) for r in ring.live]
    assert sorted(live) == [2, 4, 5] and len({n % 5 for n in live}) == 3
    # a Drain (by number) settles both rings' regions
    loads.drained_through = 4
    assert stores.drained_through == 4


def test_an_idle_ring_does_not_keep_a_freed_region_number_live():
    """A ring that allocates nothing for a while pops no freed region of its own: the other
    ring's numbering takes them off, so stores never stall on an old load's number."""
    stores = StagingRing(1 << 20, max_live=3)
    loads = StagingRing(1 << 20, base=1 << 20, shares=stores, max_live=3)
    old = loads.alloc(256)
    old.is_free = lambda: True
    for _ in range(10):
        r = stores.alloc(256, wait=False)
        assert r is not None
        r.is_free = lambda: True
    assert list(loads.live) == []


def test_a_fenced_store_region_is_free_only_once_its_gather_ran():
    """After the reply (or an error reply) the region stays taken until the fence word holds
    its number: the gather may still be queued on the engine's stream."""
    from kvdepot.client.pending import LinkPace, PendingStore
    from kvdepot.protocol import messages as m
    from kvdepot.protocol.errors import ErrorCode, KVDepotError

    class Fence:
        written: set = set()

        def holds(self, seq):
            return seq in self.written

    class Client:
        timeout_s = 0.05
        store_pace = LinkPace()

        def __init__(self, reply):
            self.reply = reply

        def done(self, rid):
            return True

        def on_own_thread(self):
            return True

        def wait(self, rid, timeout_s=None, spin_from=0.0, until=None):
            if isinstance(self.reply, BaseException):
                raise self.reply
            return self.reply

    ring = StagingRing(4096)
    fence = Fence()
    ok = ring.alloc(256)
    PendingStore(Client(m.StoreReply(rid=1, stored=1, present=0, skipped=0)), 1, ok, 1, fence)
    failed = ring.alloc(256)
    PendingStore(Client(KVDepotError(ErrorCode.ENGINE_MEMORY, "x")), 2, failed, 1, fence)
    assert not ok.is_free() and not failed.is_free()
    assert not failed.reclaim()  # waits up to the client's timeout for the word, then gives up
    fence.written.update({ok.seq, failed.seq})
    assert ok.is_free() and failed.is_free()


class _Words:
    """Stands in for `FenceWords`: the numbers whose gathers "ran"."""

    def __init__(self) -> None:
        self.written: set[int] = set()

    def holds(self, seq: int) -> bool:
        return seq in self.written


def test_reset_keeps_a_store_region_whose_gather_has_not_run():
    """A daemon restart resets the ring, but the engine's GPU still writes a store region whose
    gather is queued (the engine thread may have gathered a store the thread never sent): it
    stays taken, nothing new overlaps it, and it frees once its fence word is written."""
    ring = StagingRing(1024)
    words = _Words()
    pending_gather = ring.alloc(256, fenced=True)
    gathered = ring.alloc(256, fenced=True)
    words.written.add(gathered.seq)
    ring.alloc(256)  # a retrieve's region lost with the daemon: forgotten by the reset
    ring.reset(words)
    assert list(ring.live) == [pending_gather]
    assert ring.alloc(1024, wait=False) is None  # would overlap the region the GPU writes
    new = ring.alloc(512, wait=False)
    assert new is not None and new.offset >= pending_gather.offset + pending_gather.size_bytes
    assert not pending_gather.is_free()
    words.written.add(pending_gather.seq)
    assert pending_gather.is_free()
    new.release()
    assert ring.alloc(1024, wait=False) is not None


def test_reset_without_fence_words_forgets_every_region():
    ring = StagingRing(1024)
    ring.alloc(512, fenced=True)
    ring.reset()
    assert not ring.live and ring.alloc(1024, wait=False) is not None


def test_an_abandoned_store_region_frees_once_its_gather_ran():
    """`KVDepotClient.abandon_region`: a staged store that will not be sent gives its region
    back once the GPU wrote its fence word, at once if it was not fenced."""
    import types

    from kvdepot.client.client import KVDepotClient

    words = _Words()
    reg = types.SimpleNamespace(staging=types.SimpleNamespace(fence=words))
    ring = StagingRing(1024)
    fenced = ring.alloc(512, fenced=True)
    plain = ring.alloc(512)
    KVDepotClient.abandon_region(reg, fenced)
    KVDepotClient.abandon_region(reg, plain)
    assert plain.is_free() and not fenced.is_free()
    assert ring.alloc(512, wait=False) is None  # the oldest (fenced) still blocks the ring
    words.written.add(fenced.seq)
    assert fenced.is_free() and ring.alloc(1024, wait=False) is not None


def _fence_words(n: int = 8):
    """A `FenceWords` over plain host memory (no GPU: nothing registers it; ``signal`` unused)."""
    import ctypes

    from kvdepot.client.staging import FenceWords

    f = FenceWords.__new__(FenceWords)
    f.words = n
    f._view = (ctypes.c_uint64 * n)()
    return f


def _staged_client(gather_fails: bool):
    """A client whose sends and gathers are recorded in ``calls`` (no daemon, no GPU)."""
    import types

    from kvdepot.client.client import KVDepotClient
    from kvdepot.gpu.kernels import KernelError
    from kvdepot.protocol import messages as m

    c = KVDepotClient("ipc:///nonexistent/kvd.sock", connect=False)
    calls = []

    def submit(req):
        calls.append(("send", req.fence, req.staging_offset) if isinstance(req, m.Store) else ("other",))
        c.conn._outstanding.add(41)
        return 41

    def gather(block_ids, num_chunks, offset, stream, fence_seq=None):
        calls.append(("gather", offset, fence_seq))
        if gather_fails:
            raise KernelError("kvd_engine_gather: an out-of-range block id")

    fence = _fence_words()
    fence.signal = lambda seq, stream: calls.append(("signal", seq))
    ring = StagingRing(4096)
    staging = types.SimpleNamespace(fence_active=True, landed_active=False, fence=fence, ring=ring, load_ring=ring,
                                    rings=[ring], gather=gather, device=None)
    reg = types.SimpleNamespace(staging=staging, object_bytes=1024, id="r1")
    c.conn.submit = submit
    return c, reg, calls


def test_a_fenced_store_is_sent_before_its_gather_is_enqueued():
    """With fence words the store travels while the gather is enqueued: the daemon copies only
    once the GPU wrote the word, so the gather's launch no longer comes before the send."""
    c, reg, calls = _staged_client(gather_fails=False)
    try:
        pend = c.submit_store(reg, [b"k" * 16, b"j" * 16], [[1, 2]], after=object())
        region = reg.staging.ring.live[-1]
        # the fence word's write goes with the gather, in one call (no separate signal)
        assert calls == [("send", region.seq, region.offset), ("gather", region.offset, region.seq)]
        assert pend.rid == 41 and not region.is_free()
    finally:
        c.close()


def test_a_gather_that_fails_after_the_send_is_given_up_through_its_fence_word():
    """The launch fails after the store went out: the word tells the daemon to copy nothing
    (value | FENCE_ABANDONED_BIT, which the daemon's issuer drops), the reply is not awaited,
    the region is free at once, and the caller gets the KernelError."""
    import pytest

    from kvdepot.client.staging import FENCE_ABANDONED_BIT
    from kvdepot.gpu.kernels import KernelError

    c, reg, calls = _staged_client(gather_fails=True)
    try:
        with pytest.raises(KernelError):
            c.submit_store(reg, [b"k" * 16], [[1]], after=object())
    finally:
        c.close()
    (seq,) = [fence for op, fence, *_ in calls if op == "send"]
    fence = reg.staging.fence
    assert fence._view[seq % fence.words] == seq | FENCE_ABANDONED_BIT and fence.holds(seq)
    assert 41 not in c.conn._outstanding  # a late (error) reply is dropped
    assert reg.staging.ring.alloc(4096, wait=False) is not None  # nothing of the ring stays taken
    assert not fence.holds(seq + 1)


def test_link_pace_learns_the_fastest_large_request_and_waits_spin_shortly_before_it():
    """`LinkPace`: only requests of at least 4 MiB teach it; it keeps the fastest; a wait then
    spins from 30 us before a request of that size sent then could be answered."""
    import time

    from kvdepot.client.pending import LinkPace

    pace = LinkPace()
    assert pace.spin_from(100.0, 32 << 20) == 0.0  # nothing learnt: spin at once
    now = time.monotonic()
    pace.learn(now - 1.0, 1 << 20)  # too small to teach
    assert pace.s_per_byte is None
    pace.learn(now - 0.002, 32 << 20)
    slow = pace.s_per_byte
    assert 0.002 / (32 << 20) <= slow < 0.1 / (32 << 20)
    pace.learn(time.monotonic() - 0.5, 32 << 20)  # slower: the fastest stays
    assert pace.s_per_byte == slow
    assert abs(pace.spin_from(100.0, 64 << 20) - (100.0 + (64 << 20) * slow - 30e-6)) < 1e-9


def test_a_staged_retrieve_waits_with_its_link_pace_and_teaches_it():
    """A staged retrieve's wait gets ``spin_from`` from the client's retrieve pace (as a store's
    from its store pace), and a whole reply teaches it."""
    import types

    from kvdepot.client.pending import LinkPace, PendingRetrieve, ScatterNote
    from kvdepot.protocol import messages as m

    seen = []

    class Client:
        retrieve_pace = LinkPace()
        last_scatter = ScatterNote()

        def wait(self, rid, timeout_s=None, spin_from=0.0, until=None):
            seen.append(spin_from)
            return m.RetrieveReply(rid=rid, retrieved=0)  # nothing to scatter (no GPU here)

    c = Client()
    ring = StagingRing(64 << 20)
    learnt = []
    for _ in range(2):
        learnt.append(c.retrieve_pace.s_per_byte)
        p = PendingRetrieve(c, 1)
        region = ring.alloc(2 * (8 << 20))
        p._staged(types.SimpleNamespace(staging=None), region, [[0]], 2, 0)
        p._num_chunks = 0  # a whole reply (0 of 0 chunks) for the test
        assert p.result(before=types.SimpleNamespace()) == 0  # a stream stand-in: nothing is enqueued
        region.release()
    assert seen[0] == 0.0 and learnt[1] is not None
    assert abs(seen[1] - (p._sent_at + (16 << 20) * learnt[1] - 30e-6)) < 1e-9


def test_a_staged_retrieve_with_fence_words_frees_its_region_by_its_word_not_an_event(monkeypatch):
    """With fence words the scatter and the write of the region's number into its word go in one
    call and no CUDA event is made per retrieve: the region stays taken (also across a ring
    reset, e.g. after a daemon restart) until the GPU wrote the word; `last_retrieve_event` is
    made only when read, on the scatter's stream."""
    import torch

    from kvdepot.protocol import messages as m

    c, reg, _ = _staged_client(gather_fails=False)
    scatters = []

    def scatter(block_ids, num_chunks, retrieved, offset, skip_tokens, stream, done_seq=None):
        scatters.append((offset, retrieved, stream, done_seq))

    reg.staging.scatter = scatter
    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: made.append(1))  # none may be made
    try:
        c.conn.submit = lambda req: (c.conn._outstanding.add(7), 7)[1]
        c.conn.wait = lambda rid, timeout_s=None, spin_from=0.0: m.RetrieveReply(rid=rid, retrieved=2)
        pend = c.submit_retrieve(reg, [b"k" * 16, b"j" * 16], [[1, 2]])
        region = reg.staging.ring.live[-1]
        stream = object()
        assert pend.result(before=stream) == 2
        assert scatters == [(region.offset, 2, stream, region.seq)] and made == []
        assert c.conn.last_scatter.stream is stream
        fence = reg.staging.fence
        assert region.fenced and not region.is_free()
        reg.staging.ring.reset(fence)
        assert reg.staging.ring.live and reg.staging.ring.live[-1] is region  # its scatter may still read it
        fence._view[region.seq % fence.words] = region.seq
        assert region.is_free()
    finally:
        c.close()


def test_pieces_are_placed_as_one_by_one_allocations_numbered_in_order_all_or_none():
    """`StagingRing.alloc_pieces`: regions for requests one call gathers (`EngineStaging.gather_pieces`)."""
    ring = StagingRing(4096, max_live=6)
    a = ring.alloc(1536)
    run = ring.alloc_pieces([512, 1000, 256], fenced=True)  # 1000: rounded up to 1024
    assert [(r.offset, r.size_bytes, r.seq) for r in run] == [(1536, 512, 2), (2048, 1024, 3), (3072, 256, 4)]
    assert all(r.fenced for r in run) and ring.head == 3328
    live = list(ring.live)
    assert ring.alloc_pieces([512, 512]) is None  # the first fits at the end, the second nowhere
    assert list(ring.live) == live and ring.head == 3328 and ring.last_seq == 4  # as if never asked
    assert ring.alloc_pieces([256, 256, 256]) is None  # room, but seven live regions (max_live 6)
    assert ring.alloc_pieces([]) is None and ring.alloc_pieces([0]) is None
    a.release()
    run2 = ring.alloc_pieces([512, 1024])  # the first at the end, the second wraps to the start
    assert [(r.offset, r.seq) for r in run2] == [(3328, 5), (0, 6)] and ring.head == 1024


def test_no_gpu_room_for_the_retrieves_ring_leaves_them_the_staging_ring_not_staging_off(monkeypatch, caplog):
    """`engine_staging`: a ring for retrieves the GPU has no memory for is given up (logged),
    the staging ring kept; staging goes off only where the staging ring itself fails."""
    import torch

    import kvdepot.client.staging as staging
    import kvdepot.gpu.kernels as kernels
    import kvdepot.gpu.layout as layout
    from kvdepot.client.registration import engine_staging

    made = []

    class FakeStaging:
        def __init__(self, kernels, device, layout, storages, ring_bytes, load_ring_bytes=0):
            if load_ring_bytes or ring_bytes > (1 << 30):
                raise torch.OutOfMemoryError("CUDA out of memory")
            made.append((ring_bytes, load_ring_bytes))

    monkeypatch.setattr(kernels, "load_kernels", lambda: object())
    monkeypatch.setattr(layout, "group_layers", lambda *a: None)
    monkeypatch.setattr(staging, "EngineStaging", FakeStaging)
    req = types.SimpleNamespace(layers=[], groups=[], chunk_size=16, storages=[])
    dev = [types.SimpleNamespace(device="cuda:0")]
    got = engine_staging(req, dev, 8 << 20, 4 << 20)
    assert isinstance(got, FakeStaging) and made == [(8 << 20, 0)]
    assert "retrieves share the staging ring" in caplog.text
    assert engine_staging(req, dev, 2 << 30, 4 << 20) is None  # the staging ring itself: staging off
    assert "engine-side staging off" in caplog.text
