"""Every Prometheus metric of the daemon (one module, one registry per daemon).

Conventions (prometheus-client): ``kvdepot_`` prefix, base units, counters end in ``_total``
(the client library appends it), ratios are left to PromQL, e.g. the prefix hit rate::

    rate(kvdepot_lookup_hit_tokens_total[5m]) / rate(kvdepot_lookup_requested_tokens_total[5m])

Labels come from small fixed sets only: ``model`` (registered model names), ``op``
(store | retrieve), ``tier`` (l1), ``code`` (ErrorCode names). Never request ids or hashes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_TRANSFER_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The daemon's metrics in their own `CollectorRegistry` (so tests can run several daemons
    in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.lookup_requested_tokens = Counter(
            "kvdepot_lookup_requested_tokens", "Prompt tokens asked about by lookups.", ["model"], registry=r)
        self.lookup_hit_tokens = Counter(
            "kvdepot_lookup_hit_tokens", "Leading prompt tokens found cached by lookups.", ["model"], registry=r)
        self.lookups = Counter("kvdepot_lookups", "Lookup requests.", ["model"], registry=r)
        self.tokens = Counter(
            "kvdepot_transferred_tokens", "Tokens copied between engines and the daemon.", ["model", "op"], registry=r)
        self.bytes = Counter(
            "kvdepot_transferred_bytes", "Bytes copied between engines and the daemon.", ["model", "op"], registry=r)
        self.transfer_seconds = Histogram(
            "kvdepot_transfer_seconds", "Time of one store/retrieve request's copies.", ["op"],
            buckets=_TRANSFER_BUCKETS_S, registry=r)
        self.tier_used_bytes = Gauge("kvdepot_tier_used_bytes", "Bytes held by cached objects.", ["tier"], registry=r)
        self.tier_capacity_bytes = Gauge("kvdepot_tier_capacity_bytes", "Capacity of a tier.", ["tier"], registry=r)
        self.tier_objects = Gauge("kvdepot_tier_objects", "Cached chunk objects.", ["tier"], registry=r)
        self.evictions = Counter("kvdepot_evictions", "Chunk objects evicted.", ["tier"], registry=r)
        self.store_skipped_chunks = Counter(
            "kvdepot_store_skipped_chunks", "Chunks a store could not keep (parent missing or tier full).",
            ["reason"], registry=r)
        self.errors = Counter("kvdepot_errors", "Error replies sent, and store copies that failed after an early reply.",
                              ["code"], registry=r)
        self.registered_engines = Gauge("kvdepot_registered_engines", "Live engine registrations.", registry=r)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Expose ``/metrics`` on ``addr:port`` (a daemon thread of prometheus-client)."""
        start_http_server(port, addr=addr, registry=self.registry)
