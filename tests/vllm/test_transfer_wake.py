"""The vLLM worker's transfer thread waits for the daemon's replies in `Connection.poll`; a
load (or a preemption, or stop) posted meanwhile ends that wait through an eventfd (`Wake`), so
it is taken at once instead of after the next reply or the wait's end. Saves and releases do
not signal (the engine thread's store steps skip the write). The poll itself is tested against
a stopped daemon in tests/integration/test_stream_transport.py."""

from __future__ import annotations

import os
import select
import threading
import time
import types

import pytest

pytest.importorskip("vllm")

import vllm_harness  # noqa: E402,F401 - imports vLLM the way every test here does (stubs, warnings)
from kvdepot.client.vllm import commands as cmds  # noqa: E402
from kvdepot.client.vllm import mover as mover_mod  # noqa: E402
from kvdepot.client.vllm.mover import TransferThread  # noqa: E402
from kvdepot.client.vllm.pieces import Wake  # noqa: E402


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_wake_signals_only_a_waiting_thread_and_drain_resets_it():
    w = Wake()
    try:
        w.signal()  # nobody waits: no write
        assert not _readable(w.fd)
        w.waiting = True
        w.signal()
        assert _readable(w.fd)
        w.waiting = False
        w.drain()
        assert not _readable(w.fd)
        w.drain()  # nothing signalled since: no read, nothing raised
    finally:
        w.close()


def test_a_wake_dropped_unclosed_closes_its_eventfd_and_close_is_idempotent():
    import gc

    w = Wake()
    fd = w.fd
    assert os.fstat(fd)
    del w
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed with the object (a fd number reused meanwhile would be a flake: none is made here)
    w = Wake()
    w.close()
    w.close()


class _Client:
    """Replies are due and none comes: `poll` waits on the wake fd alone."""

    awaiting_replies = True

    def __init__(self) -> None:
        self.polls = 0
        self.conn = self  # (the connection's state and calls are the client's here)

    def poll(self, timeout_s: float = 0.0, wake_fd: int | None = None) -> None:
        self.polls += 1
        select.select([wake_fd] if wake_fd is not None else [], [], [], timeout_s)


def test_a_posted_load_ends_the_threads_wait_for_replies_a_save_does_not(monkeypatch):
    monkeypatch.setattr(mover_mod, "_REPLY_POLL_S", 30.0)
    side = types.SimpleNamespace(cfg=types.SimpleNamespace(), client=_Client(), stats={}, registrar=types.SimpleNamespace())
    mv = TransferThread(side)
    mv.book.ops = [object()]  # a transfer in flight: `_wait` waits for its reply
    got = []
    waiter = threading.Thread(target=lambda: got.append(mv._wait()))
    try:
        waiter.start()
        deadline = time.monotonic() + 10.0
        while not mv._wake.waiting and time.monotonic() < deadline:
            time.sleep(0.001)
        assert mv._wake.waiting
        mv.post(cmds.SaveAfterEvent([], None, None))  # no signal: the wait goes on
        waiter.join(0.3)
        assert waiter.is_alive() and not got
        mv.post(cmds.Load([], 0, None))
        waiter.join(20.0)
        assert not waiter.is_alive(), "a posted load did not end the wait for replies"
        assert type(got[0]) is cmds.SaveAfterEvent and type(mv._next()) is cmds.Load  # taken in the order posted
        # the signal was reset, or its count is left for the next drain: `Wake.signal` writes,
        # then sets the flag, so a thread woken in between drains nothing this time (its next
        # wait ends at once and drains). Never a count without the flag (every wait would end
        # at once, for ever)
        assert side.client.polls == 1 and (not _readable(mv._wake.fd) or mv._wake._signalled)
        mv._wake.drain()
        assert not _readable(mv._wake.fd)
    finally:
        mv._wake.waiting = True
        mv._wake.signal()
        waiter.join(5.0)
        mv._wake.close()
