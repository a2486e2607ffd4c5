"""A non-blocking channel to the daemon for the vLLM connector.

`kvdepot.client.KVDepotClient` is blocking (one request at a time, hello in its constructor)
and rebuilds its socket on a timeout, dropping late replies. The scheduler must never wait on
the daemon and the worker must know whether a timed-out store or retrieve is still running in
the daemon, so the connector has its own channel on the same wire protocol
(`kvdepot.protocol.codec`, `kvdepot.protocol.transport.connect_socket`: the daemon's stream
socket when it has one, else a ZMQ DEALER):

* `send` queues a request and returns its request id at once; `poll` collects whatever replies
  have arrived; `take` hands one over. Several requests may be outstanding.
* `call` is send + wait, bounded by a timeout. A timeout marks the daemon *down*.
* While down, nothing is sent except a ping every ``retry_interval_s`` (`probe`); the first
  answer marks it up again. A changed boot id (the daemon restarted) bumps `boot_generation`,
  which tells the owner to re-register and that requests sent to the old daemon are dead.
* The DEALER socket keeps one routing id for the channel's life. After a timeout it is rebuilt
  (dropping requests still queued locally, e.g. while the daemon is down, so a restarted daemon
  never executes a stale store or retrieve); a late reply of the old daemon process still
  reaches the new socket (ROUTER_HANDOVER), so `take` can see it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
import uuid

import msgspec
import zmq

from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError
from kvdepot.protocol.transport import StreamSocket, connect_socket

log = logging.getLogger("kvdepot.vllm")


@dataclasses.dataclass(slots=True)
class _Sent:
    kind: str  # message type name (for logs)
    sent_at: float  # time.monotonic() of the send
    generation: int  # boot_generation when sent


class DaemonChannel:
    """Non-blocking request/reply channel to one daemon endpoint.

    Args:
        endpoint: ``ipc://PATH`` or ``tcp://HOST:PORT``.
        name: shown in the daemon's log (Hello.client).
        retry_interval_s: while down, a ping is sent at most this often.
    """

    def __init__(self, endpoint: str, name: str, retry_interval_s: float = 1.0) -> None:
        self.endpoint = endpoint
        self.name = name
        self.retry_interval_s = retry_interval_s
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | StreamSocket | None = None
        self._identity = f"kvd-vllm-{os.getpid()}-{uuid.uuid4().hex[:12]}".encode()
        self._rids = itertools.count(1)
        self._sent: dict[int, _Sent] = {}  # rid -> request still waiting for its reply
        self._replies: dict[int, m.Msg] = {}  # rid -> reply not yet taken
        self._lock = threading.RLock()  # vLLM may call a connector from more than one thread
        self.boot_id: str | None = None  # boot id of the daemon last heard from
        self.boot_generation = 0  # bumped on every boot id change after the first
        self.up = True  # optimistic until a timeout or a send failure says otherwise
        self._probe_rid: int | None = None
        self._next_probe = 0.0
        self._hello_rid: int | None = None
        self.closed = False

    # ------------------------------------------------------------------ socket

    def _socket(self) -> zmq.Socket | StreamSocket:
        if self._sock is not None and self._sock.closed:  # a stream connection the daemon closed
            self._rebuild()
        if self._sock is None:
            self._sock = connect_socket(self._ctx, self.endpoint, self._identity)
            # the first message on a (re)built socket says who we are: the daemon ties pins to our pid
            hello = m.Hello(rid=next(self._rids), protocol_version=m.PROTOCOL_VERSION, client=self.name,
                            pid=os.getpid())
            try:
                self._sock.send(codec.encode(hello), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the request that follows fails the same way and says so
            else:
                self._hello_rid = hello.rid
                self._sent[hello.rid] = _Sent("Hello", time.monotonic(), self.boot_generation)
        return self._sock

    def _rebuild(self) -> None:
        """Drop the socket (and every request still queued in it); the next send makes a new one."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        for rid in (self._hello_rid, self._probe_rid):
            if rid is not None:
                self._sent.pop(rid, None)
        self._hello_rid = self._probe_rid = None

    def _send_raw(self, req: m.Msg) -> int | None:
        req.rid = next(self._rids)
        frame = codec.encode(req)
        try:
            try:
                self._socket().send(frame, zmq.NOBLOCK)
            except zmq.Again:
                raise
            except zmq.ZMQError:
                if not isinstance(self._sock, StreamSocket):
                    raise
                # the daemon closed our stream connection (it stopped or restarted) before this
                # request, so nothing of it was delivered: send it on a fresh connection
                self._rebuild()
                self._socket().send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EAGAIN: the queue is full (daemon gone for long); anything else
            log.warning("kvdepot: cannot send %s to %s: %s", type(req).__name__, self.endpoint, exc)
            self._mark_down()
            return None
        self._sent[req.rid] = _Sent(type(req).__name__, time.monotonic(), self.boot_generation)
        return req.rid

    # ------------------------------------------------------------------ API

    def send(self, req: m.Msg) -> int | None:
        """Queue ``req`` (its ``rid`` is assigned here); its request id, or None if it could not
        be sent or the daemon is down (then nothing was sent)."""
        with self._lock:
            if self.closed or not self.up:
                return None
            return self._send_raw(req)

    def poll(self, timeout_s: float = 0.0) -> None:
        """Collect the replies that arrived (waiting at most ``timeout_s`` for the first)."""
        with self._lock:
            if self._sock is None or self.closed:
                return
            timeout_ms = max(0, int(timeout_s * 1000))
            while True:
                try:
                    if not self._sock.poll(timeout_ms, zmq.POLLIN):
                        break
                    frame = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    # the daemon closed the stream connection (it stopped or restarted): replies
                    # to requests sent on it never come (they time out); the next send connects
                    # afresh, and a daemon that is gone shows as a timeout, as on ZMQ
                    log.warning("kvdepot: lost the connection to %s: %s", self.endpoint, exc)
                    self._rebuild()
                    break
                timeout_ms = 0
                try:
                    reply = codec.decode_reply(frame)
                except (msgspec.DecodeError, UnicodeDecodeError):
                    log.warning("kvdepot: undecodable reply from %s dropped", self.endpoint)
                    continue
                self._on_reply(reply)

    def _on_reply(self, reply: m.Msg) -> None:
        sent = self._sent.pop(reply.rid, None)
        boot = getattr(reply, "boot_id", None)
        if isinstance(boot, str) and boot:
            self._note_boot(boot)
        if reply.rid == self._hello_rid or reply.rid == self._probe_rid:
            if isinstance(reply, m.ErrorReply):
                log.error("kvdepot: daemon at %s refused %s: %s", self.endpoint,
                          "the hello" if reply.rid == self._hello_rid else "a ping", reply.message)
            if reply.rid == self._probe_rid:
                self._probe_rid = None
                if not isinstance(reply, m.ErrorReply):
                    if not self.up:
                        log.info("kvdepot: daemon at %s answers again", self.endpoint)
                    self.up = True
            return
        if sent is not None:
            self._replies[reply.rid] = reply

    def _note_boot(self, boot_id: str) -> None:
        if self.boot_id is not None and boot_id != self.boot_id:
            self.boot_generation += 1
            log.warning("kvdepot: daemon at %s restarted (boot %s -> %s)", self.endpoint, self.boot_id, boot_id)
        self.boot_id = boot_id

    def take(self, rid: int) -> m.Msg | None:
        """The reply of ``rid`` if it arrived (then forgotten), else None."""
        with self._lock:
            return self._replies.pop(rid, None)

    def waiting(self, rid: int) -> bool:
        """True while ``rid`` was sent and neither answered nor forgotten."""
        with self._lock:
            return rid in self._sent

    def sent_generation(self, rid: int) -> int | None:
        with self._lock:
            s = self._sent.get(rid)
            return None if s is None else s.generation

    def age_s(self, rid: int) -> float:
        """Seconds since ``rid`` was sent (0 if unknown)."""
        with self._lock:
            s = self._sent.get(rid)
            return 0.0 if s is None else time.monotonic() - s.sent_at

    def forget(self, rid: int) -> None:
        """Stop tracking ``rid``; a late reply is dropped."""
        with self._lock:
            self._sent.pop(rid, None)
            self._replies.pop(rid, None)

    def call(self, req: m.Msg, timeout_s: float) -> m.Msg:
        """Send ``req`` and wait for its reply.

        Raises:
            KVDepotError: the daemon's error reply; TIMEOUT (no reply within ``timeout_s``, or the
                daemon is down: nothing sent). After a TIMEOUT the request may still run in the
                daemon: use `call_tracked` to keep watching it.
        """
        rid, reply = self.call_tracked(req, timeout_s)
        if reply is None:
            if rid is not None:
                self.forget(rid)
            raise KVDepotError(ErrorCode.TIMEOUT, f"no reply from {self.endpoint} within {timeout_s} s to "
                                                  f"{type(req).__name__}; is `kvdepot serve` running?")
        return reply

    def call_tracked(self, req: m.Msg, timeout_s: float) -> tuple[int | None, m.Msg | None]:
        """Like `call`, but a timeout returns ``(rid, None)`` with ``rid`` still tracked (its
        late reply can be `take`-n) instead of raising; ``(None, None)`` if nothing was sent.

        Raises:
            KVDepotError: the daemon's error reply.
        """
        with self._lock:
            rid = self.send(req)
            if rid is None:
                return None, None
            deadline = time.monotonic() + timeout_s
            while True:
                reply = self._replies.pop(rid, None)
                if reply is not None:
                    if isinstance(reply, m.ErrorReply):
                        raise KVDepotError(reply.code, reply.message)
                    return rid, reply
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("kvdepot: %s to %s timed out after %.1f s; the daemon is considered down",
                                type(req).__name__, self.endpoint, timeout_s)
                    self._mark_down()
                    return rid, None
                self.poll(min(left, 0.05))

    def _mark_down(self) -> None:
        if not self.up:
            return  # already down: keep the probe that is under way
        self.up = False
        self._rebuild()  # drops queued requests: a daemon that comes back never runs them late
        self._next_probe = time.monotonic() + self.retry_interval_s

    def mark_down(self) -> None:
        with self._lock:
            self._mark_down()

    def probe(self) -> bool:
        """Non-blocking health check: while down, collect a pending ping's answer or send a new
        ping (at most every ``retry_interval_s``). Returns `up`."""
        with self._lock:
            if self.closed:
                return False
            self.poll(0)
            if self.up:
                return True
            now = time.monotonic()
            if self._probe_rid is not None and now < self._next_probe:
                return False
            if self._probe_rid is not None:
                self._rebuild()  # the ping got no answer: start over on a fresh socket
            self._next_probe = now + self.retry_interval_s
            self._probe_rid = self._send_raw(m.Ping(rid=0))
            return False

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._rebuild()
            self._ctx.term()
