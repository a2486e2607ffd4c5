"""The daemon's message front: draining its ZMQ sockets (ipc, tcp) and stream connections,
decoding and dispatching each request to its handler, and sending the reply (or the typed
error). A mixin of `kvdepot.server.daemon.Daemon`, whose attributes it uses: ``_fronts`` (ZMQ
sockets and their identity tags), ``_sock``, ``_tcp``, ``_streams``, ``_loop``, ``_handlers``,
``_request_cells``, ``_faults``, ``metrics`` and the busy-poll state."""

from __future__ import annotations

import logging
import time

import zmq

from kvdepot import trace
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.server.netsec import TCP_TAG, authorize

log = logging.getLogger("kvdepot.daemon")
_TRACE = trace.POINTS  # None unless KVDEPOT_TRACE_FILE is set (see kvdepot/trace.py)
trace_point = trace.point


class SocketFront:
    """Receive, dispatch, reply (see the module docstring)."""

    _DRAIN_BATCH = 64  # messages handled per loop turn before yielding to other callbacks

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
                    self._send(identity, codec.error_frame(0, ErrorCode.MALFORMED,
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
            self._reply_error(identity, exc.rid, exc)
            return
        except Exception as exc:  # noqa: BLE001 - e.g. RecursionError on deeply nested msgpack
            self._reply_error(identity, 0, RequestError(ErrorCode.MALFORMED, f"undecodable request: {exc}"))
            return
        handler = self._handlers.get(type(req))
        if handler is None:  # a request type this daemon build does not serve
            self._reply_error(identity, req.rid, RequestError(ErrorCode.UNSUPPORTED, type(req).__name__))
            return
        self._request_cells[type(req)].value += 1
        if _TRACE is not None:
            trace_point(req.rid, "start")
        try:
            if self._tcp is not None and identity.startswith(TCP_TAG):
                authorize(req, self._tcp.authenticated)
            reply = handler(self, identity, req)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a typed reply
            self._reply_error(identity, req.rid, exc)
        else:
            if reply is not None:  # None: the handler replies from a completion callback
                self._reply(identity, reply)

    def _reply(self, identity: bytes, reply: m.Msg) -> None:
        try:
            frame = codec.encode(reply)
        except Exception as exc:  # noqa: BLE001 - a reply that cannot be encoded still gets an answer
            self._reply_error(identity, reply.rid, exc)
            return
        if _TRACE is not None:  # encoded, handed to the socket now (a client may read it before a point
            trace_point(reply.rid, "reply")  # taken after the send)
        self._send(identity, frame)

    def _note_activity(self) -> None:
        """Keep the loop polling without sleeping for ``busy_poll_us`` from now (see DaemonConfig),
        unless more than ``busy_poll_max_inflight`` copies are in flight. A callback that
        re-queues itself makes uvloop poll its descriptors with a zero timeout."""
        if 0 <= self._busy_poll_max_inflight < len(self.inflight):
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

    def _send(self, identity: bytes, frame: bytes) -> None:
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
        if self._streams.send(identity, frame):
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

    def _reply_error(self, identity: bytes, rid: int, exc: BaseException) -> None:
        if isinstance(exc, RequestError):
            code, msg = exc.code, exc.message
        else:
            code, msg = ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
            log.exception("internal error on request %d", rid, exc_info=exc)
        name = code.name if isinstance(code, ErrorCode) else str(code)
        self.metrics.errors.labels(name).inc()
        self._send(identity, codec.error_frame(rid, code, msg))

