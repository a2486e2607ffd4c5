"""The daemon's message front (kvdepot.server.front): a reply that cannot be encoded still
answers its request, with a typed INTERNAL error, instead of leaving the client to time out."""

from __future__ import annotations

import types

from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode
from kvdepot.server.front import Front


class _Front(Front):
    """A front whose sends are recorded, with ``inflight`` copies in flight."""

    def __init__(self, busy_poll_s: float = 0.0, busy_poll_max_inflight: int = 2, inflight: int = 0) -> None:
        self.sent: list[tuple[bytes, bytes]] = []
        self.errors: list[str] = []
        counter = types.SimpleNamespace(inc=lambda: None)
        metrics = types.SimpleNamespace(errors=types.SimpleNamespace(
            labels=lambda name: (self.errors.append(name), counter)[1]))
        super().__init__(metrics, lambda: inflight, busy_poll_s, busy_poll_max_inflight, None,
                         lambda identity: None, lambda identity: None)

    def send(self, identity: bytes, frame: bytes) -> None:
        self.sent.append((identity, frame))


def test_an_unencodable_reply_becomes_an_internal_error_reply():
    f = _Front()
    f.reply(b"engine", m.LookupReply(rid=5, hit_chunks=2**70))
    assert len(f.sent) == 1 and f.sent[0][0] == b"engine"
    err = codec.decode_reply(f.sent[0][1])
    assert isinstance(err, m.ErrorReply) and err.rid == 5 and err.code == ErrorCode.INTERNAL
    assert "OverflowError" in err.message and f.errors == ["INTERNAL"]
    f.reply(b"engine", m.LookupReply(rid=6, hit_chunks=2))
    assert codec.decode_reply(f.sent[1][1]) == m.LookupReply(rid=6, hit_chunks=2)


def test_the_loop_busy_polls_only_while_few_copies_are_in_flight():
    """`--busy-poll-max-inflight`: with more copies in flight than that, a request or reply does
    not start the loop's busy poll (the queued copies keep the link busy through a wake-up);
    with fewer it does, and -1 polls whatever is in flight."""
    scheduled = []

    class Loop:
        def call_soon(self, fn):
            scheduled.append(fn)

    def front(max_inflight: int, inflight: int) -> _Front:
        f = _Front(0.002, max_inflight, inflight)
        f._loop = Loop()
        return f

    for max_inflight, inflight, polls in ((2, 3, False), (2, 2, True), (2, 0, True), (-1, 64, True), (0, 1, False)):
        scheduled.clear()
        f = front(max_inflight, inflight)
        f._note_activity()
        assert f._spinning is polls and len(scheduled) == int(polls), (max_inflight, inflight)
