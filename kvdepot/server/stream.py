"""The daemon's stream sockets: Unix stream sockets served beside its ``ipc://`` ZMQ endpoints.

Same messages as on the ZMQ ROUTER, framed as `kvdepot.protocol.transport.StreamSocket`
describes (why the second transport exists is said there): the client's identity first (one
length byte, then the bytes), then `FRAME_HEADER` + body per message in both directions. A
connection's identity plays the part of a DEALER's routing id: replies are routed by it, and
pins and liveness records are keyed by it, so the handlers do not know which transport a
request came on. The connections are asyncio protocols on the daemon's uvloop loop: a message
is read and handled in one callback, with no thread hand-off.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

from kvdepot.protocol import codec
from kvdepot.protocol.errors import ErrorCode
from kvdepot.protocol.transport import FRAME_HEADER, MAX_FRAME_BYTES

log = logging.getLogger("kvdepot.stream")

_MAX_UNSENT_BYTES = 64 << 20  # replies a client leaves unread beyond this close its connection


class _Connection(asyncio.Protocol):
    def __init__(self, server: StreamServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.identity: bytes | None = None
        self._pending = bytearray()  # the start of a message that has not fully arrived

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._pending:
            self._pending += data
            data = self._pending
        pos, n = 0, len(data)
        if self.identity is None:
            if n < 1 or n < 1 + data[0]:
                self._keep(data, 0)
                return
            if data[0] == 0:
                log.warning("stream connection without an identity: closed")
                self.transport.close()
                return
            self.identity = bytes(data[1:1 + data[0]])
            pos = 1 + data[0]
            self.server._attach(self)
        header = FRAME_HEADER.size
        on_frame = self.server.on_frame
        while n - pos >= header:
            (size,) = FRAME_HEADER.unpack_from(data, pos)
            if size > MAX_FRAME_BYTES:
                log.warning("stream client %r sent a %d-byte message (limit %d): connection closed",
                            self.identity, size, MAX_FRAME_BYTES)
                # the stream cannot be resynchronized without reading the message: say why, then close
                self.write(codec.error_frame(0, ErrorCode.MALFORMED, f"message of {size} bytes exceeds "
                                                                     f"{MAX_FRAME_BYTES}; connection closed"))
                self.transport.close()
                self._pending = bytearray()
                return
            end = pos + header + size
            if end > n:
                break
            body = bytes(data[pos + header:end])
            pos = end
            try:
                on_frame(self.identity, body)
            except Exception:  # noqa: BLE001 - one message must never end the connection's reading
                log.exception("dropped a stream message that failed outside its handler")
        self._keep(data, pos)

    def _keep(self, data, pos: int) -> None:
        if pos >= len(data):
            self._pending = bytearray()
        elif data is self._pending:
            del self._pending[:pos]
        else:
            self._pending = bytearray(data[pos:])

    def write(self, frame: bytes) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if t.get_write_buffer_size() > _MAX_UNSENT_BYTES:
            log.warning("stream client %r reads no replies (%d bytes unsent): connection closed",
                        self.identity, t.get_write_buffer_size())
            t.abort()
            return
        t.write(FRAME_HEADER.pack(len(frame)) + frame)

    def connection_lost(self, exc) -> None:
        self.server._detach(self)


def unix_listener(path: str, backlog: int) -> socket.socket:
    """A listening Unix stream socket at ``path``, created mode 0600 (only the daemon's uid may
    connect); a stale file there is replaced (the caller checked that no live daemon serves it).

    Raises:
        OSError: the socket cannot be bound (directory missing, path too long).
    """
    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    sock.listen(backlog)
    return sock


class StreamServer:
    """Listening stream sockets and their connections, keyed by client identity.

    Args:
        on_frame: called on the loop with ``(identity, body)`` for each whole message.
        on_attach: called with ``identity`` when a connection of it opened (its identity arrived).
        on_detach: called with ``identity`` when its connection closed, unless a newer
            connection of the same identity took over (a reconnect).
    """

    def __init__(self, on_frame: Callable[[bytes, bytes], None], on_attach: Callable[[bytes], None] | None = None,
                 on_detach: Callable[[bytes], None] | None = None) -> None:
        self.on_frame = on_frame
        self.on_attach = on_attach
        self.on_detach = on_detach
        self._conns: dict[bytes, _Connection] = {}
        self._servers: list[tuple[asyncio.AbstractServer, str]] = []

    async def listen(self, path: str) -> None:
        """Serve at ``path`` (created mode 0600; a stale file is replaced: the caller checked
        that no live daemon serves the endpoint).

        Raises:
            OSError: the socket cannot be bound (directory missing, path too long).
        """
        sock = unix_listener(path, backlog=1024)
        loop = asyncio.get_running_loop()
        server = await loop.create_unix_server(lambda: _Connection(self), sock=sock)
        self._servers.append((server, path))

    @property
    def paths(self) -> list[str]:
        return [p for _, p in self._servers]

    def send(self, identity: bytes, frame: bytes) -> bool:
        """Send ``frame`` to the client connected as ``identity``; False if none is."""
        conn = self._conns.get(identity)
        if conn is None:
            return False
        conn.write(frame)
        return True

    def _attach(self, conn: _Connection) -> None:
        old = self._conns.get(conn.identity)
        self._conns[conn.identity] = conn  # a reconnecting client takes its identity over
        if old is not None and old is not conn and old.transport is not None:
            old.transport.close()
        if self.on_attach is not None:
            self.on_attach(conn.identity)

    def _detach(self, conn: _Connection) -> None:
        if conn.identity is not None and self._conns.get(conn.identity) is conn:
            del self._conns[conn.identity]
            if self.on_detach is not None:
                try:
                    self.on_detach(conn.identity)
                except Exception:  # noqa: BLE001 - a closing connection must never break the loop
                    log.exception("handling the close of a stream connection failed")

    def close(self) -> None:
        """Stop listening, close every connection and remove the socket files."""
        for server, path in self._servers:
            server.close()
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._servers.clear()
        for conn in list(self._conns.values()):
            if conn.transport is not None:
                conn.transport.close()
        self._conns.clear()
