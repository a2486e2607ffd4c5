"""A gated retrieve's landed word (`Retrieve.landed`, `kvdepot.client.staging.FenceWords`):
its encoding, who may write it when, and when its region counts as free. The words are plain
host memory here (no GPU: the GPU's writes are played by the test)."""

from __future__ import annotations

import ctypes

import pytest

from kvdepot.client.staging import FENCE_ABANDONED_BIT, FenceWords
from kvdepot.protocol import messages as m
from kvdepot.server.checks import landed_word, stored_word


def _words(n: int = 16) -> FenceWords:
    f = FenceWords.__new__(FenceWords)  # the predicates only: no memfd, no CUDA registration
    f.words = n
    f._view = (ctypes.c_uint64 * n)()
    return f


def test_the_value_carries_region_and_count_and_refuses_what_does_not_fit():
    v = m.landed_value(37, 5)
    assert v & m.LANDED_BIT and v & m.LANDED_MAX_SEQ == 37 and v >> m.LANDED_COUNT_SHIFT & m.LANDED_MAX_CHUNKS == 5
    assert not v & m.GATE_DONE_BIT
    assert m.landed_value(m.LANDED_MAX_SEQ, m.LANDED_MAX_CHUNKS) & m.GATE_DONE_BIT == 0  # the bits never overlap
    for seq, n in ((m.LANDED_MAX_SEQ + 1, 0), (1, m.LANDED_MAX_CHUNKS + 1), (-1, 0), (1, -1)):
        with pytest.raises(ValueError):
            m.landed_value(seq, n)


def test_a_word_lands_opens_and_frees_in_order():
    f = _words()
    seq = 21  # word 5, last used by region 5
    f._view[seq % f.words] = 5 | FENCE_ABANDONED_BIT  # an earlier store's mark
    f.close_gate(seq)
    assert not f.landed(seq) and not f.holds(seq)
    f._view[seq % f.words] = m.landed_value(seq, 3)  # the daemon's DMA stream
    assert f.landed(seq) and f.landed_count(seq) == 3 and not f.holds(seq)
    f.open_gate(seq)  # too late to change anything: the daemon's count stays
    assert f.landed_count(seq) == 3
    f._view[seq % f.words] |= m.GATE_DONE_BIT  # the scatter ran
    assert f.holds(seq) and f.landed(seq) and f.landed_count(seq) == 3
    assert not f.holds(seq + f.words) and not f.landed(seq + f.words)  # another region of the word


def test_a_retrieve_that_copied_nothing_is_opened_by_the_engine_with_no_chunks():
    f = _words()
    seq = 25
    f.close_gate(seq)
    f.open_gate(seq)
    assert f.landed(seq) and f.landed_count(seq) == 0 and not f.holds(seq)
    f._view[seq % f.words] |= m.GATE_DONE_BIT
    assert f.holds(seq)
    f._view[seq % f.words] = m.landed_value(seq - f.words, 4) | m.GATE_DONE_BIT  # an older region's
    assert not f.holds(seq) and not f.landed(seq)


class _Fence:
    dev_ptr = 0x10000

    def landed_ptr(self, seq: int) -> int:
        return self.dev_ptr + (seq % 8) * 8


class _Reg:
    fence = _Fence()


def test_the_daemon_writes_a_word_only_for_what_it_can_encode():
    def req(**kw):
        base = dict(rid=1, registration="r", keys=[b"k" * 16], block_ids=[[0]], staging_offset=0, staging_seq=10,
                    landed=True)
        base.update(kw)
        return m.Retrieve(**base)

    assert landed_word(_Reg(), req(), 1) == (0x10000 + 2 * 8, m.landed_value(10, 1))
    assert landed_word(_Reg(), req(landed=False), 1) is None
    assert landed_word(_Reg(), req(staging_seq=0), 1) is None
    assert landed_word(_Reg(), req(staging_seq=m.LANDED_MAX_SEQ + 1), 1) is None
    unmapped = _Reg()
    unmapped.fence = type("F", (), {"dev_ptr": 0})()
    assert landed_word(unmapped, req(), 1) is None
    assert m.Retrieve(rid=1, registration="r", keys=[b"k" * 16], block_ids=[[0]]).landed is False


def test_a_landed_store_word_says_done_and_settled():
    """A store's word after the daemon's copies (`Store.landed`): landed with the count, and
    settled (`holds`: no GPU write of the region pending), where the gather's own value was
    only settled."""
    f = _words()
    seq = 19
    f._view[seq % f.words] = seq  # the engine's gather ran
    assert f.holds(seq) and not f.landed(seq)
    f._view[seq % f.words] = m.stored_value(seq, 16)  # the daemon's DMA stream after its copies
    assert f.landed(seq) and f.landed_count(seq) == 16 and f.holds(seq)
    assert not f.landed(seq + f.words) and not f.holds(seq + f.words)


def test_the_daemon_ends_a_store_in_its_word_only_when_every_chunk_is_copied():
    def req(**kw):
        base = dict(rid=1, registration="r", keys=[b"k" * 16, b"j" * 16], block_ids=[[0, 1]], staging_offset=0,
                    staging_seq=10, fence=10, landed=True)
        base.update(kw)
        return m.Store(**base)

    assert stored_word(_Reg(), req(), 2) == (0x10000 + 2 * 8, m.stored_value(10, 2))
    assert stored_word(_Reg(), req(), 1) is None  # one chunk present or skipped: the reply says which
    assert stored_word(_Reg(), req(landed=False), 2) is None
    assert stored_word(_Reg(), req(fence=11), 2) is None  # fenced under another number
    assert stored_word(_Reg(), req(fence=0), 2) is None  # gathered before the send: no word of its own
    assert stored_word(_Reg(), req(chains=[m.Chain(start=0, parent=b"")]), 2) is None
    assert stored_word(_Reg(), req(staging_seq=m.LANDED_MAX_SEQ + 1, fence=m.LANDED_MAX_SEQ + 1), 2) is None
    unmapped = _Reg()
    unmapped.fence = type("F", (), {"dev_ptr": 0})()
    assert stored_word(unmapped, req(), 2) is None
    assert m.Store(rid=1, registration="r", keys=[b"k" * 16], block_ids=[[0]]).landed is False


def test_a_client_waits_for_its_landed_stores_replies_before_its_next_lookup(monkeypatch):
    """A store that ended on its word leaves its reply due (`Connection._unconfirmed`): the
    next request other than a store reads it first (the daemon's commit is then done), and the
    reply is dropped, not kept for a wait nobody makes; a lost connection forgets them."""
    from kvdepot.client.client import KVDepotClient

    c = KVDepotClient("ipc:///nonexistent/kvd.sock", connect=False)
    sent, replies = [], []

    class Sock:
        closed = False

        def send(self, frame, flags=0):
            sent.append(frame)

        def close(self, linger=0):
            pass

    c.conn._sock = Sock()
    try:
        _confirm_flow(c, sent, replies, monkeypatch)
    finally:
        c.close()


def _confirm_flow(c, sent, replies, monkeypatch) -> None:
    c.conn._outstanding.add(7)
    c.conn._unconfirmed.add(7)
    c.conn._unread = 1

    def poll(timeout_s=0.0):  # the store's reply arrives
        replies.append(timeout_s)
        c.conn._on_reply(m.StoreReply(rid=7, stored=2, present=0, skipped=0))

    monkeypatch.setattr(c.conn, "poll", poll)
    c.submit(m.Store(rid=0, registration="r", keys=[b"k" * 16], block_ids=[[0]]))  # stores do not wait
    assert not replies and c.conn._unconfirmed == {7}
    c.submit(m.Lookup(rid=0, keys=[[b"k" * 16]], chunk_size=16))
    assert replies and not c.conn._unconfirmed and 7 not in c.conn._outstanding and 7 not in c.conn._replies
    c.conn._unconfirmed.add(9)
    c.conn._outstanding.add(9)
    c.conn._reset()
    assert not c.conn._unconfirmed and 9 not in c.conn._replies
