"""The daemon's stream-socket framing (kvdepot.server.stream) under hypothesis: any split of a
byte stream into reads delivers exactly the whole frames, in order, after one identity; an
oversized length closes the connection with a MALFORMED error and delivers nothing after it;
arbitrary bytes never raise."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.protocol.codec import decode_reply
from kvdepot.protocol.errors import ErrorCode
from kvdepot.protocol.transport import FRAME_HEADER, MAX_FRAME_BYTES
from kvdepot.server.stream import StreamServer, _Connection


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0


def _feed(stream: bytes, cuts: list[int]):
    frames, attached, detached = [], [], []
    server = StreamServer(lambda ident, body: frames.append((ident, body)), attached.append, detached.append)
    conn = _Connection(server)
    t = _Transport()
    conn.connection_made(t)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    for a, b in zip(points, points[1:]):
        if t.closed:
            break
        conn.data_received(stream[a:b])
    conn.connection_lost(None)
    return frames, attached, detached, t


_identity = st.binary(min_size=1, max_size=255)
_bodies = st.lists(st.binary(max_size=300), max_size=12)
_cuts = st.lists(st.integers(0, 1 << 16), max_size=40)


@settings(max_examples=400, deadline=None)
@given(_identity, _bodies, _cuts)
def test_any_split_delivers_exactly_the_whole_frames_in_order(identity, bodies, cuts):
    stream = bytes([len(identity)]) + identity + b"".join(FRAME_HEADER.pack(len(b)) + b for b in bodies)
    frames, attached, detached, t = _feed(stream, cuts)
    assert frames == [(identity, b) for b in bodies]
    assert attached == [identity] and detached == [identity] and not t.written


@settings(max_examples=200, deadline=None)
@given(_identity, _bodies, st.integers(MAX_FRAME_BYTES + 1, 2**32 - 1), st.binary(max_size=64), _cuts)
def test_an_oversized_length_closes_with_malformed_and_nothing_after_it(identity, bodies, size, tail, cuts):
    stream = (bytes([len(identity)]) + identity + b"".join(FRAME_HEADER.pack(len(b)) + b for b in bodies)
              + FRAME_HEADER.pack(size) + tail)
    frames, _, _, t = _feed(stream, cuts)
    assert frames == [(identity, b) for b in bodies]
    assert t.closed and len(t.written) == 1
    (n,) = FRAME_HEADER.unpack_from(t.written[0])
    err = decode_reply(t.written[0][FRAME_HEADER.size:FRAME_HEADER.size + n])
    assert err.code == ErrorCode.MALFORMED


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048), _cuts)
def test_arbitrary_bytes_never_raise(stream, cuts):
    frames, attached, _, t = _feed(stream, cuts)
    if stream and stream[0] == 0:
        assert t.closed and not attached and not frames  # no identity: closed at once
    assert len(attached) <= 1
