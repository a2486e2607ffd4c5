"""deploy/grafana/kvdepot-vllm.json against the real thing: the connector's counters go through
vLLM's own Prometheus collector (``KVConnectorProm``, wrapping `KVDepotConnector.build_prom_metrics`)
into a registry served over HTTP, a Prometheus server (the Debian package's binary) scrapes it
every second with the shipped scrape job (deploy/prometheus/prometheus.yml) while they grow,
and every panel's query returns finite data. The dashboard shows
every ``vllm:kvdepot_*`` counter the connector has (`kvdepot.client.vllm.stats.COUNTERS`), and
nothing else of ours.

Without a ``prometheus`` binary the live part is skipped, unless ``KVDEPOT_REQUIRE_TOOLS=1``
(tests/prometheus_server.py).
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402, F401  (installs vLLM's stubs before its metrics module)
import yaml  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: E402

from kvdepot.client.vllm import stats as kvstats  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvdepot-vllm.json"
SCRAPE = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RATE_WINDOW = "1m"  # stands for Grafana's $__rate_interval
sys.path.insert(0, str(ROOT / "tests"))
from daemon_proc import free_port  # noqa: E402
from prometheus_server import query, running_prometheus  # noqa: E402


def _panels() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_the_dashboard_shows_every_connector_counter_and_no_other():
    used = {name for _, expr in _panels() for name in re.findall(r"vllm:kvdepot_\w+", expr)}
    assert used == {name for name, _ in kvstats.COUNTERS.values()}
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert set(variables) == {"datasource", "model_name"}
    assert re.findall(r"vllm:kvdepot_\w+", variables["model_name"]["definition"])[0] in used
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_every_panel_has_data_from_the_connectors_counters_in_vllms_collector(tmp_path):
    registry = CollectorRegistry()

    class Prom(KVConnectorProm):  # vLLM's, registering into a registry of this test's own
        _gauge_cls = functools.partial(Gauge, registry=registry)
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    from vllm.config import KVTransferConfig

    cfg = type("Cfg", (), {})()
    cfg.kv_transfer_config = KVTransferConfig(kv_connector="KVDepotConnector", kv_role="kv_both",
                                              kv_connector_module_path="kvdepot.client.vllm")
    prom = Prom(cfg, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    # every counter moves (a worker's dict of increases, as KVDepotStats carries it)
    step = {k: (0.01 if k == "thread_cpu_s" else 2) for k in kvstats.COUNTERS}
    prom.observe(step, 0)
    prom.observe(step, 1)

    metrics_port = free_port()
    server, _thread = start_http_server(metrics_port, addr="127.0.0.1", registry=registry)
    # the shipped scrape job of vLLM, relabeling and all (prometheus_client 0.26 writes vllm:* as
    # vllm_* for this Prometheus 2.x; without the relabeling no panel would find its series)
    (job,) = [j for j in yaml.safe_load(SCRAPE.read_text())["scrape_configs"] if j["job_name"] == "vllm"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    conf = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": [job]}
    try:
        with running_prometheus(tmp_path, conf) as port:
            _check_panels(port, prom, step)
    finally:
        server.shutdown()
        server.server_close()


def _check_panels(port: int, prom, step: dict) -> None:
    deadline = time.monotonic() + 60
    while not query(port, 'count_over_time(up{job="vllm"}[1m]) >= 3'):
        assert time.monotonic() < deadline, "prometheus did not scrape the collector"
        time.sleep(0.3)
    for _ in range(6):  # the counters grow while Prometheus scrapes: every rate is positive
        prom.observe(step, 0)
        prom.observe(step, 1)
        time.sleep(0.7)
    time.sleep(1.5)
    empty, bad = [], []
    for title, expr in _panels():
        got = query(port, expr.replace('model_name=~"$model_name"', 'model_name=~".*"')
                     .replace("$__rate_interval", RATE_WINDOW))
        if not got:
            empty.append(title)
        for series in got:
            value = float(series["value"][1])
            if not math.isfinite(value) or value <= 0:
                bad.append((title, series))
    assert not empty, f"panels without data: {empty}"
    assert not bad, f"panels with non-positive or non-finite values: {bad}"
