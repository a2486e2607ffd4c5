"""The daemon's stream socket (``PATH.stream`` beside ``ipc://PATH``): clients use it by
default, its framing survives split and batched writes, bad input gets typed errors or a
closed connection (never a crashed daemon), and clients reconnect across a daemon restart.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time

import pytest

from conftest import start_daemon
from kvdepot.client import KVDepotClient
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError
from kvdepot.protocol.transport import ENV_TRANSPORT, MAX_FRAME_BYTES, StreamSocket, stream_path

_HDR = struct.Struct("<I")


def _raw(endpoint: str, identity: bytes = b"raw-test") -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(stream_path(endpoint))
    if identity is not None:
        s.sendall(bytes([len(identity)]) + identity)
    return s


def _read_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise ConnectionError("closed")
        out += got
    return out


def _read_reply(s: socket.socket) -> m.Msg:
    (n,) = _HDR.unpack(_read_exact(s, 4))
    return codec.decode_reply(_read_exact(s, n))


def _frame(msg: m.Msg) -> bytes:
    body = codec.encode(msg)
    return _HDR.pack(len(body)) + body


def test_clients_use_the_stream_socket(module_daemon):
    path = stream_path(module_daemon.endpoint)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, "only the daemon's user may connect"
    with KVDepotClient(module_daemon.endpoint) as c:
        assert c.conn.transport == "stream"
        boot = c.ping()
        # requests still go over ZMQ when asked (or when no stream socket exists)
    os.environ[ENV_TRANSPORT] = "zmq"
    try:
        with KVDepotClient(module_daemon.endpoint) as z:
            assert z.conn.transport == "zmq" and z.ping() == boot
    finally:
        del os.environ[ENV_TRANSPORT]


def test_split_and_batched_messages_are_framed_right(module_daemon):
    s = _raw(module_daemon.endpoint)
    try:
        # three requests in one write, then one written a byte at a time
        s.sendall(_frame(m.Ping(rid=1)) + _frame(m.Ping(rid=2)) + _frame(m.Ping(rid=3)))
        for b in _frame(m.Ping(rid=4)):
            s.sendall(bytes([b]))
            time.sleep(0.001)
        assert [_read_reply(s).rid for _ in range(4)] == [1, 2, 3, 4]
    finally:
        s.close()


def test_identity_sent_in_pieces(module_daemon):
    s = _raw(module_daemon.endpoint, identity=None)
    try:
        ident = b"split-identity"
        s.sendall(bytes([len(ident)]))
        time.sleep(0.01)
        s.sendall(ident[:5])
        time.sleep(0.01)
        s.sendall(ident[5:] + _frame(m.Ping(rid=7)))
        r = _read_reply(s)
        assert isinstance(r, m.Pong) and r.rid == 7
    finally:
        s.close()


def test_bad_stream_input_gets_an_error_or_a_closed_connection(module_daemon):
    s = _raw(module_daemon.endpoint)
    try:
        body = b"\xc1\xff not msgpack"
        s.sendall(_HDR.pack(len(body)) + body)
        r = _read_reply(s)
        assert isinstance(r, m.ErrorReply) and r.code == ErrorCode.MALFORMED
        s.sendall(_frame(m.Ping(rid=8)))  # the connection keeps working
        assert _read_reply(s).rid == 8
        # a length past the limit cannot be skipped: a typed error, then the connection closes
        s.sendall(_HDR.pack(MAX_FRAME_BYTES + 1))
        r = _read_reply(s)
        assert isinstance(r, m.ErrorReply) and r.code == ErrorCode.MALFORMED and "exceeds" in r.message
        assert s.recv(16) == b""
    finally:
        s.close()
    s = _raw(module_daemon.endpoint, identity=None)
    try:
        s.sendall(b"\x00")  # an empty identity
        assert s.recv(16) == b""
    finally:
        s.close()
    # a client that vanishes mid-message costs nothing
    s = _raw(module_daemon.endpoint)
    s.sendall(_HDR.pack(100) + b"\x92")
    s.close()
    with KVDepotClient(module_daemon.endpoint) as c:
        assert c.ping()
    assert module_daemon.alive


def test_client_reconnects_to_a_restarted_daemon(tmp_path):
    d = start_daemon(tmp_path / "d")
    try:
        c = KVDepotClient(d.endpoint, timeout_s=10)
        boot1 = c.ping()
        assert c.conn.transport == "stream"
    finally:
        d.stop()
    d = start_daemon(tmp_path / "d")  # same endpoint, new boot
    try:
        # the first send notices the closed connection and goes out on a new one
        boot2 = c.ping()
        assert boot2 != boot1 and c.conn.transport == "stream"
        c.close()
    finally:
        d.stop()
    assert not os.path.exists(stream_path(d.endpoint)), "the daemon left its stream socket behind"


def test_connection_closed_during_a_wait_is_a_typed_error(tmp_path):
    """A daemon that closes the connection while a request waits: DISCONNECTED at once, not
    a timeout; the client connects afresh for the next request."""
    path = str(tmp_path / "fake.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".stream")
    listener.listen(4)

    def serve() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                (k,) = _read_exact(conn, 1)
                _read_exact(conn, k)
                while True:  # answer Hellos (a reconnected client greets first); hang up at anything else
                    (n,) = _HDR.unpack(_read_exact(conn, 4))
                    req = codec.decode_request(_read_exact(conn, n))
                    if not isinstance(req, m.Hello):
                        break
                    conn.sendall(_frame(m.HelloReply(rid=req.rid, protocol_version=m.PROTOCOL_VERSION,
                                                     boot_id="fake", version="0")))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        c = KVDepotClient(f"ipc://{path}", timeout_s=30)
        assert c.conn.transport == "stream"
        t0 = time.monotonic()
        with pytest.raises(KVDepotError) as ei:
            c.ping()
        assert ei.value.code is ErrorCode.DISCONNECTED and time.monotonic() - t0 < 10
        c.hello()  # a new connection (the fake answers its hello)
        with pytest.raises(KVDepotError) as ei:
            c.ping()
        assert ei.value.code is ErrorCode.DISCONNECTED
        c.close()
    finally:
        listener.close()
        t.join(10)


def test_stream_socket_refuses_bad_identities(tmp_path):
    with pytest.raises(ValueError):
        StreamSocket(str(tmp_path / "x"), b"")
    with pytest.raises(OSError):
        StreamSocket(str(tmp_path / "missing.stream"), b"id")


def test_wait_sleeping_until_spin_from_still_takes_an_early_reply(module_daemon):
    """A wait told the reply is not due for 2 s (``spin_from``) returns as soon as it comes."""
    with KVDepotClient(module_daemon.endpoint, spin_us=200) as c:
        for _ in range(3):
            t0 = time.monotonic()
            rid = c.submit(m.Ping(rid=0))
            reply = c.wait(rid, timeout_s=5, spin_from=t0 + 2.0)
            assert isinstance(reply, m.Pong) and reply.rid == rid
            assert time.monotonic() - t0 < 1.0, "the wait slept to spin_from although the reply had come"


def test_stream_socket_poll_s_times_out_below_a_millisecond(module_daemon):
    """``poll_s`` sleeps for sub-millisecond timeouts (``poll(2)`` would round them up to 1 ms)
    and reports a message that is already there at once."""
    s = StreamSocket(stream_path(module_daemon.endpoint), b"poll-s-test")
    try:
        waits = []
        for _ in range(20):
            t0 = time.monotonic()
            assert s.poll_s(200e-6) == 0
            waits.append(time.monotonic() - t0)
        assert min(waits) >= 200e-6
        assert min(waits) < 1e-3, "poll_s rounded a 200 us timeout up to a millisecond"
        s.send(codec.encode(m.Hello(rid=7, protocol_version=m.PROTOCOL_VERSION, client="t", pid=os.getpid())))
        assert s.poll_s(5.0)
        assert codec.decode_reply(s.recv()).rid == 7
    finally:
        s.close()


@pytest.mark.parametrize("transport", ["stream", "zmq"])
def test_a_poll_waiting_for_a_reply_returns_when_its_wake_fd_is_signalled(daemon, monkeypatch, transport):
    """``poll(timeout_s, wake_fd)`` waits for the first reply or for ``wake_fd`` (how the vLLM
    worker's transfer thread sees a command posted while replies are due): with the daemon
    stopped (SIGSTOP) no reply can come, yet a poll of 30 s returns once another thread signals
    the eventfd; without a signal it waits for its timeout; the reply, once it comes, ends a
    wait and is read by it."""
    import signal

    if transport == "zmq":
        monkeypatch.setenv(ENV_TRANSPORT, "zmq")
    wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    with KVDepotClient(daemon.endpoint) as c:
        assert c.conn.transport == transport
        c.ping()
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            rid = c.submit(m.Ping(rid=0))
            t0 = time.monotonic()
            c.poll(0.05, wake)  # nothing signals it: the whole timeout
            assert time.monotonic() - t0 >= 0.05 and c.conn.awaiting_replies
            threading.Timer(0.1, os.eventfd_write, (wake, 1)).start()
            t0 = time.monotonic()
            c.poll(30.0, wake)
            assert time.monotonic() - t0 < 20.0, "the signalled eventfd did not end the poll"
            assert c.conn.awaiting_replies and not c.done(rid)
            assert os.eventfd_read(wake) == 1  # left for its owner to read
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        c.poll(10.0, wake)  # the reply ends this wait, and is read by it
        assert c.done(rid) and not c.conn.awaiting_replies
        assert isinstance(c.wait(rid, timeout_s=1), m.Pong)
    os.close(wake)


def test_an_idle_poll_reads_replies_nobody_waits_for_in_its_rhythm(module_daemon, monkeypatch):
    """With no reply awaited, `Connection.poll` looks at the socket only every
    ``_IDLE_LOOK_S`` (each look is a system call in an engine's step), unless ``_UNREAD_KEPT``
    replies nobody waits for (`forget`: a scheduler's EndRequests) are due; a reply someone
    waits for is read by the next poll, rhythm or not."""
    import kvdepot.client.connection as client_mod

    monkeypatch.setattr(client_mod, "_IDLE_LOOK_S", 3600.0)
    monkeypatch.setattr(client_mod, "_UNREAD_KEPT", 4)

    def forgotten(c: KVDepotClient, n: int) -> None:
        for _ in range(n):
            c.forget(c.submit(m.Ping(rid=0)))
        time.sleep(0.5)  # their replies are in the socket by now

    with KVDepotClient(module_daemon.endpoint) as c:
        c.ping()
        forgotten(c, 2)
        c.poll()  # the first look (none before): both read
        read = c.conn.replies_read
        assert not c.conn.awaiting_replies
        forgotten(c, 3)
        c.poll()
        assert c.conn.replies_read == read, "an idle poll within the rhythm made a system call"
        forgotten(c, 1)  # 4 due now
        c.poll()
        assert c.conn.replies_read == read + 4 and not c.conn.awaiting_replies
        rid = c.submit(m.Ping(rid=0))  # awaited: read by the next poll
        time.sleep(0.5)
        c.poll()
        assert c.done(rid) and isinstance(c.wait(rid, timeout_s=0), m.Pong)


def test_on_reply_gets_each_reply_once_as_it_is_read_errors_and_losses_too(module_daemon):
    """`Connection.submit`'s ``on_reply`` (how the vLLM scheduler side books lookup answers):
    not called while the reply is due, called once by the read that brings it (the request is
    then done: `wait` refuses it); an error reply and a request lost with its connection
    arrive as `m.ErrorReply`; `forget` cancels it; a callback that raises does not stop the
    read of the other replies."""
    import signal

    got: list[m.Msg] = []
    with KVDepotClient(module_daemon.endpoint) as c:
        c.ping()
        os.kill(module_daemon.proc.pid, signal.SIGSTOP)
        try:
            rid = c.submit(m.Ping(rid=0), got.append)
            c.poll()
            assert got == [] and not c.done(rid)  # due: no reply can come from a stopped daemon
        finally:
            os.kill(module_daemon.proc.pid, signal.SIGCONT)
        c.poll(10.0)
        assert len(got) == 1 and isinstance(got[0], m.Pong) and got[0].rid == rid
        with pytest.raises(KVDepotError) as taken:
            c.wait(rid, timeout_s=0)  # answered through on_reply only
        assert taken.value.code == ErrorCode.TIMEOUT
        c.poll()
        assert len(got) == 1, "delivered twice"

        def boom(reply):
            raise RuntimeError("a broken callback")

        bad = c.submit(m.Unregister(rid=0, registration="no-such-registration"), got.append)
        broken = c.submit(m.Ping(rid=0), boom)
        after = c.submit(m.Ping(rid=0), got.append)
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            c.poll(0.1)
        assert [type(x) for x in got[1:]] == [m.ErrorReply, m.Pong] and got[2].rid == after
        assert got[1].rid == bad and got[1].code != ErrorCode.TIMEOUT  # the daemon's own error
        assert c.done(broken)
        forgotten = c.submit(m.Ping(rid=0), got.append)
        c.forget(forgotten)
        lost = c.submit(m.Ping(rid=0), got.append)
        c.conn._reset(ErrorCode.DISCONNECTED, "the test closed the connection")
        c.poll(0.2)
        assert len(got) == 4 and got[3].rid == lost and got[3].code == ErrorCode.DISCONNECTED
