"""A stopped daemon (SIGSTOP: stuck in the kernel, swapped out, paused) never blocks a client's
send: requests queue in the stream socket's bounded outbox, a full outbox refuses the next one
at once (BACKPRESSURE), a daemon that takes no bytes for ``timeout_s`` has its connection given
up (requests still queued are reported never sent), and once it runs again the client is back."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvdepot.client import KVDepotClient
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError

CHUNKS = 1024  # one lookup of a 1024-chunk prompt: ~37 KB on the wire


def _lookup(i: int) -> m.Lookup:
    keys = [i.to_bytes(4, "little") + j.to_bytes(28, "little") for j in range(CHUNKS)]
    return m.Lookup(rid=0, keys=[keys], chunk_size=256, num_tokens=CHUNKS * 256, model="hung")


def test_sends_never_block_on_a_stopped_daemon(daemon):
    c = KVDepotClient(daemon.endpoint, timeout_s=1.0, retry_interval_s=0.2)
    c.hello()
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        sock = c.conn._socket()
        sock.outbox_max_bytes = 1 << 20
        worst_s, answers, refused = 0.0, {}, 0
        for i in range(60):  # ~2.2 MB: more than the socket buffer and the outbox hold
            t0 = time.monotonic()
            try:
                rid = c.submit(_lookup(i), on_reply=lambda r, i=i: answers.__setitem__(i, r))
            except KVDepotError as exc:
                assert exc.code is ErrorCode.BACKPRESSURE, exc
                refused += 1
            else:
                assert rid > 0
            worst_s = max(worst_s, time.monotonic() - t0)
        assert refused > 0, "the outbox is bounded"
        assert sock.outbox_bytes > 0 and not c.up
        assert worst_s < 0.05, f"submit blocked {worst_s:.3f} s on a stopped daemon"
        # nothing taken for timeout_s: the connection is given up, its requests reported lost
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end and c.conn.connected and sock is c.conn._sock:
            t0 = time.monotonic()
            c.poll()
            worst_s = max(worst_s, time.monotonic() - t0)
            time.sleep(0.01)
        assert worst_s < 0.05
        assert c.conn.requests_dropped > 0
        codes = {ErrorCode(r.code) for r in answers.values()}
        assert ErrorCode.BACKPRESSURE in codes, "the requests still queued were never sent"
        assert codes <= {ErrorCode.BACKPRESSURE, ErrorCode.TIMEOUT}
        assert not c.available()  # down: no request goes out until a ping is answered
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while not c.available():
        assert time.monotonic() < deadline, "the client never saw the daemon back"
        time.sleep(0.05)
    assert c.lookup([b"\0" * 32], 256) == 0
    c.close()


def test_a_connection_refused_by_a_full_backlog_is_backpressure(tmp_path):
    """A listener that never accepts (a stopped daemon) with a full backlog: connect fails at
    once (BACKPRESSURE), it does not hang."""
    import socket

    path = str(tmp_path / "kvd.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path + ".stream")
    srv.listen(0)
    open(path, "w").close()  # the ZMQ endpoint's file, as a daemon makes it
    held = []
    try:
        with pytest.raises(KVDepotError) as err:
            for _ in range(64):  # fill the backlog
                c = KVDepotClient(f"ipc://{path}", timeout_s=0.2, connect=False)
                held.append(c)
                t0 = time.monotonic()
                c.submit(m.Ping(rid=0))
                assert time.monotonic() - t0 < 0.05
        assert err.value.code is ErrorCode.BACKPRESSURE
    finally:
        for c in held:
            c.close()
        srv.close()
