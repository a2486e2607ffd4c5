"""ZMQ sockets: the one place socket options are chosen.

Endpoints: ``ipc://PATH`` (default; the socket file is created mode 0600, so only the
daemon's user can talk to it) or ``tcp://127.0.0.1:PORT``.
"""

from __future__ import annotations

import os
import tempfile

import zmq

ENV_ENDPOINT = "KVDEPOT_ENDPOINT"  # default endpoint for `kvdepot serve` and clients

# Requests are small (KV bytes move through engine memory, not ZMQ); a deep queue absorbs
# bursts from many engines without dropping (ROUTER drops on HWM, so keep it high).
_HWM = 100_000


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
                identity: bytes | None = None) -> zmq.Socket:
    """Create a socket with kvdepot's options and bind or connect it.

    ``identity`` (DEALER): a fixed routing id, so a client that rebuilds its socket after a
    timeout keeps its pins and liveness record in the daemon (the ROUTER hands the id over).

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
