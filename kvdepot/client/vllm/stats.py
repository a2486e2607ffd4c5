"""The worker's counters in vLLM's own KV-connector metrics: its log line ("KV Transfer metrics:
...") and its Prometheus endpoint (``vllm:kvdepot_*`` series beside vLLM's, labelled like
them). The daemon's own metrics (hit ratio, tiers, bytes held) are on the daemon's
``/metrics``; these say what the engine's side saw: chunks loaded and stored, loads that failed
(vLLM recomputed them), stores skipped on a full staging ring, transfers left unanswered.

How vLLM carries them (0.33): each step the model runner asks the worker's connector
`KVDepotConnector.get_kv_connector_stats`; vLLM's ``KVOutputAggregator`` sums the TP ranks'
(`KVDepotStats.aggregate`), the scheduler passes the dict on with its own stats, and the
front-end process rebuilds it (``build_kv_connector_stats``) for the log and feeds it to
``build_prom_metrics``'s object. A worker reports at most once per `EMIT_INTERVAL_S` and only
what changed, so a step costs one clock read; what a worker counted in its last second before
it exits may go unreported. Counts are per TP rank summed: a chunk stored by 4 ranks counts 4
(each stores its own shard). The scheduler side's counters (blocks pinned for sliding-window
stores) go the same way: vLLM's scheduler asks its connector too (``update_from_output``) and
adds them to the workers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import monotonic
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

EMIT_INTERVAL_S = 1.0  # a worker's stats go out at most this often

# worker counter (`WorkerConnector.stats`) or scheduler counter (`SchedulerConnector.stats`) -> (Prometheus
# counter, its help text)
COUNTERS: dict[str, tuple[str, str]] = {
    "loads": ("vllm:kvdepot_loads_total", "Load jobs (one per request and step) the kvdepot connector's workers began."),
    "load_failures": ("vllm:kvdepot_load_failures_total",
                      "Load jobs that ended short of what the scheduler planned; vLLM recomputed the rest."),
    "loaded_chunks": ("vllm:kvdepot_loaded_chunks_total",
                      "Chunks written into vLLM's KV blocks from the daemon (per TP rank: shard chunks)."),
    "stores": ("vllm:kvdepot_stores_total", "Store requests the daemon answered."),
    "stored_chunks": ("vllm:kvdepot_stored_chunks_total",
                      "Chunks the daemon took in as new (per TP rank: shard chunks)."),
    "store_failures": ("vllm:kvdepot_store_failures_total",
                       "Store pieces not stored: daemon down or refusing, request preempted, or an earlier "
                       "chunk of the request not stored."),
    "stores_skipped_ring_full": ("vllm:kvdepot_stores_skipped_ring_full_total",
                                 "Store pieces skipped because the staging ring had no room (sliding-window "
                                 "models at once; others after rpc_timeout_s). Raise staging_bytes if it grows."),
    "late_ops": ("vllm:kvdepot_late_transfers_total",
                 "Stores and retrieves unanswered within rpc_timeout_s (the daemon was then treated as down)."),
    "forwards_waiting_for_gathers": ("vllm:kvdepot_forwards_waiting_total",
                                     "Forwards that waited for an earlier store's gather (sliding-window models "
                                     "whose stores the transfer thread gathers)."),
    "thread_cpu_s": ("vllm:kvdepot_transfer_thread_cpu_seconds_total",
                     "CPU time of the workers' transfer threads (they share the engine process's GIL)."),
    # the scheduler side's (`SchedulerConnector.stats`)
    "blocks_pinned": ("vllm:kvdepot_blocks_pinned_total",
                      "Sliding-window KV blocks the scheduler pinned in vLLM's block pool for a store "
                      "(until every worker reported the save ended)."),
    "blocks_unpinned": ("vllm:kvdepot_blocks_unpinned_total",
                        "Pinned blocks let go again; pinned minus let go is what the connector holds now."),
}


@dataclass
class KVDepotStats(KVConnectorStats):
    """vLLM ``KVConnectorStats`` of the kvdepot connector: ``data`` maps a `COUNTERS` key to its
    increase over the interval (int, seconds for ``thread_cpu_s``); plain types only, so it
    crosses vLLM's process boundaries as is."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVDepotStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsTaker:
    """The increases of a side's counters since the last call that returned some, at most
    once per `EMIT_INTERVAL_S` (`take`). Engine thread only; a worker's counters are written
    by its transfer thread (a read sees a whole int or float).

    ``balanced`` (the scheduler's ``("blocks_pinned", "blocks_unpinned")``): once the two are
    equal again after a change, they go out at once, interval or not. vLLM asks only while it
    steps, so the last pins of a burst would otherwise stay unreported while the engine idles
    (and the held count, their difference, would show pins that are gone)."""

    def __init__(self, counters: dict[str, int | float], balanced: tuple[str, str] | None = None) -> None:
        self.counters = counters
        self.reported = {k: counters.get(k, 0) for k in COUNTERS}
        self.next_s = 0.0
        self.balanced = balanced

    def take(self) -> KVDepotStats | None:
        now = monotonic()
        if now < self.next_s and (self.balanced is None or not self._settled()):
            return None
        self.next_s = now + EMIT_INTERVAL_S
        got = {}
        for k, was in self.reported.items():
            v = self.counters.get(k, 0)
            if v != was:
                got[k] = v - was
                self.reported[k] = v
        return KVDepotStats(data=got) if got else None

    def _settled(self) -> bool:
        """The ``balanced`` pair is equal again and not reported so."""
        if self.balanced is None:
            return False
        a, b = self.balanced
        c = self.counters
        return c[a] == c[b] and c[b] != self.reported[b]


class KVDepotPromMetrics(KVConnectorPromMetrics):
    """The `COUNTERS` as Prometheus counters, with vLLM's per-engine labels (vLLM's
    ``KVConnectorProm`` makes one through ``build_prom_metrics`` and calls `observe`)."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {k: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
                          for k, (name, doc) in COUNTERS.items()}
        self._children: dict[tuple[int, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            counter = self._counters.get(k)
            if counter is None or v <= 0:
                continue  # a key of a newer kvdepot, or nothing to add
            child = self._children.get((engine_idx, k))
            if child is None:
                child = self._children[engine_idx, k] = counter.labels(*self.per_engine_labelvalues[engine_idx])
            child.inc(v)


__all__ = ["KVDepotStats", "KVDepotPromMetrics", "StatsTaker", "COUNTERS", "EMIT_INTERVAL_S"]
