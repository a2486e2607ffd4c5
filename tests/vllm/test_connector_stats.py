"""The worker's counters reach vLLM's own KV-connector metrics: through vLLM's model-runner
mixin (``get_kv_connector_stats``), its scheduler (``make_stats``), and its front-end's log line
(``KVConnectorLogging``) and Prometheus collector (``KVConnectorProm``), all vLLM's real code."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm  # noqa: E402

from connector_testing import collect_scheduler_stats  # noqa: E402
from kvdepot.client.vllm import stats as kvstats  # noqa: E402
from kvdepot.client.vllm.connector import KVDepotConnector  # noqa: E402

CHUNK = 64


def test_worker_counters_reach_vllms_log_line_and_prometheus(daemon, tmp_path, monkeypatch):
    monkeypatch.setattr(kvstats, "EMIT_INTERVAL_S", 0.0)  # every step that changed something
    model = H.model_dir(tmp_path)
    stores = H.Engine(H.make_vllm_config(model, daemon.endpoint, chunk_size=CHUNK,
                                         extra={"model_id": "stats"}), H.dense_specs())
    loads = H.Engine(H.make_vllm_config(model, daemon.endpoint, chunk_size=CHUNK,
                                        extra={"model_id": "stats"}), H.dense_specs())
    try:
        emitted = collect_scheduler_stats(stores)
        emitted_b = collect_scheduler_stats(loads)
        prompt = H.tokens(5, 200)  # 3 whole chunks
        stores.add(prompt, max_tokens=2)
        stores.run()
        loads.add(prompt, max_tokens=2)
        loads.run()
        assert emitted and emitted_b, "vLLM's scheduler passed no kvdepot stats on"
        for e, got in ((stores, emitted), (loads, emitted_b)):
            last = e.worker_conn.get_kv_connector_stats()  # what the last steps left unreported
            if last is not None:
                got.append(last.data)
        ws, wl = stores.worker_conn.stats, loads.worker_conn.stats
        assert ws["stored_chunks"] == 3 and wl["loaded_chunks"] == 3

        # vLLM's front end rebuilds and sums the dicts: every counter's increases add up to it
        # (the scheduler side's counters too: vLLM adds them to the workers')
        for got, e in ((emitted, stores), (emitted_b, loads)):
            left = e.sched_conn.get_kv_connector_stats()
            if left is not None:
                got.append(left.data)
            w = {**e.sched_conn.stats, **e.worker_conn.stats}
            total = KVDepotConnector.build_kv_connector_stats()
            for d in got:
                total = total.aggregate(KVDepotConnector.build_kv_connector_stats(d))
            for k in kvstats.COUNTERS:
                assert total.data.get(k, 0) == pytest.approx(w[k]), k

        ktc = stores.scheduler.vllm_config.kv_transfer_config
        logging_ = KVConnectorLogging(ktc)
        for d in emitted + emitted_b:
            logging_.observe(d)
        lines: list[str] = []
        logging_.log(lambda fmt, *a: lines.append(fmt % a))
        assert len(lines) == 1 and "stored_chunks=3" in lines[0] and "loaded_chunks=3" in lines[0], lines

        registry = CollectorRegistry()

        class Prom(KVConnectorProm):  # vLLM's, registering into a registry of this test's own
            _gauge_cls = functools.partial(Gauge, registry=registry)
            _counter_cls = functools.partial(Counter, registry=registry)
            _histogram_cls = functools.partial(Histogram, registry=registry)

        prom = Prom(stores.scheduler.vllm_config, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
        for d in emitted:
            prom.observe(d, 0)
        for d in emitted_b:
            prom.observe(d, 1)

        def sample(name, engine):
            return registry.get_sample_value(name, {"model_name": "m", "engine": engine})

        assert sample("vllm:kvdepot_stored_chunks_total", "0") == 3
        assert sample("vllm:kvdepot_loaded_chunks_total", "1") == 3
        assert sample("vllm:kvdepot_loaded_chunks_total", "0") is None  # engine 0 loaded nothing
        assert sample("vllm:kvdepot_stores_total", "0") == ws["stores"] > 0
    finally:
        stores.close()
        loads.close()


def test_stats_go_out_at_most_once_per_interval_and_only_what_changed(monkeypatch):
    counters = {"stored_chunks": 0, "loads": 0}
    clock = [100.0]
    monkeypatch.setattr(kvstats, "monotonic", lambda: clock[0])
    taker = kvstats.StatsTaker(counters)
    assert taker.take() is None  # nothing yet
    counters["stored_chunks"] = 5
    assert taker.take() is None  # within the interval of the last look
    clock[0] += kvstats.EMIT_INTERVAL_S
    got = taker.take()
    assert got.data == {"stored_chunks": 5}
    counters["stored_chunks"] = 7
    counters["loads"] = 1
    clock[0] += kvstats.EMIT_INTERVAL_S
    assert taker.take().data == {"stored_chunks": 2, "loads": 1}
    a = kvstats.KVDepotStats(data={"stored_chunks": 2})
    assert a.aggregate(kvstats.KVDepotStats(data={"stored_chunks": 3, "loads": 1})).data == {
        "stored_chunks": 5, "loads": 1}
    assert kvstats.KVDepotStats().is_empty() and not a.is_empty()


def test_a_key_from_a_newer_kvdepot_is_ignored_by_prometheus():
    registry = CollectorRegistry()
    types = {Counter: functools.partial(Counter, registry=registry), Gauge: functools.partial(Gauge, registry=registry),
             Histogram: functools.partial(Histogram, registry=registry)}
    cfg = type("Cfg", (), {"kv_transfer_config": None})()
    prom = KVDepotConnector.build_prom_metrics(cfg, types, ["engine"], {0: ["0"]})
    prom.observe({"stored_chunks": 2, "something_new": 9}, 0)
    assert registry.get_sample_value("vllm:kvdepot_stored_chunks_total", {"engine": "0"}) == 2


def test_the_schedulers_pins_go_out_at_once_when_none_is_held_any_more(monkeypatch):
    """The scheduler's pin counters: within the interval only once every pin is let go again
    (vLLM asks only while it steps: an engine idle after a burst must not show pins held)."""
    counters = {"blocks_pinned": 0, "blocks_unpinned": 0}
    clock = [100.0]
    monkeypatch.setattr(kvstats, "monotonic", lambda: clock[0])
    taker = kvstats.StatsTaker(counters, balanced=("blocks_pinned", "blocks_unpinned"))
    assert taker.take() is None
    counters["blocks_pinned"] = 256
    clock[0] += kvstats.EMIT_INTERVAL_S
    assert taker.take().data == {"blocks_pinned": 256}
    counters["blocks_pinned"] = 512
    counters["blocks_unpinned"] = 256
    assert taker.take() is None  # some still held: within the interval
    counters["blocks_unpinned"] = 512
    assert taker.take().data == {"blocks_pinned": 256, "blocks_unpinned": 512}  # none held: at once
    assert taker.take() is None  # nothing new
