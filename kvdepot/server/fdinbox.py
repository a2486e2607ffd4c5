"""The daemon's descriptor socket (``PATH.fds``, protocol in `kvdepot.protocol.fdpass`): file
descriptors engines pass before they register sealed memfds, kept by token until a `Register`
claims them (`FdInbox.take`) or `TOKEN_TTL_S` passes. Driven by the daemon's loop through
``add_reader``; a client that connects and sends nothing is cut off after 5 s.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from kvdepot.protocol.fdpass import ACK_OK, MAX_FDS_PER_MESSAGE, TOKEN_TTL_S
from kvdepot.server.stream import unix_listener

log = logging.getLogger("kvdepot.daemon")

_MAX_TOKENS = 1024  # descriptors waiting for their Register beyond this are refused
_CONNECTION_TIMEOUT_S = 5.0


class FdInbox:
    """Passed descriptors by token (see the module docstring)."""

    def __init__(self) -> None:
        self._fds: dict[str, tuple[list[int], float]] = {}  # token -> (fds, time.monotonic() deadline)
        self._socks: list[tuple[socket.socket, str]] = []  # listening sockets and their paths
        self._loop: asyncio.AbstractEventLoop | None = None

    def listen(self, path: str) -> None:
        """Serve at ``path`` (mode 0600; a stale file is replaced).

        Raises:
            OSError: the socket cannot be bound.
        """
        sock = unix_listener(path, backlog=64)
        sock.setblocking(False)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._accept, sock)
        self._socks.append((sock, path))

    def _accept(self, sock: socket.socket) -> None:
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("descriptor socket: accept failed: %s", exc)
            return
        conn.setblocking(False)
        timer = self._loop.call_later(_CONNECTION_TIMEOUT_S, self._drop_conn, conn)
        self._loop.add_reader(conn.fileno(), self._read, conn, timer)

    def _drop_conn(self, conn: socket.socket) -> None:
        if conn.fileno() >= 0:
            self._loop.remove_reader(conn.fileno())
            conn.close()

    def _read(self, conn: socket.socket, timer: asyncio.TimerHandle) -> None:
        try:
            msg, fds, _flags, _ = socket.recv_fds(conn, 128, MAX_FDS_PER_MESSAGE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            msg, fds = b"", []
        timer.cancel()
        token = msg.decode("ascii", "replace")
        ok = bool(fds) and 16 <= len(msg) <= 64 and msg.isascii() and token not in self._fds
        self._expire()
        if ok and len(self._fds) >= _MAX_TOKENS:
            log.warning("descriptor socket: %d passed descriptor sets wait for their registration; refusing more",
                        len(self._fds))
            ok = False
        if ok:
            self._fds[token] = (list(fds), time.monotonic() + TOKEN_TTL_S)
        else:
            for fd in fds:
                os.close(fd)
        try:
            conn.send(ACK_OK if ok else b"\x01")
        except OSError:
            pass
        self._drop_conn(conn)

    def take(self, token: str) -> list[int] | None:
        """The descriptors passed under ``token`` (the caller owns them now), or None."""
        self._expire()
        got = self._fds.pop(token, None)
        return None if got is None else got[0]

    def _expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, (_, deadline) in self._fds.items() if deadline < now]:
            for fd in self._fds.pop(token)[0]:
                os.close(fd)

    def close(self) -> None:
        """Stop listening, close every unclaimed descriptor, remove the socket file."""
        for sock, path in self._socks:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(sock.fileno())
            sock.close()
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._socks.clear()
        for fds, _ in self._fds.values():
            for fd in fds:
                os.close(fd)
        self._fds.clear()
