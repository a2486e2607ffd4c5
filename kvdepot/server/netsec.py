"""``tcp://`` endpoints: who may reach the daemon over the network, and what they may ask.

* A ``tcp://`` endpoint bound to anything but a loopback address is refused at start unless
  ZeroMQ CURVE authentication is configured: the daemon's secret key (``--curve-secret-key``)
  and a directory of the public keys of the clients it accepts (``--curve-clients``), both
  written by ``kvdepot keygen``. A client whose key is not in the directory fails the CURVE
  handshake (pyzmq's ZAP authenticator): none of its messages reaches the daemon.
* ``tcp://`` endpoints get a ROUTER socket of their own (``ipc://`` ones never need CURVE), and
  the identity of a peer on it is tagged (`TCP_TAG`) so that it can never be taken for a local
  client's.
* What a tcp peer may ask (`authorize`): never a registration that names shared-memory segments
  (a remote client must not make the daemon map the host's ``/dev/shm``); a flush only when
  authenticated by CURVE. Everything else is as over ``ipc://``.

Clients (`kvdepot.client.KVDepotClient`, the CLI, the vLLM connector) use CURVE towards a
``tcp://`` endpoint when ``$KVDEPOT_CURVE_SERVER_KEY`` (the daemon's public key file) and
``$KVDEPOT_CURVE_CLIENT_KEY`` (their own secret key file) are set
(`kvdepot.protocol.transport.curve_client_options`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, RequestError

log = logging.getLogger("kvdepot.netsec")

TCP_TAG = b"\x00tcp\x00"  # prefix of the daemon-side identity of every tcp peer


@dataclasses.dataclass(frozen=True)
class CurveConfig:
    """The daemon's CURVE settings: its secret key file (``name.key_secret`` of ``kvdepot
    keygen``) and the directory of accepted clients' public key files (``*.key``)."""

    secret_key_file: str
    clients_dir: str


def tcp_host(endpoint: str) -> str:
    """The host part of ``tcp://HOST:PORT`` (brackets of an IPv6 literal removed)."""
    hostport = endpoint[len("tcp://"):]
    host = hostport.rsplit(":", 1)[0] if ":" in hostport else hostport
    return host.strip("[]")


def is_loopback(endpoint: str) -> bool:
    """Whether a ``tcp://`` endpoint binds only loopback addresses (127.0.0.0/8, ::1, or a name
    that resolves only to those); ``*`` and ``0.0.0.0`` are not."""
    host = tcp_host(endpoint)
    if host in ("*", ""):
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_endpoints(endpoints: Sequence[str], curve: CurveConfig | None) -> None:
    """Refuse a network-reachable tcp endpoint without authentication, and half a CURVE setup.

    Raises:
        ValueError: names the endpoint or the missing file and what to do.
    """
    if curve is not None:
        if not os.path.isfile(curve.secret_key_file):
            raise ValueError(f"--curve-secret-key {curve.secret_key_file}: no such file (kvdepot keygen makes one)")
        if not os.path.isdir(curve.clients_dir):
            raise ValueError(f"--curve-clients {curve.clients_dir}: no such directory of client public keys")
        return
    for ep in endpoints:
        if ep.startswith("tcp://") and not is_loopback(ep):
            raise ValueError(
                f"endpoint {ep} is reachable from other hosts and kvdepot has no authentication configured: "
                "pass --curve-secret-key and --curve-clients (keys from `kvdepot keygen`), or bind tcp://127.0.0.1")


class TcpFront:
    """The ROUTER socket of the daemon's ``tcp://`` endpoints, CURVE-authenticated when
    ``curve`` is given (a ZAP authenticator thread accepts the keys in ``curve.clients_dir``).

    Raises:
        ValueError: see `check_endpoints`; a key file that cannot be read.
        zmq.ZMQError: an endpoint cannot be bound.
    """

    def __init__(self, ctx: zmq.Context, endpoints: Sequence[str], curve: CurveConfig | None) -> None:
        from kvdepot.protocol.transport import make_socket

        check_endpoints(endpoints, curve)
        self.authenticated = curve is not None
        self._auth: ThreadAuthenticator | None = None
        options = {}
        if curve is not None:
            try:
                public, secret = zmq.auth.load_certificate(curve.secret_key_file)
            except (OSError, ValueError) as exc:
                raise ValueError(f"--curve-secret-key {curve.secret_key_file}: {exc}") from None
            if secret is None:
                raise ValueError(f"--curve-secret-key {curve.secret_key_file} holds no secret key "
                                 "(give the .key_secret file)")
            self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvdepot.zap"))
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(Path(curve.clients_dir)))
            options = {zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: secret, zmq.CURVE_PUBLICKEY: public}
        try:
            self.sock = make_socket(ctx, zmq.ROUTER, list(endpoints), bind=True, options=options)
        except BaseException:
            self.close()
            raise
        log.info("tcp endpoints %s: %s", ", ".join(endpoints),
                 "CURVE, clients of " + curve.clients_dir if curve else "loopback only, no authentication")

    def close(self) -> None:
        sock = getattr(self, "sock", None)
        if sock is not None:
            sock.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def authorize(req: m.Msg, authenticated: bool) -> None:
    """What a tcp peer may not ask.

    Raises:
        RequestError: FORBIDDEN.
    """
    if isinstance(req, m.Register) and any(s.kind in ("shm", "memfd") for s in req.storages):
        raise RequestError(ErrorCode.FORBIDDEN, "registrations of shared memory are refused over tcp:// "
                                                "(use the daemon's ipc:// endpoint on its host)")
    if isinstance(req, m.Flush) and not authenticated:
        raise RequestError(ErrorCode.FORBIDDEN, "flush over an unauthenticated tcp:// endpoint is refused "
                                                "(use ipc://, or configure CURVE keys)")


def keygen(directory: str, name: str) -> tuple[str, str]:
    """Write a CURVE key pair: ``directory/name.key`` (public, to hand out) and
    ``directory/name.key_secret`` (secret, mode 0600). Returns both paths.

    Raises:
        FileExistsError: either file exists already (keys are never overwritten).
    """
    d = Path(directory)
    public, secret = d / f"{name}.key", d / f"{name}.key_secret"
    for p in (public, secret):
        if p.exists():
            raise FileExistsError(f"{p} exists; keys are never overwritten")
    d.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)
    try:
        pub, sec = zmq.auth.create_certificates(str(d), name)
    finally:
        os.umask(old)
    os.chmod(sec, 0o600)
    return pub, sec
