"""Every Prometheus metric of the daemon (one module, one registry per daemon).

Conventions (prometheus-client): ``kvdepot_`` prefix, base units, counters end in ``_total``
(the client library appends it), ratios are left to PromQL, e.g. the prefix hit rate::

    rate(kvdepot_lookup_hit_tokens_total[5m]) / rate(kvdepot_lookup_requested_tokens_total[5m])

Labels come from small fixed sets only: ``model`` (registered model names), ``op``
(store | retrieve), ``tier`` (l1), ``tenant`` (the salts named in ``--tenant-quota``, ``(none)``,
``other``), ``code`` (ErrorCode names), ``reason`` (why a store skipped
chunks, why a registration was reclaimed), ``type`` (request message types). Never request ids or hashes. Every series exists (at 0) from the moment it can: per
op, tier, code and reason when the daemon starts (`Metrics.start`), per model at the model's
first registration (`Metrics.add_model`). The HTTP side is `kvdepot.server.http`.

Values are plain Python numbers that the event loop updates, and prometheus-client reads them
at scrape time through a custom collector (its documented way for values kept elsewhere).
prometheus-client's own ``Counter`` / ``Histogram`` take a lock per update (about 1 us each on
a server CPU, several per request); these updates are an attribute increment. Only the loop
thread updates them; a scrape (prometheus-client's HTTP thread) reads numbers the GIL keeps
whole, so a scrape sees every update made before it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.gc_collector import GCCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

OPS = ("store", "retrieve")  # values of the ``op`` label
RECLAIM_REASONS = ("connection_closed", "pid_exited")  # values of kvdepot_engines_reclaimed's ``reason``
_TRANSFER_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)


class CounterCell:
    """One labelled series of a counter."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (>= 0; counters only go up).

        Raises:
            ValueError: a negative amount.
        """
        if amount < 0:
            raise ValueError(f"counters only increase; got {amount}")
        self.value += amount


class GaugeCell:
    """One labelled series of a gauge: a value, or a function read at scrape time."""

    __slots__ = ("value", "fn")

    def __init__(self) -> None:
        self.value = 0.0
        self.fn: Callable[[], float] | None = None

    def set(self, value: float) -> None:
        self.value = float(value)
        self.fn = None

    def set_function(self, fn: Callable[[], float]) -> None:
        """Report ``fn()`` at each scrape instead of a stored value."""
        self.fn = fn

    def get(self) -> float:
        return float(self.fn()) if self.fn is not None else self.value


class HistogramCell:
    """One labelled series of a histogram: per-bucket counts (upper bounds inclusive, as
    Prometheus' ``le``) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class _Family:
    """A metric with label names; ``labels(*values)`` gives (creating on first use) its series."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), make=CounterCell) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._make = make
        self.cells: dict[tuple[str, ...], object] = {}

    def labels(self, *values: str):
        """The series of these label values (as many as the label names).

        Raises:
            ValueError: a different number of values than label names.
        """
        cell = self.cells.get(values)
        if cell is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, got {len(values)}")
            key = tuple(str(v) for v in values)
            cell = self.cells.get(key)
            if cell is None:
                cell = self.cells[key] = self._make()
        return cell

    def series(self) -> list[tuple[tuple[str, ...], object]]:
        return list(self.cells.items())  # one C-level copy: safe against the loop adding a series


class _FnCounterCell:
    """A counter series read from a function at scrape time (a count kept elsewhere)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], float]) -> None:
        self.fn = fn

    @property
    def value(self) -> float:
        return float(self.fn())


class CounterFamily(_Family):
    def set_function(self, values: tuple[str, ...], fn: Callable[[], float]) -> None:
        """Report ``fn()`` (a count that only grows, kept elsewhere) as the series of ``values``."""
        self.cells[tuple(str(v) for v in values)] = _FnCounterCell(fn)

    def collect(self) -> Metric:
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, cell in self.series():
            fam.add_metric(list(values), cell.value)
        return fam


class GaugeFamily(_Family):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames, GaugeCell)

    def set(self, value: float) -> None:
        """Set the series of a gauge without labels."""
        self.labels().set(value)

    def collect(self) -> Metric:
        fam = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, cell in self.series():
            fam.add_metric(list(values), cell.get())
        return fam


class HistogramFamily(_Family):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        bounds = tuple(sorted(float(b) for b in buckets if not math.isinf(b)))
        super().__init__(name, documentation, labelnames, lambda: HistogramCell(bounds))
        self._le = [floatToGoString(b) for b in bounds] + ["+Inf"]

    def collect(self) -> Metric:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, cell in self.series():
            counts, total = list(cell.counts), cell.sum
            cum, buckets = 0, []
            for le, c in zip(self._le, counts):
                cum += c
                buckets.append((le, cum))
            fam.add_metric(list(values), buckets, total)
        return fam


class _Collector(Collector):
    def __init__(self, families: Sequence[_Family]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for f in self.families:
            yield f.collect()


class Metrics:
    """The daemon's metrics in their own `CollectorRegistry` (so tests can run several daemons
    in one process). Update them from the event loop thread only."""

    def __init__(self) -> None:
        self.lookup_requested_tokens = CounterFamily(
            "kvdepot_lookup_requested_tokens", "Prompt tokens asked about by lookups.", ["model"])
        self.lookup_hit_tokens = CounterFamily(
            "kvdepot_lookup_hit_tokens", "Leading prompt tokens found cached by lookups.", ["model"])
        self.lookups = CounterFamily("kvdepot_lookups", "Lookup requests.", ["model"])
        self.tokens = CounterFamily(
            "kvdepot_transferred_tokens", "Tokens copied between engines and the daemon.", ["model", "op"])
        self.bytes = CounterFamily(
            "kvdepot_transferred_bytes", "Bytes copied between engines and the daemon.", ["model", "op"])
        self.transfer_seconds = HistogramFamily(
            "kvdepot_transfer_seconds", "Time of one store/retrieve request's copies.", ["op"], _TRANSFER_BUCKETS_S)
        self.tier_used_bytes = GaugeFamily("kvdepot_tier_used_bytes", "Bytes held by cached objects.", ["tier"])
        self.tier_capacity_bytes = GaugeFamily("kvdepot_tier_capacity_bytes", "Capacity of a tier.", ["tier"])
        self.tier_objects = GaugeFamily("kvdepot_tier_objects", "Cached chunk objects.", ["tier"])
        self.evictions = CounterFamily("kvdepot_evictions", "Chunk objects evicted.", ["tier"])
        self.tier_hits = CounterFamily(
            "kvdepot_tier_hit_chunks", "Chunks lookups found, by the fastest tier holding them.", ["tier"])
        self.tier_read_bytes = CounterFamily("kvdepot_tier_read_bytes", "Bytes read from a lower tier.", ["tier"])
        self.tier_written_bytes = CounterFamily(
            "kvdepot_tier_written_bytes", "Bytes written to a lower tier.", ["tier"])
        self.tier_queue_depth = GaugeFamily(
            "kvdepot_tier_queue_depth", "Writes to a lower tier queued or in progress.", ["tier"])
        self.tier_dropped_writes = CounterFamily(
            "kvdepot_tier_dropped_writes", "Writes to a lower tier not made (queue full, no room).", ["tier"])
        self.tier_errors = CounterFamily(
            "kvdepot_tier_errors", "I/O errors of a lower tier (the object is dropped, never served).", ["tier"])
        self.corrupt_objects = CounterFamily(
            "kvdepot_corrupt_objects", "Objects that failed verification (torn, truncated, stale or flipped "
            "bytes): dropped, never served.", ["tier"])
        self.tenant_used_bytes = GaugeFamily(
            "kvdepot_tenant_used_bytes", "Bytes of a tenant's (cache_salt's) cached objects in a tier; tenant: the "
            "salts named in --tenant-quota, (none) for requests without a salt, other for the rest.",
            ["tier", "tenant"])
        self.tenant_quota_bytes = GaugeFamily(
            "kvdepot_tenant_quota_bytes", "A tenant's quota in a tier (other: each unnamed salt's); 0 = none.",
            ["tier", "tenant"])
        self.tenant_quota_evictions = CounterFamily(
            "kvdepot_tenant_quota_evictions", "Objects evicted to keep their tenant within its quota.",
            ["tier", "tenant"])
        self.store_skipped_chunks = CounterFamily(
            "kvdepot_store_skipped_chunks", "Chunks a store could not keep (parent missing or tier full).",
            ["reason"])
        self.requests = CounterFamily("kvdepot_requests", "Requests received, by message type (lookup, store, "
                                      "retrieve, register, ...); undecodable ones count as MALFORMED errors only.",
                                      ["type"])
        self.errors = CounterFamily("kvdepot_errors", "Error replies sent, and store copies that failed after an "
                                    "early reply.", ["code"])
        self.registered_engines = GaugeFamily("kvdepot_registered_engines", "Live engine registrations.")
        self.registered_engines.set(0)
        self.stuck_transfers = GaugeFamily(
            "kvdepot_stuck_transfers", "Copies past the watchdog's deadline that have not ended yet (a hung GPU or "
            "copy thread; kvdepot.server.watchdog).")
        self.stuck_transfers.set(0)  # a function of the daemon's copies in flight once it runs
        self.transfers_stuck = CounterFamily(
            "kvdepot_transfers_stuck", "Copies the watchdog declared stuck (their requests were answered TIMEOUT).",
            ["op"])
        for op in OPS:
            self.transfers_stuck.labels(op)
        self.engines_reclaimed = CounterFamily(
            "kvdepot_engines_reclaimed", "Registrations reclaimed without an unregister: the engine's connection "
            "closed (connection_closed) or its watched pid exited (pid_exited).", ["reason"])
        for reason in RECLAIM_REASONS:
            self.engines_reclaimed.labels(reason)
        self.build_info = GaugeFamily(
            "kvdepot_build_info", "Always 1: the daemon's version, wire protocol version and where its CUDA "
            "kernels come from (see kvdepot.gpu.kernels.kernels_source).", ["version", "protocol", "kernels"])
        self.gc_pause_seconds = CounterFamily(
            "kvdepot_gc_pause_seconds", "Seconds in Python's garbage collections, by generation (2: full): the "
            "event loop answers nothing meanwhile (kvdepot.server.gcpause).", ["generation"])
        self.registry = CollectorRegistry()
        self.registry.register(_Collector([v for v in vars(self).values() if isinstance(v, _Family)]))
        GCCollector(registry=self.registry)  # python_gc_collections_total etc., by generation

    def start(self, version: str, protocol: int, kernels: str, tiers: Sequence[str], error_codes: Sequence[str],
              skip_reasons: Sequence[str], unsized: Sequence[str] = ()) -> None:
        """Create every series that does not depend on a model at zero, so that dashboards and
        alerts see 0 rather than "no data" before the first event: per op, per tier, per error
        code and per store-skip reason; and ``kvdepot_build_info``."""
        self.build_info.labels(version, str(protocol), kernels).set(1)
        for op in OPS:
            self.transfer_seconds.labels(op)
        for tier in tiers:  # ``unsized``: tiers whose use and capacity are the server's (L3)
            for fam in (self.tier_hits,) if tier in unsized else (
                    self.evictions, self.tier_used_bytes, self.tier_capacity_bytes, self.tier_objects, self.tier_hits):
                fam.labels(tier)
            if tier != "l1":
                for fam in (self.tier_read_bytes, self.tier_written_bytes, self.tier_queue_depth,
                            self.tier_dropped_writes, self.tier_errors, self.corrupt_objects):
                    fam.labels(tier)
        for code in error_codes:
            self.errors.labels(code)
        for reason in skip_reasons:
            self.store_skipped_chunks.labels(reason)

    def add_model(self, model: str) -> None:
        """Create a model's series at zero (at its first registration)."""
        for fam in (self.lookups, self.lookup_requested_tokens, self.lookup_hit_tokens):
            fam.labels(model)
        for op in OPS:
            self.tokens.labels(model, op)
            self.bytes.labels(model, op)
