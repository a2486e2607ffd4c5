"""Sockets: the one place socket options are chosen.

Endpoints: ``ipc://PATH`` (default; the socket file is created mode 0600, so only the
daemon's user can talk to it) or ``tcp://127.0.0.1:PORT``.

Beside every ``ipc://PATH`` ZMQ endpoint the daemon also listens on a Unix stream socket at
``PATH.stream`` (`stream_path`), and clients on the same host use it when they can connect
(`connect_socket`). Same messages, framed by a 4-byte little-endian length. Why: a ZMQ ipc
hop passes through two ZMQ I/O threads (sender's and receiver's) before the receiving thread
wakes, four thread hand-offs per round trip; on a stream socket the kernel wakes the receiver
directly. Measured on a 2-core VM, echo round trips of a 200-byte message: 111 us through ZMQ
against 10 us on the stream socket with blocking receives on both sides (55 against 5 us when
both sides poll). An idle daemon and a client waiting on a GPU copy both sleep, and every
extra wake-up of a sleeping thread costs tens of microseconds on a VM.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import tempfile
import time

import zmq

from kvdepot.protocol.errors import ErrorCode, KVDepotError
from kvdepot.protocol.codec import MAX_FRAME_BYTES  # a longer message on a stream socket ends the connection

ENV_ENDPOINT = "KVDEPOT_ENDPOINT"  # default endpoint for `kvdepot serve` and clients

# Requests are small (KV bytes move through engine memory, not ZMQ); a deep queue absorbs
# bursts from many engines without dropping (ROUTER drops on HWM, so keep it high).
_HWM = 100_000
# plain ints: arithmetic on the IntFlag members costs microseconds per message in Python
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_MSG_NOSIGNAL = int(socket.MSG_NOSIGNAL)
_MSG_DONTWAIT = int(socket.MSG_DONTWAIT)


def default_endpoint() -> str:
    """``$KVDEPOT_ENDPOINT``, else ``ipc://<tmpdir>/kvdepot-<uid>.sock``."""
    env = os.environ.get(ENV_ENDPOINT)
    if env:
        return env
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'kvdepot-{os.getuid()}.sock')}"


def ipc_path(endpoint: str) -> str | None:
    """Filesystem path of an ``ipc://`` endpoint, else None."""
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def make_socket(ctx: zmq.Context, socket_type: int, endpoints: list[str] | str, bind: bool,
                identity: bytes | None = None, options: dict[int, object] | None = None) -> zmq.Socket:
    """Create a socket with kvdepot's options and bind or connect it.

    ``identity`` (DEALER): a fixed routing id, so a client that rebuilds its socket after a
    timeout keeps its pins and liveness record in the daemon (the ROUTER hands the id over).
    ``options``: more socket options, set before binding / connecting (e.g. CURVE keys).

    Binding an ``ipc://`` endpoint creates the socket file with mode 0600 (umask 0o177 while
    binding) and replaces a stale file left by a dead daemon.

    Raises:
        ValueError: an endpoint that is neither ``ipc://`` nor ``tcp://``.
        zmq.ZMQError: bind/connect failed (e.g. address in use).
    """
    if isinstance(endpoints, str):
        endpoints = [endpoints]
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    if socket_type == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished peer's reply is dropped, not an error
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client takes its routing id over
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    try:
        for opt, value in (options or {}).items():
            sock.setsockopt(opt, value)
        for ep in endpoints:
            if not ep.startswith(("ipc://", "tcp://")):
                raise ValueError(f"endpoint {ep!r}: use ipc://PATH or tcp://HOST:PORT (--endpoint)")
            if not bind:
                sock.connect(ep)
                continue
            path = ipc_path(ep)
            if path is None:
                sock.bind(ep)
                continue
            if os.path.exists(path):
                os.unlink(path)  # stale file; the daemon checked that no live daemon answers there
            old = os.umask(0o177)
            try:
                sock.bind(ep)
            finally:
                os.umask(old)
    except Exception:
        sock.close(0)
        raise
    return sock


STREAM_SUFFIX = ".stream"  # the stream socket of ipc://PATH is PATH + STREAM_SUFFIX
FRAME_HEADER = struct.Struct("<I")  # stream framing: little-endian uint32 body length, then the body
ENV_TRANSPORT = "KVDEPOT_TRANSPORT"  # "zmq": clients never use the stream socket


def stream_path(endpoint: str) -> str | None:
    """Path of the stream socket served beside ``endpoint`` (``ipc://`` only), else None."""
    path = ipc_path(endpoint)
    return None if path is None else path + STREAM_SUFFIX


EVENTS_SUFFIX = ".events"  # the chunk events of ipc://PATH are published at ipc://PATH + EVENTS_SUFFIX


def events_endpoint(endpoint: str) -> str | None:
    """Where the daemon serving ``endpoint`` publishes chunk events (`kvdepot.server.events`):
    ``ipc://PATH.events`` for ``ipc://PATH``; None for other endpoints (none is published there)."""
    path = ipc_path(endpoint)
    return None if path is None else f"ipc://{path}{EVENTS_SUFFIX}"


class StreamSocket:
    """Client end of the daemon's stream socket, with the part of `zmq.Socket`'s interface
    (DEALER) that kvdepot's clients call: `send`, `poll`, `recv`, `close`.

    On connect the client sends its routing identity (1 length byte, then the bytes); after that
    each message is `FRAME_HEADER` + body in both directions. The daemon ties pins and its
    liveness record to the identity, as it does to a DEALER's routing id.

    Nothing blocks on the daemon: connect, `send` and `flush` are non-blocking. What the kernel's
    socket buffer does not take waits in an outbox of at most ``outbox_max_bytes`` (whole
    messages, in order) and goes out with the next `send`, `flush` or `poll`; `send` of a message
    that would overfill it raises `OutboxFull` and queues nothing of it. ``outbox_bytes`` and
    ``outbox_since_s`` (``time.monotonic()`` of the last byte the daemon took while the outbox
    was non-empty) let the owner give up on a daemon that takes nothing (`KVDepotClient`).

    Errors follow pyzmq's: ``zmq.Again`` for a non-blocking receive that would block, and
    ``zmq.ZMQError`` with an errno for a connection the daemon closed (it stopped or restarted),
    after which the socket is unusable: the owner rebuilds it.

    Raises (constructor):
        OSError: nothing accepts connections at ``path`` (no daemon, or an older one);
            ``BlockingIOError`` when the daemon's listen backlog is full (a hung daemon).
    """

    def __init__(self, path: str, identity: bytes, outbox_max_bytes: int = 16 << 20) -> None:
        if not 0 < len(identity) < 256:
            raise ValueError("identity must be 1..255 bytes")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.connect(path)  # AF_UNIX: done at once, or BlockingIOError (backlog full)
            hello = bytes([len(identity)]) + identity
            if sock.send(hello, _MSG_NOSIGNAL) != len(hello):  # an empty new socket buffer takes it whole
                raise BlockingIOError(errno.EAGAIN, "the daemon took no identity bytes")
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._buf = bytearray(1 << 16)  # received bytes [_start, _end)
        self._start = self._end = 0
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        self._out = bytearray()  # framed messages the kernel did not take yet, in order
        self.outbox_max_bytes = outbox_max_bytes
        self.outbox_since_s = 0.0
        self.bytes_queued = 0  # every byte `send` accepted, framing included
        self.closed = False

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def outbox_bytes(self) -> int:
        """Bytes sent by `send` that the kernel has not taken yet (the message ending at
        ``bytes_queued - outbox_bytes`` is the last the daemon can read, even after a close)."""
        return len(self._out)

    def send(self, frame: bytes, flags: int = 0) -> None:
        """Queue one message and send what the socket takes, never waiting (``flags`` is
        accepted for pyzmq's signature; every send is non-blocking).

        Raises:
            OutboxFull: the outbox cannot take the message (nothing of it was queued).
            zmq.ZMQError: the daemon closed the connection."""
        self._check_open()
        header = FRAME_HEADER.pack(len(frame))
        if self._out:
            if len(self._out) + len(header) + len(frame) > self.outbox_max_bytes:
                self.flush()
                if len(self._out) + len(header) + len(frame) > self.outbox_max_bytes:
                    raise OutboxFull(len(self._out))
            self._out += header
            self._out += frame
            self.bytes_queued += len(header) + len(frame)
            self.flush()
            return
        try:
            sent = self._sock.sendmsg([header, frame], [], _MSG_NOSIGNAL | _MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise self._lost(exc.errno or errno.EPIPE) from None
        total = len(header) + len(frame)
        if sent < total:  # the socket buffer is full: the rest waits in the outbox
            if total > self.outbox_max_bytes and sent == 0:
                raise OutboxFull(0)
            self._out += (header + frame)[sent:]
            self.outbox_since_s = time.monotonic()
        self.bytes_queued += total

    def flush(self) -> int:
        """Send what the outbox holds as far as the socket takes it, without waiting; returns
        the bytes still queued.

        Raises:
            zmq.ZMQError: the daemon closed the connection."""
        out = self._out
        if not out:
            return 0
        try:
            sent = self._sock.send(out, _MSG_NOSIGNAL | _MSG_DONTWAIT)
        except BlockingIOError:
            return len(out)
        except OSError as exc:
            raise self._lost(exc.errno or errno.EPIPE) from None
        if sent:
            del out[:sent]
            self.outbox_since_s = time.monotonic()
        return len(out)

    def _frame_end(self) -> int:
        """End offset of the first whole buffered message, or -1."""
        have = self._end - self._start
        if have < FRAME_HEADER.size:
            return -1
        (n,) = FRAME_HEADER.unpack_from(self._buf, self._start)
        if n > MAX_FRAME_BYTES:
            raise self._lost(errno.EMSGSIZE)
        end = self._start + FRAME_HEADER.size + n
        return end if end <= self._end else -1

    def _fill(self, block_ms: int) -> None:
        """Read what has arrived, waiting up to ``block_ms`` (-1: forever) for something; while
        the outbox holds bytes, it is flushed first and the wait lasts at most a millisecond."""
        if self._out and self.flush() and block_ms != 0:
            block_ms = 1
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buf) - self._end < 4096 or self._frame_end() < 0:
            # make room at the end: move the unread bytes to the front, grow for a long message
            have = self._end - self._start
            need = have + 4096
            if have >= FRAME_HEADER.size:
                need = max(need, FRAME_HEADER.size + FRAME_HEADER.unpack_from(self._buf, self._start)[0])
            if self._start > 0 or need > len(self._buf):
                new = bytearray(max(len(self._buf), need))
                new[:have] = self._buf[self._start:self._end]
                self._buf, self._start, self._end = new, 0, have
        if block_ms == 0 and not self._poller.poll(0):
            return  # nothing arrived (one syscall; a recv that fails with EAGAIN costs more in Python)
        view = memoryview(self._buf)[self._end:]
        try:
            n = self._sock.recv_into(view, 0, _MSG_DONTWAIT)
        except BlockingIOError:
            if block_ms == 0 or not self._poller.poll(block_ms):
                return
            try:
                n = self._sock.recv_into(view, 0, _MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as exc:
                raise self._lost(exc.errno or errno.ECONNRESET) from None
        except OSError as exc:
            raise self._lost(exc.errno or errno.ECONNRESET) from None
        finally:
            view.release()
        if n == 0:
            raise self._lost(errno.ECONNRESET)
        self._end += n

    def poll(self, timeout_ms: int = -1, flags: int = zmq.POLLIN) -> int:
        """``zmq.POLLIN`` once a whole message can be received, 0 after ``timeout_ms``
        (-1: no limit) without one."""
        self._check_open()
        if self._frame_end() >= 0:
            return _POLLIN
        if timeout_ms == 0:  # the common case (a non-blocking look): no clock reads
            self._fill(0)
            return _POLLIN if self._frame_end() >= 0 else 0
        if timeout_ms is None or timeout_ms < 0:
            while self._frame_end() < 0:
                self._fill(-1)
            return _POLLIN
        deadline = _monotonic_ms() + timeout_ms
        while True:
            self._fill(max(0, deadline - _monotonic_ms()))
            if self._frame_end() >= 0:
                return _POLLIN
            if _monotonic_ms() >= deadline:
                return 0

    def poll_s(self, timeout_s: float) -> int:
        """`poll` with a timeout in seconds at microsecond resolution (``select(2)``; ``poll(2)``
        rounds up to whole milliseconds)."""
        self._check_open()
        if self._frame_end() >= 0:
            return _POLLIN
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left > 0:
                # (while the outbox holds bytes: woken when the socket takes more, then flushed)
                select.select((self._sock,), (self._sock,) if self._out else (), (), left)
            self._fill(0)
            if self._frame_end() >= 0:
                return _POLLIN
            if left <= 0:
                return 0

    def recv(self, flags: int = 0) -> bytes:
        """The next message's body; ``flags=zmq.NOBLOCK``: ``zmq.Again`` if none has arrived."""
        if not self.poll(0 if flags & _NOBLOCK else -1):
            raise zmq.Again()
        end = self._frame_end()
        body = bytes(self._buf[self._start + FRAME_HEADER.size:end])
        self._start = end
        return body

    def close(self, linger: int | None = None) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()

    def _check_open(self) -> None:
        if self.closed:
            raise zmq.ZMQError(errno.ENOTSOCK, "the stream socket to the daemon is closed")

    def _lost(self, err: int) -> zmq.ZMQError:
        self.close()
        return zmq.ZMQError(err, f"connection to the kvdepot daemon lost ({os.strerror(err)}); did it stop or restart?")


class OutboxFull(zmq.Again):
    """`StreamSocket.send` (or a ZMQ DEALER at its high-water mark): the daemon has not taken
    the messages queued before, and this one would exceed the outbox's bound."""

    def __init__(self, queued_bytes: int) -> None:
        super().__init__()
        self.queued_bytes = queued_bytes

    def __str__(self) -> str:
        return f"the daemon took none of the {self.queued_bytes} bytes queued for it"


def _monotonic_ms() -> int:
    return int(time.monotonic() * 1000)


def connect_socket(ctx: zmq.Context, endpoint: str, identity: bytes) -> zmq.Socket | StreamSocket:
    """A client's socket to ``endpoint``: the daemon's stream socket when the endpoint is
    ``ipc://`` and the stream socket accepts (unless ``$KVDEPOT_TRANSPORT`` is ``zmq``), else a
    ZMQ DEALER with routing id ``identity``.

    Raises:
        ValueError, zmq.ZMQError: as `make_socket`.
        KVDepotError: UNAVAILABLE at once, for an ``ipc://`` endpoint no daemon listens at (its
            socket file is missing, or its stream socket refuses: the daemon that made it is
            gone). A ``tcp://`` endpoint, or ``$KVDEPOT_TRANSPORT=zmq``, cannot tell: requests
            queue until a daemon binds, and only a reply timeout says it is not there.
    """
    path = stream_path(endpoint)
    if path is not None and os.environ.get(ENV_TRANSPORT, "").lower() != "zmq":
        try:
            return StreamSocket(path, identity)
        except BlockingIOError:
            raise KVDepotError(ErrorCode.BACKPRESSURE, f"the kvdepot daemon at {endpoint} accepts no connections "
                                                       "(its listen backlog is full: is it stopped or hung?)") from None
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            if isinstance(exc, ConnectionRefusedError) or not os.path.exists(ipc_path(endpoint)):
                raise KVDepotError(ErrorCode.UNAVAILABLE, f"no kvdepot daemon listens at {endpoint} ({exc.strerror}); "
                                                          "is `kvdepot serve` running?") from None
        except OSError:
            pass  # no stream socket there (an older daemon): ZMQ
    options = curve_client_options() if endpoint.startswith("tcp://") else None
    return make_socket(ctx, zmq.DEALER, endpoint, bind=False, identity=identity, options=options)


ENV_CURVE_SERVER_KEY = "KVDEPOT_CURVE_SERVER_KEY"  # a client's: the daemon's public key file
ENV_CURVE_CLIENT_KEY = "KVDEPOT_CURVE_CLIENT_KEY"  # a client's: its own secret key file


def curve_client_options() -> dict[int, bytes]:
    """Socket options of a client towards a ``tcp://`` endpoint: ZeroMQ CURVE when
    ``$KVDEPOT_CURVE_SERVER_KEY`` and ``$KVDEPOT_CURVE_CLIENT_KEY`` name key files (``kvdepot
    keygen`` writes them), else none (then only a loopback daemon without CURVE answers).

    Raises:
        ValueError: only one of the two is set, or a file cannot be read / has no key.
    """
    import zmq.auth

    server, client = os.environ.get(ENV_CURVE_SERVER_KEY, ""), os.environ.get(ENV_CURVE_CLIENT_KEY, "")
    if not server and not client:
        return {}
    if not (server and client):
        raise ValueError(f"set both {ENV_CURVE_SERVER_KEY} (the daemon's public key file) and "
                         f"{ENV_CURVE_CLIENT_KEY} (this client's secret key file), or neither")
    try:
        server_public, _ = zmq.auth.load_certificate(server)
        public, secret = zmq.auth.load_certificate(client)
    except (OSError, ValueError) as exc:
        raise ValueError(f"CURVE key files ({ENV_CURVE_SERVER_KEY}, {ENV_CURVE_CLIENT_KEY}): {exc}") from None
    if secret is None:
        raise ValueError(f"{ENV_CURVE_CLIENT_KEY}={client} holds no secret key (give the .key_secret file)")
    return {zmq.CURVE_SERVERKEY: server_public, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}
