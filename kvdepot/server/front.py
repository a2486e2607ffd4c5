"""The daemon's message front (`Front`): draining its ZMQ sockets (ipc, tcp) and stream
connections, decoding and dispatching each request to its handler, and sending the reply (or
the typed error). Everything runs on the daemon's event loop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from kvdepot import trace
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.server.faults import InjectedFaults
from kvdepot.server.netsec import TCP_TAG, TcpFront, authorize
from kvdepot.server.stream import StreamServer

log = logging.getLogger("kvdepot.daemon")
_TRACE = trace.POINTS  # None unless KVDEPOT_TRACE_FILE is set (see kvdepot/trace.py)
trace_point = trace.point


Handler = Callable[[bytes, m.Msg], "m.Msg | None"]  # (client identity, request) -> reply, or None: replied later


class Front:
    """Receive, dispatch, reply (see the module docstring).

    Args:
        metrics: the daemon's `kvdepot.server.metrics.Metrics` (``errors``, ``requests``).
        inflight: how many copies are in flight now (the busy poll stops beyond
            ``busy_poll_max_inflight`` of them).
        busy_poll_s, busy_poll_max_inflight: `kvdepot.server.daemon.DaemonConfig`'s busy poll.
        faults: injected reply faults (soak tests only), or None.
        on_attach, on_detach: called with a stream connection's identity when it opens / closes.

    `route` gives it the handlers; `bind` the loop and the ZMQ sockets (``streams`` listens by
    itself); `close` ends both.
    """

    _DRAIN_BATCH = 64  # messages handled per loop turn before yielding to other callbacks

    def __init__(self, metrics, inflight: Callable[[], int], busy_poll_s: float, busy_poll_max_inflight: int,
                 faults: InjectedFaults | None, on_attach: Callable[[bytes], None],
                 on_detach: Callable[[bytes], None]) -> None:
        self.metrics = metrics
        self._inflight = inflight
        self._busy_poll_s = busy_poll_s
        self._busy_poll_max_inflight = busy_poll_max_inflight
        self._busy_until = 0.0
        self._spinning = False
        self._faults = faults
        self._handlers: dict[type, Handler] = {}
        self._request_cells: dict[type, object] = {}
        self.streams = StreamServer(self._on_stream_frame, on_attach, on_detach)
        self._loop = None
        self._sock: zmq.Socket | None = None  # the ROUTER of the ipc:// endpoints
        self._tcp: TcpFront | None = None  # the ROUTER of the tcp:// endpoints
        self._fronts: list[tuple[zmq.Socket, bytes]] = []
        self._drain_scheduled = False

    def route(self, handlers: dict[type, Handler]) -> None:
        """Serve each request type with its handler (`kvdepot_requests_total{type}`: one cell
        per type, at 0 from the start)."""
        self._handlers = dict(handlers)
        self._request_cells = {t: self.metrics.requests.labels(t.__name__.lower()) for t in handlers}

    def bind(self, loop, sock: zmq.Socket | None, tcp: TcpFront | None) -> None:
        """Start reading ``sock`` (ipc://) and ``tcp`` on ``loop``."""
        self._loop = loop
        self._sock, self._tcp = sock, tcp
        self._fronts = [(s, tag) for s, tag in ((sock, b""), (tcp and tcp.sock, TCP_TAG)) if s is not None]
        for s, _ in self._fronts:
            loop.add_reader(s.getsockopt(zmq.FD), self._on_readable)
        self._schedule_drain()  # messages may have queued before the reader was added

    def unbind(self) -> None:
        """Stop reading the ZMQ sockets and close the stream connections (the sockets stay open
        until `close`: replies of copies still running are dropped)."""
        for s, _ in self._fronts:
            self._loop.remove_reader(s.getsockopt(zmq.FD))
        self.streams.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
        if self._tcp is not None:
            self._tcp.close()

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._on_readable)

    def _on_readable(self) -> None:
        """Handle every message queued on the ZMQ sockets (ipc, tcp). Their FDs are
        edge-triggered: they signal a change of the socket's state, so each queue is drained
        until EVENTS says empty (at most `_DRAIN_BATCH` per socket per loop turn)."""
        self._drain_scheduled = False
        more = False
        for sock, tag in self._fronts:
            if not sock.closed:
                more |= self._drain(sock, tag)
        if more:
            self._schedule_drain()  # more queued: continue on the next loop turn

    def _drain(self, sock: zmq.Socket, tag: bytes) -> bool:
        """Up to `_DRAIN_BATCH` messages of one socket; True if more may be queued. A tcp
        peer's identity gets ``tag`` in front (`kvdepot.server.netsec.TCP_TAG`)."""
        for _ in range(self._DRAIN_BATCH):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return False
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)  # copies: cheaper than Frame objects for small messages
            except zmq.Again:
                return False
            if _TRACE is not None:
                _TRACE.append((-1, "recv", time.perf_counter_ns()))
            identity = tag + frames[0] if tag else frames[0]
            try:
                if len(frames) != 2:
                    self.send(identity, codec.error_frame(0, ErrorCode.MALFORMED,
                                                           f"expected 1 body frame, got {len(frames) - 1}"))
                    self.metrics.errors.labels(ErrorCode.MALFORMED.name).inc()
                else:
                    self._dispatch(identity, frames[1])
            except Exception:  # noqa: BLE001 - one message must never end the loop (the daemon would go silent)
                log.exception("dropped a message that failed outside its handler")
        return True

    def _on_stream_frame(self, identity: bytes, body: bytes) -> None:
        if _TRACE is not None:
            _TRACE.append((-1, "recv", time.perf_counter_ns()))
        self._dispatch(identity, body)

    def _dispatch(self, identity: bytes, body: bytes) -> None:
        """Decode one request, run its handler and send the reply (or the typed error)."""
        if self._busy_poll_s:
            self._note_activity()
        try:
            req = codec.decode_request(body)
        except RequestError as exc:
            self.reply_error(identity, exc.rid, exc)
            return
        except Exception as exc:  # noqa: BLE001 - e.g. RecursionError on deeply nested msgpack
            self.reply_error(identity, 0, RequestError(ErrorCode.MALFORMED, f"undecodable request: {exc}"))
            return
        handler = self._handlers.get(type(req))
        if handler is None:  # a request type this daemon build does not serve
            self.reply_error(identity, req.rid, RequestError(ErrorCode.UNSUPPORTED, type(req).__name__))
            return
        self._request_cells[type(req)].value += 1
        if _TRACE is not None:
            trace_point(req.rid, "start")
        try:
            if self._tcp is not None and identity.startswith(TCP_TAG):
                authorize(req, self._tcp.authenticated)
            reply = handler(identity, req)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a typed reply
            self.reply_error(identity, req.rid, exc)
        else:
            if reply is not None:  # None: the handler replies from a completion callback
                self.reply(identity, reply)

    def reply(self, identity: bytes, reply: m.Msg) -> None:
        """Send ``reply`` to ``identity`` (one that cannot be encoded becomes an INTERNAL error)."""
        try:
            frame = codec.encode(reply)
        except Exception as exc:  # noqa: BLE001 - a reply that cannot be encoded still gets an answer
            self.reply_error(identity, reply.rid, exc)
            return
        if _TRACE is not None:  # encoded, handed to the socket now (a client may read it before a point
            trace_point(reply.rid, "reply")  # taken after the send)
        self.send(identity, frame)

    def _note_activity(self) -> None:
        """Keep the loop polling without sleeping for ``busy_poll_us`` from now (see DaemonConfig),
        unless more than ``busy_poll_max_inflight`` copies are in flight. A callback that
        re-queues itself makes uvloop poll its descriptors with a zero timeout."""
        if 0 <= self._busy_poll_max_inflight < self._inflight():
            return
        self._busy_until = time.monotonic() + self._busy_poll_s
        if not self._spinning:
            self._spinning = True
            self._loop.call_soon(self._spin)

    def _spin(self) -> None:
        if time.monotonic() < self._busy_until:
            self._loop.call_soon(self._spin)
        else:
            self._spinning = False

    def send(self, identity: bytes, frame: bytes) -> None:
        faults = self._faults  # None unless $KVDEPOT_INJECT_FAULTS (kvdepot.server.faults)
        if faults is not None:
            wait_s = faults.decide()
            if wait_s is None:
                return
            if wait_s > 0:
                self._loop.call_later(wait_s, self._send_now, identity, frame)
                return
        self._send_now(identity, frame)

    def _send_now(self, identity: bytes, frame: bytes) -> None:
        if self._busy_poll_s:
            self._note_activity()
        if self.streams.send(identity, frame):
            return
        # a send can consume the FD's edge for messages that arrived meanwhile: look again
        self._schedule_drain()
        sock = self._sock
        if self._tcp is not None and identity.startswith(TCP_TAG):
            sock, identity = self._tcp.sock, identity[len(TCP_TAG):]
        if sock is None:
            return  # a stream connection that closed meanwhile (no ZMQ ipc socket to try)
        try:
            sock.send_multipart([identity, frame], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("dropping a reply: client queue full")
        except zmq.ZMQError as exc:
            log.warning("dropping a reply: %s", exc)

    def reply_error(self, identity: bytes, rid: int, exc: BaseException) -> None:
        """Answer request ``rid`` with ``exc``'s typed error (INTERNAL for an exception that is
        not a `RequestError`, logged) and count it."""
        if isinstance(exc, RequestError):
            code, msg = exc.code, exc.message
        else:
            code, msg = ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
            log.exception("internal error on request %d", rid, exc_info=exc)
        name = code.name if isinstance(code, ErrorCode) else str(code)
        self.metrics.errors.labels(name).inc()
        self.send(identity, codec.error_frame(rid, code, msg))

