"""The daemon's HTTP endpoints, for Prometheus and for Kubernetes-style probes.

=============  =====================================================================================
``/metrics``   Prometheus exposition of the daemon's registry (text format, or OpenMetrics when the
               scraper asks for it in ``Accept``), through prometheus-client's own encoders.
``/healthz``   liveness: 200 while the daemon's event loop turns (it ticks at least once a second);
               503 once it has not for ``stall_s`` (a wedged daemon, to be restarted).
``/readyz``    readiness: 200 once the L1 pool is reserved and every endpoint's sockets are bound,
               503 before that and after shutdown began.
anything else  404.
=============  =====================================================================================

``HEAD`` is answered like ``GET`` without a body. The server runs in daemon threads of its own
(`http.server.ThreadingHTTPServer`): a slow scraper never blocks the event loop, and the
handlers only read numbers the loop keeps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger("kvdepot.http")

# a probe: (ok, one line saying why)
Probe = Callable[[], tuple[bool, str]]


class HttpEndpoints:
    """``/metrics``, ``/healthz`` and ``/readyz`` on one port.

    Args:
        registry: what ``/metrics`` exposes.
        healthy: the liveness probe.
        ready: the readiness probe.
    """

    def __init__(self, registry: CollectorRegistry, healthy: Probe, ready: Probe) -> None:
        self.registry, self.healthy, self.ready = registry, healthy, ready
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Listen on ``addr:port`` (port 0: any free port) in a background thread; returns the
        bound port.

        Raises:
            OSError: the address cannot be bound (e.g. the port is taken).
        """
        endpoints = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "kvdepot"
            protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses its connection

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                self._answer(body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                self._answer(body=False)

            def _answer(self, body: bool) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    encoder, content_type = choose_encoder(self.headers.get("Accept"))
                    self._send(200, content_type, encoder(endpoints.registry), body)
                elif path in ("/healthz", "/readyz"):
                    ok, why = (endpoints.healthy if path == "/healthz" else endpoints.ready)()
                    self._send(200 if ok else 503, "text/plain; charset=utf-8", f"{why}\n".encode(), body)
                else:
                    self._send(404, "text/plain; charset=utf-8",
                               b"not found: kvdepot serves /metrics, /healthz and /readyz\n", body)

            def _send(self, status: int, content_type: str, payload: bytes, body: bool) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if body:
                    self.wfile.write(payload)

            def log_message(self, fmt: str, *args) -> None:
                log.debug("%s %s", self.address_string(), fmt % args)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((addr, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvdepot-http", daemon=True)
        self._thread.start()
        return self._server.server_address[1]

    def close(self) -> None:
        """Stop listening (waits for the serving thread)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
