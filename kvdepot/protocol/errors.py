"""Typed error codes carried by `ErrorReply` and the exception the client raises for them.

Codes are part of the wire protocol: append only, never renumber or reuse.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Error codes of `ErrorReply.code` (wire values; append only)."""

    MALFORMED = 1  # frame is not a decodable message (bad msgpack, wrong field types, bad ranges)
    UNKNOWN_MESSAGE = 2  # well-formed msgpack array whose tag names no known request
    VERSION_MISMATCH = 3  # client protocol version not supported by this daemon
    UNKNOWN_REGISTRATION = 4  # registration id not known (never registered, unregistered, or daemon restarted)
    INVALID_ARGUMENT = 5  # request is well-formed but its values are wrong (block id out of range, counts)
    LAYOUT = 6  # a registered KV-cache layout the daemon cannot describe or that exceeds its storage
    ENGINE_MEMORY = 7  # the engine's memory (shared memory / IPC handle) could not be opened or vanished
    INTERNAL = 8  # a bug in the daemon; the request was rolled back and the daemon keeps serving
    TIMEOUT = 9  # no reply within the client's timeout_s, or the daemon's copy watchdog gave up waiting
    # (kvdepot.server.watchdog); either way the copy may still run: keep the blocks
    UNSUPPORTED = 10  # a valid request this daemon build cannot serve (e.g. CUDA IPC without CUDA)
    DISCONNECTED = 11  # client side only: the daemon closed the connection (it stopped or restarted)
    UNAVAILABLE = 12  # client side only: no daemon listens at the endpoint (connection refused, no socket file)
    FORBIDDEN = 13  # not allowed over this transport (e.g. shared-memory registration or flush over tcp://)
    TIER_UNAVAILABLE = 14  # a remote tier (L3) failed or is unreachable; what the other tiers could do was done
    BACKPRESSURE = 15  # client side only: the daemon takes no bytes (its connection's outbox is full or stalled);
    # the request was not sent, or was dropped with the outbox
    DEADLINE = 16  # a CPU engine's transfer reached its deadline (`Store.deadline_ns`) before its copy began, or
    # a store's copy ended after it: nothing was committed; the engine may reuse the blocks


class KVDepotError(Exception):
    """An error reply from the daemon (or a client-side timeout), with its `ErrorCode`.

    Attributes:
        code: the `ErrorCode`.
        message: human-readable text naming what to change.
    """

    def __init__(self, code: ErrorCode | int, message: str) -> None:
        try:
            code = ErrorCode(code)
        except ValueError:
            pass
        self.code = code
        self.message = message
        name = code.name if isinstance(code, ErrorCode) else str(code)
        super().__init__(f"[{name}] {message}")


class RequestError(KVDepotError):
    """Raised inside the daemon by request handlers; turned into an `ErrorReply`."""
