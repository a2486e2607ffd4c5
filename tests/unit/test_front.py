"""The daemon's message front (kvdepot.server.front): a reply that cannot be encoded still
answers its request, with a typed INTERNAL error, instead of leaving the client to time out."""

from __future__ import annotations

import types

from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode
from kvdepot.server.front import SocketFront


class _Front(SocketFront):
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, bytes]] = []
        self.errors: list[str] = []
        counter = types.SimpleNamespace(inc=lambda: None)
        self.metrics = types.SimpleNamespace(errors=types.SimpleNamespace(
            labels=lambda name: (self.errors.append(name), counter)[1]))

    def _send(self, identity: bytes, frame: bytes) -> None:
        self.sent.append((identity, frame))


def test_an_unencodable_reply_becomes_an_internal_error_reply():
    f = _Front()
    f._reply(b"engine", m.LookupReply(rid=5, hit_chunks=2**70))
    assert len(f.sent) == 1 and f.sent[0][0] == b"engine"
    err = codec.decode_reply(f.sent[0][1])
    assert isinstance(err, m.ErrorReply) and err.rid == 5 and err.code == ErrorCode.INTERNAL
    assert "OverflowError" in err.message and f.errors == ["INTERNAL"]
    f._reply(b"engine", m.LookupReply(rid=6, hit_chunks=2))
    assert codec.decode_reply(f.sent[1][1]) == m.LookupReply(rid=6, hit_chunks=2)
