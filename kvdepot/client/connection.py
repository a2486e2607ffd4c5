"""One connection to the kvdepot daemon (its stream socket, else a ZMQ DEALER): request ids,
``submit`` / ``wait`` / ``poll``, and the daemon's liveness. `kvdepot.client.KVDepotClient`
builds stores, retrieves and registrations on it; pending handles (`kvdepot.client.pending`)
read their replies through it.

Every call raises `KVDepotError` for an error reply (with its `ErrorCode`) and for a reply
that does not come within ``timeout_s`` (code TIMEOUT). After a timeout the socket is
rebuilt, so a late reply is never mistaken for the next request's.

It notices a daemon restart (the boot id in `Pong` / `RegisterReply` changes): ``generation``
counts them, and `KVDepotClient.reregister` registers again.

For engines whose step must never wait on the daemon (the vLLM connector), everything also
works without blocking: `submit` returns at once, `poll` collects the replies that arrived,
`done` says whether a request's reply is in, and `available` / `mark_down` keep a daemon that
stopped answering from being asked again before a ping (at most every ``retry_interval_s``)
says it is back. An ``ipc://`` daemon that is not running fails a call at once (UNAVAILABLE).

Threads: one thread at a time sends and reads replies (the vLLM worker's transfer thread, or
its engine thread while that one is not running); `on_own_thread` says whether the caller is
the one that last sent.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable

import msgspec
import msgspec.structs
import zmq

from kvdepot import trace
from kvdepot.client.pending import Drains, LinkPace, ScatterNote
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError
from kvdepot.protocol.transport import StreamSocket, connect_socket, default_endpoint

log = logging.getLogger("kvdepot.client")

# request numbers: each client of a process counts from its own base, so no two of them number
# requests alike (`kvdepot.trace` points carry only the number)
_CLIENTS = itertools.count()
_RIDS_PER_CLIENT = 1 << 32
# `Connection.poll` with no reply awaited looks at the socket this often (for a connection
# the daemon closed, and to read replies nobody waits for; a request sent on a closed connection
# connects afresh anyway, `submit`): a look cost an engine's step 12-14 us of cold-cache system
# call on the dev VM, and at every 10 ms it came in most steps of a real model
_IDLE_LOOK_S = 0.5
_UNREAD_KEPT = 64  # ... or once this many replies nobody waits for are due (bounds the backlog)
_NOBLOCK = int(zmq.NOBLOCK)

_PR_GET_TIMERSLACK = 30
_slack = threading.local()


def timer_slack_s() -> float:
    """This thread's timer slack in seconds (Linux ``prctl(PR_GET_TIMERSLACK)``): how late a
    timed sleep (``select``, ``poll``, ``nanosleep``) may wake. 50 us by default, which is most
    of a lone request's overhead budget, so a wait that naps ends its nap this much earlier.
    Elsewhere, or if it cannot be read: 50 us."""
    got = getattr(_slack, "s", None)
    if got is None:
        got = 50e-6
        if sys.platform.startswith("linux"):
            try:
                ns = ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
            except (OSError, AttributeError):
                ns = -1
            if ns >= 0:
                got = ns / 1e9
        _slack.s = got
    return got


class Connection:
    """The requests of one client and their replies (see the module docstring).

    Args:
        endpoint: daemon address (default `default_endpoint()`).
        timeout_s: per-request reply timeout.
        name: client name shown in daemon logs.
        spin_us: a wait polls for its reply without sleeping for this long first: a reply that
            comes within it (a retrieve's, an early store's) is seen without a wake-up of the
            waiting thread, which costs tens of microseconds on a VM. 0 = sleep at once.
        connect: say hello to the daemon now (raises if it does not answer); False: on first
            use, so a client can be made while the daemon is down.
        retry_interval_s: after `mark_down`, `available` pings the daemon at most this often.

    Besides the socket it holds what the pending handles of its requests share
    (`kvdepot.client.pending.RequestChannel`): the fastest replies seen (``store_pace``,
    ``retrieve_pace``), the Drains of lost staging regions (``drains``) and the last scatter
    (``last_scatter``).

    Raises:
        KVDepotError: with ``connect``: UNAVAILABLE (no daemon at an ``ipc://`` endpoint),
            TIMEOUT, VERSION_MISMATCH.
    """

    def __init__(self, endpoint: str | None = None, timeout_s: float = 10.0, name: str = "",
                 spin_us: float = 200.0, connect: bool = True, retry_interval_s: float = 1.0) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.timeout_s = timeout_s
        self.spin_s = max(0.0, spin_us) / 1e6
        self.name = name or f"pid{os.getpid()}"
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._rid = itertools.count(1 + next(_CLIENTS) * _RIDS_PER_CLIENT)
        self._outstanding: set[int] = set()  # submitted, reply not yet returned by wait()
        self._replies: dict[int, m.Msg] = {}  # replies that arrived before their wait()
        self._sinks: dict[int, Callable[[m.Msg], None]] = {}  # rid -> `submit`'s on_reply
        # (end offset in the stream, rid) of requests still (partly) in the stream socket's
        # outbox, oldest first: lost with the connection, these never reached the daemon
        self._queued: collections.deque[tuple[int, int]] = collections.deque()
        self.requests_dropped = 0  # requests given up with a connection the daemon took no bytes of
        self._identity = f"kvd-{os.getpid()}-{uuid.uuid4().hex[:12]}".encode()
        self.last_scatter = ScatterNote()  # `last_retrieve_event`
        self.drains = Drains()  # Drains that settle staging regions lost in a timeout
        self._submit_thread = threading.get_ident()
        # fastest staged store / retrieve seen: their waits sleep until shortly before such a
        # reply could come, then spin
        self.store_pace = LinkPace()
        self.retrieve_pace = LinkPace()
        self.boot_id: str | None = None
        self.generation = 0  # daemon boots seen after the first (a restart bumps it)
        self.retry_interval_s = retry_interval_s
        self.up = True  # False after mark_down(), until a ping is answered
        self._probe_rid: int | None = None
        self._next_probe_s = 0.0
        self._hello_rid: int | None = None  # the Hello sent on a (re)connected socket
        self._unread = 0  # requests sent on this socket whose reply has not been read yet
        self._idle_poll_at = 0.0  # time.monotonic() before which an idle `poll` does nothing
        self._wake_poller: tuple | None = None  # (socket, wake fd, zmq.Poller of both): `poll`'s
        self.replies_read = 0  # replies read so far (a change says `poll` brought something)
        # staged stores may end on their landed word (`Store.landed`, `PendingStore.result`).
        # Such stores' replies (after the daemon's commit) are still due: a later request other
        # than a store waits for them first (`_confirm_stores`), so this client's lookups see
        # its own stores
        self._unconfirmed: set[int] = set()
        self.stores_landed = 0  # stores whose result came from their landed word
        self._greeted = not connect  # greet every connection but the one hello() below greets
        if connect:
            try:
                self.hello()
            except BaseException:
                self.close()  # no caller can close a client whose constructor failed
                raise

    # ------------------------------------------------------------------ transport

    def _socket(self) -> zmq.Socket | StreamSocket:
        if self._sock is not None and self._sock.closed:  # a stream connection the daemon closed
            self._reset(ErrorCode.DISCONNECTED, "the daemon closed the connection")
        if self._sock is None:
            self._sock = connect_socket(self._ctx, self.endpoint, self._identity)
            if self._greeted:
                # the daemon ties pins and liveness to a connection's first Hello (our pid)
                hello = m.Hello(rid=next(self._rid), protocol_version=m.PROTOCOL_VERSION, client=self.name,
                                pid=os.getpid())
                self._sock.send(codec.encode(hello))
                self._hello_rid = hello.rid
                self._unread += 1
        return self._sock

    @property
    def drains_answered(self) -> int:
        """Drains that settled staging regions lost in a timeout (`kvdepot.client.pending.Drains`)."""
        return self.drains.answered

    @property
    def transport(self) -> str:
        """``"stream"`` (the daemon's Unix stream socket) or ``"zmq"``: what the next request uses."""
        return "stream" if isinstance(self._socket(), StreamSocket) else "zmq"

    def _reset(self, code: ErrorCode = ErrorCode.TIMEOUT, why: str = "an earlier wait timed out") -> None:
        """Drop the socket; every outstanding request is lost, and its wait or ``done()`` says so
        (``code``): a late reply on a new socket is never taken for another request."""
        was_stream = isinstance(self._sock, StreamSocket)
        unsent: set[int] = set()
        if self._sock is not None:
            if self._queued:
                taken = self._sock.bytes_queued - self._sock.outbox_bytes
                unsent = {rid for end, rid in self._queued if end > taken}
                self._queued.clear()
            self._sock.close(0)
            self._sock = None
            self._wake_poller = None
        self._outstanding -= self._unconfirmed  # done for their callers: nobody waits for these
        self._unconfirmed.clear()
        lost = [rid for rid in self._outstanding if rid not in self._replies]
        for rid in lost:
            if rid in unsent:  # never reached the daemon: nothing of it runs there
                self._replies[rid] = m.ErrorReply(rid=rid, code=int(ErrorCode.BACKPRESSURE),
                                                  message=f"request {rid} was never sent: {why}")
            else:
                self._replies[rid] = m.ErrorReply(rid=rid, code=int(code), message=f"request {rid} was lost: {why}")
        self._outstanding.clear()
        for rid in lost:
            if rid in self._sinks:
                self._deliver(self._replies.pop(rid))
        self._hello_rid = self._probe_rid = None
        self._unread = 0
        if was_stream and code is ErrorCode.TIMEOUT and self._greeted:
            # connect again now: the daemon reclaims what a stream connection registered and
            # pinned shortly after it closed without a reconnect (kvdepot.server.liveness), and a
            # slow daemon must not take this live engine for a dead one
            try:
                self._socket()
            except (KVDepotError, OSError, zmq.ZMQError):
                pass  # gone: the next request reports it

    def _on_reply(self, got: m.Msg) -> m.Msg | None:
        """Book one arrived reply: boot ids, the Hello / ping of a reconnect; returns it if it
        answers an outstanding request (kept for its wait), else None."""
        self._unread -= 1
        self.replies_read += 1
        trace.point(got.rid, "c_reply")
        boot = getattr(got, "boot_id", None)
        if isinstance(boot, str) and boot:
            if self.boot_id is not None and boot != self.boot_id:
                self.generation += 1
            self.boot_id = boot
        if got.rid == self._probe_rid:
            self._probe_rid = None
            if not isinstance(got, m.ErrorReply):
                self.up = True
            return None
        if got.rid == self._hello_rid:
            self._hello_rid = None
            return None
        if got.rid in self._unconfirmed:  # a store that ended on its landed word: committed now
            self._unconfirmed.discard(got.rid)
            self._outstanding.discard(got.rid)
            if isinstance(got, m.ErrorReply):
                log.warning("a store that ended on its landed word was then refused (%s): %s",
                            ErrorCode(got.code).name, got.message)
            return None
        if got.rid in self._outstanding:
            if self._sinks and got.rid in self._sinks:
                self._outstanding.discard(got.rid)
                self._deliver(got)
                return got
            self._replies[got.rid] = got  # first: done() never sees it in neither
            self._outstanding.discard(got.rid)
            return got
        return None  # a late reply to a request lost in a timeout

    def _deliver(self, reply: m.Msg) -> None:
        """Hand ``reply`` (an answer or an `m.ErrorReply`) to its request's ``on_reply``; a
        raising callback is logged, never lets a read of replies fail."""
        sink = self._sinks.pop(reply.rid)
        try:
            sink(reply)
        except Exception:  # noqa: BLE001 - the caller's code; the client's state stays consistent
            log.exception("on_reply of request %d raised", reply.rid)

    def confirm_later(self, rid: int) -> None:
        """Store ``rid`` ended on its landed word (`PendingStore.result`): its reply, still due,
        is read by whatever reads replies next and dropped; the next request other than a store
        waits for it first (`_confirm_stores`)."""
        self._unconfirmed.add(rid)
        self.stores_landed += 1

    def _confirm_stores(self) -> None:
        """Wait for the replies of stores that ended on their landed word (`_unconfirmed`):
        they follow the daemon's commit, after which its lookups see the chunks. Usually in
        already, or tens of microseconds away; gives up after the client's timeout."""
        deadline = time.monotonic() + self.timeout_s
        while self._unconfirmed:
            left = deadline - time.monotonic()
            if left <= 0 or self._sock is None:
                log.warning("%d stores that ended on their landed word were not confirmed within %.1f s",
                            len(self._unconfirmed), self.timeout_s)
                self._outstanding -= self._unconfirmed
                self._unconfirmed.clear()
                return
            self.poll(min(left, 1e-3))

    def poll(self, timeout_s: float = 0.0, wake_fd: int | None = None) -> None:
        """Collect every reply that has arrived (waiting at most ``timeout_s`` for the first,
        or until file descriptor ``wake_fd`` is readable: another thread's way to cut the wait
        short; it is not read here); never raises: a connection the daemon closed loses its outstanding requests
        (DISCONNECTED, see `PendingStore.done`). While every reply has been read it looks at
        the socket (for a connection the daemon closed) at most every `_IDLE_LOOK_S`: an
        engine's step calls it several times, and each look is a system call. The same holds
        while the only replies due are ones nobody waits for (`forget`: a scheduler's
        `EndRequest` per finished request; a probe's ping and a reconnect's Hello excepted):
        they are read in that rhythm, or once `_UNREAD_KEPT` of them are due, not by every
        step that polls."""
        sock = self._sock
        if sock is None or (self._queued and self._outbox_stalled(sock)):
            return
        if timeout_s <= 0 and (self._unread <= 0 or not (self._outstanding or self._probe_rid is not None
                                                          or self._hello_rid is not None)):
            now = time.monotonic()
            if now < self._idle_poll_at and self._unread < _UNREAD_KEPT:
                return
            self._idle_poll_at = now + _IDLE_LOOK_S
        ms = max(0, int(timeout_s * 1000))
        try:
            if wake_fd is not None and ms:
                if not sock.poll(0):  # (a stream socket may hold a whole reply read before)
                    poller = self._wake_poller
                    if poller is None or poller[0] is not sock or poller[1] != wake_fd:
                        both = zmq.Poller()  # a stream socket is watched by its file descriptor
                        both.register(sock, zmq.POLLIN)
                        both.register(wake_fd, zmq.POLLIN)
                        poller = self._wake_poller = (sock, wake_fd, both)
                    ready = dict(poller[2].poll(ms))  # (a stream socket comes back as its fd)
                    if len(ready) == (wake_fd in ready):
                        return  # woken, or the time is up
                ms = 0
            while sock.poll(ms):
                ms = 0
                self._on_reply(codec.decode_reply(sock.recv()))
        except zmq.ZMQError as exc:
            self._reset(ErrorCode.DISCONNECTED, str(exc))
        except (msgspec.DecodeError, UnicodeDecodeError):
            self._reset(ErrorCode.MALFORMED, "undecodable reply")

    def _outbox_stalled(self, sock: StreamSocket) -> bool:
        """Flush the stream socket's outbox; True (the connection given up, its requests lost:
        those still queued as BACKPRESSURE, the others TIMEOUT; the daemon marked down) once the
        daemon has taken none of it for ``timeout_s``."""
        try:
            left = sock.flush()
        except zmq.ZMQError as exc:
            self._reset(ErrorCode.DISCONNECTED, str(exc))
            return True
        queued = self._queued
        taken = sock.bytes_queued - left
        while queued and queued[0][0] <= taken:
            queued.popleft()
        if not left or time.monotonic() - sock.outbox_since_s <= self.timeout_s:
            return False
        self.requests_dropped += max(self._unread, 0)
        log.warning("kvdepot: the daemon at %s took none of %d queued bytes for %.1f s; dropping the connection "
                    "and %d requests", self.endpoint, left, self.timeout_s, max(self._unread, 0))
        self._reset(ErrorCode.TIMEOUT, f"the daemon took no bytes for {self.timeout_s} s")
        self.mark_down()
        return True

    def on_own_thread(self) -> bool:
        """Whether the caller runs on the thread that last sent on this client (its socket's user)."""
        return threading.get_ident() == self._submit_thread

    @property
    def awaiting_replies(self) -> bool:
        """Whether a request sent on the open connection has not been answered yet (`poll`
        with a timeout then returns at the first reply)."""
        return self._unread > 0

    def done(self, rid: int) -> bool:
        """Whether `wait` of ``rid`` returns at once (its reply, error or loss is in); after `poll`."""
        return rid in self._replies or rid not in self._outstanding

    @property
    def connected(self) -> bool:
        """Whether a connection is open (False before the first request and after the daemon
        closed it: the next request connects afresh, and may reach a restarted daemon)."""
        return self._sock is not None and not self._sock.closed

    def forget(self, rid: int) -> None:
        """Stop tracking ``rid`` (nobody will wait for it, its ``on_reply`` is not called); a
        late reply is dropped."""
        self._outstanding.discard(rid)
        self._replies.pop(rid, None)
        self._sinks.pop(rid, None)

    def mark_down(self) -> None:
        """The daemon does not answer: `available` is False until a ping is answered."""
        if self.up:
            self.up = False
            self._next_probe_s = 0.0

    def available(self) -> bool:
        """Never blocks: True while the daemon is considered up; while down, sends a ping at
        most every ``retry_interval_s`` and turns True when one is answered. While up it reads
        no socket: a scheduler asks this once per new request, and replies are read where
        someone waits for one (`poll`, `wait`)."""
        if self.up:
            return True
        self.poll()
        if self.up:
            return True
        now = time.monotonic()
        if now < self._next_probe_s:
            return False
        self._next_probe_s = now + self.retry_interval_s
        if self._probe_rid is not None:
            self._reset(ErrorCode.TIMEOUT, "the daemon did not answer a ping")  # start over on a new connection
        try:
            self._probe_rid = self.submit(m.Ping(rid=0))
            self._outstanding.discard(self._probe_rid)  # booked by _on_reply, never waited for
        except (KVDepotError, zmq.ZMQError, OSError):
            self._probe_rid = None
        return False

    def call(self, req: m.Msg, timeout_s: float | None = None) -> m.Msg:
        """Send one request (its ``rid`` is assigned here) and return its reply.

        Raises:
            KVDepotError: error reply, or TIMEOUT.
        """
        return self.wait(self.submit(req), timeout_s)

    def submit(self, req: m.Msg, on_reply: Callable[[m.Msg], None] | None = None) -> int:
        """Send ``req`` without waiting (its ``rid`` is assigned here); returns the rid to give
        `wait`. Several requests may be outstanding; the daemon answers each in turn.

        ``on_reply``: called with the reply (or the `m.ErrorReply` of a refusal or of the
        request's loss: DISCONNECTED, TIMEOUT) by whichever call reads it (`poll`, `wait` of
        another request), once, on the thread that reads replies; the request is then done and
        never given to `wait` (the vLLM scheduler side's lookups: each answer is
        booked on its request as it is read, in one pass over every reply that came).
        `forget` cancels it.

        Never blocks: what the socket does not take waits in its outbox (`StreamSocket`).

        Raises:
            KVDepotError: MALFORMED (the message exceeds the frame limit); UNAVAILABLE (no
                daemon at an ``ipc://`` endpoint); BACKPRESSURE (the daemon took none of what
                was queued before and the outbox is full, or it accepts no connections: the
                request was not sent, and the daemon is marked down)."""
        if self._unconfirmed and not isinstance(req, m.Store):
            self._confirm_stores()
        req.rid = next(self._rid)
        self._submit_thread = threading.get_ident()
        frame = codec.encode(req)
        if len(frame) > codec.MAX_FRAME_BYTES:
            raise KVDepotError(ErrorCode.MALFORMED, f"{type(req).__name__} of {len(frame)} bytes exceeds the "
                                                    f"{codec.MAX_FRAME_BYTES}-byte message limit")
        try:
            try:
                sock = self._socket()
                sock.send(frame, _NOBLOCK)
            except zmq.Again:
                raise
            except zmq.ZMQError:
                # the daemon closed our stream connection (it restarted) before this request: nothing
                # of it was delivered, and requests still outstanding are lost with the connection
                self._reset(ErrorCode.DISCONNECTED, "the daemon closed the connection")
                sock = self._socket()
                sock.send(frame, _NOBLOCK)
        except zmq.Again as exc:  # the outbox is full (or a DEALER's queue at its high-water mark)
            self.mark_down()
            raise KVDepotError(ErrorCode.BACKPRESSURE, f"{type(req).__name__} not sent to {self.endpoint}: "
                                                       f"{exc or 'its send queue is full'}") from None
        except KVDepotError as exc:
            if exc.code is ErrorCode.BACKPRESSURE:
                self.mark_down()
            raise
        if type(sock) is StreamSocket and sock.outbox_bytes:
            self._queued.append((sock.bytes_queued, req.rid))
        self._unread += 1
        self._outstanding.add(req.rid)
        if on_reply is not None:
            self._sinks[req.rid] = on_reply
        trace.point(req.rid, "c_sent")
        return req.rid

    def wait(self, rid: int, timeout_s: float | None = None, spin_from: float = 0.0,
             until: Callable[[], bool] | None = None) -> m.Msg | None:
        """The reply to the submitted request ``rid`` (replies to other outstanding requests that
        arrive first are kept for their own `wait`). ``spin_from`` (``time.monotonic()`` seconds):
        the reply is not expected before then, so the wait sleeps until then (a reply that comes
        earlier still wakes it) and spins for ``spin_us`` from there instead of from now.
        ``until``: also checked while spinning (and every millisecond after): once it returns
        True the wait returns None, leaving ``rid`` outstanding (a gated retrieve's landed word,
        `PendingRetrieve.result`).

        Raises:
            KVDepotError: the error reply; TIMEOUT if no reply came within ``timeout_s`` (default
                the client's), after which every outstanding request of this client is lost
                (the socket is rebuilt so that a late reply is never taken for a new request).
        """
        reply = self._replies.pop(rid, None)
        if reply is None:
            if rid not in self._outstanding:
                raise KVDepotError(ErrorCode.TIMEOUT, f"request {rid} is not outstanding (its reply was taken)")
            sock = self._socket()
            now = time.monotonic()
            deadline = now + (self.timeout_s if timeout_s is None else timeout_s)
            spin_until = max(now, spin_from) + self.spin_s
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                try:
                    ready = False
                    if spin_from > now:
                        # a nap may end up to the thread's timer slack late (50 us by default)
                        nap_s = max(0.0, min(spin_from - timer_slack_s(), deadline) - now)
                        if isinstance(sock, StreamSocket):
                            ready = sock.poll_s(nap_s)
                        else:  # ZMQ polls in whole milliseconds: sleep no longer than asked
                            ready = sock.poll(int(nap_s * 1000))
                        now = spin_from  # once: the spin follows
                    while not ready and time.monotonic() < spin_until:
                        if until is not None and until():
                            return None
                        ready = sock.poll(0)
                    if until is not None:  # a word in memory wakes nobody: look every millisecond
                        while not ready and time.monotonic() < deadline:
                            if until():
                                return None
                            ready = sock.poll(1)
                    ready = ready or (left_ms > 0 and sock.poll(left_ms))
                    frame = sock.recv() if ready else None
                except zmq.ZMQError as exc:  # the stream connection closed under the request
                    self._reset(ErrorCode.DISCONNECTED, str(exc))
                    reply = self._replies.pop(rid)
                    break
                if frame is None:
                    self._outstanding.discard(rid)
                    self._reset()
                    raise KVDepotError(ErrorCode.TIMEOUT, f"no reply from {self.endpoint} within "
                                                          f"{self.timeout_s if timeout_s is None else timeout_s} s; "
                                                          "is `kvdepot serve` running?")
                got = self._on_reply(codec.decode_reply(frame))
                if got is not None and got.rid == rid:
                    reply = self._replies.pop(rid)
                    break
        self._outstanding.discard(rid)
        if isinstance(reply, m.ErrorReply):
            raise KVDepotError(reply.code, reply.message)
        return reply

    def close(self) -> None:
        self._reset(ErrorCode.DISCONNECTED, "the client was closed")
        self._replies.clear()
        self._sinks.clear()
        self._ctx.term()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def hello(self) -> m.HelloReply:
        r = self.call(m.Hello(rid=0, protocol_version=m.PROTOCOL_VERSION, client=self.name, pid=os.getpid()))
        self.boot_id = r.boot_id
        self._greeted = True
        return r

    def ping(self) -> str:
        """The daemon's boot id (a new one means the daemon restarted)."""
        return self.call(m.Ping(rid=0)).boot_id
