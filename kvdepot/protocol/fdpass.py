"""Passing file descriptors to the daemon (``SCM_RIGHTS``): how a CPU engine hands over its
sealed KV-cache memfds (`kvdepot.gpu.shm.create_memfd`).

The daemon listens on ``PATH.fds`` beside an ``ipc://PATH`` endpoint (mode 0600, like its other
sockets). A client connects, sends one message: a token (16 to 64 ASCII bytes, random) with the
descriptors as ancillary data, and waits for one byte: ``0`` = kept, anything else = refused.
The `Register` message then names the token (`StorageSpec` kind ``memfd``); the daemon drops
descriptors nobody claimed within `TOKEN_TTL_S`.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Sequence

from kvdepot.protocol.errors import ErrorCode, KVDepotError

FDS_SUFFIX = ".fds"
TOKEN_TTL_S = 30.0  # descriptors passed but not claimed by a Register within this long are closed
MAX_FDS_PER_MESSAGE = 16
ACK_OK = b"\x00"


def fds_path(ipc_socket_path: str) -> str:
    """Path of the descriptor socket beside the daemon's ``ipc://`` socket file."""
    return ipc_socket_path + FDS_SUFFIX


def pass_fds(path: str, fds: Sequence[int], timeout_s: float = 5.0) -> str:
    """Send ``fds`` to the daemon's descriptor socket at ``path``; returns the token to name in
    the `Register` message.

    Raises:
        KVDepotError: UNAVAILABLE (no daemon there, or one that predates sealed memfds), TIMEOUT,
            ENGINE_MEMORY (the daemon refused them).
    """
    if not 0 < len(fds) <= MAX_FDS_PER_MESSAGE:
        raise ValueError(f"1..{MAX_FDS_PER_MESSAGE} descriptors per message, got {len(fds)}")
    token = secrets.token_hex(16)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(path)
            socket.send_fds(s, [token.encode()], list(fds))
            ack = s.recv(1)
        except (ConnectionRefusedError, FileNotFoundError):
            # no daemon (down, or starting), or one that predates sealed memfds: the caller retries
            raise KVDepotError(ErrorCode.UNAVAILABLE, f"no kvdepot daemon takes descriptors at {path} (not "
                                                      "running, or older than sealed memfds)") from None
        except TimeoutError:
            raise KVDepotError(ErrorCode.TIMEOUT, f"the daemon did not take the descriptors within {timeout_s} s") \
                from None
        except OSError as exc:
            raise KVDepotError(ErrorCode.UNAVAILABLE, f"passing descriptors to {path} failed: {exc}") from None
    if ack != ACK_OK:
        raise KVDepotError(ErrorCode.ENGINE_MEMORY, f"the daemon refused the descriptors (answer {ack!r})")
    return token
