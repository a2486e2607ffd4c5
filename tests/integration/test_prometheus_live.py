"""deploy/prometheus and deploy/grafana against the real thing: a Prometheus server (the Debian
package's binary) on 127.0.0.1 scrapes a real daemon under load every second with the shipped
rules loaded, and every Grafana panel's query, every recording rule and every alert expression
returns data. Alert expressions are evaluated with their comparisons as ``bool`` (``> bool``):
a healthy daemon fires none, but each must still find the series it watches. When and how
the alerts fire is unit-tested by ``promtool test rules`` (tests/deploy/test_prometheus.py).

Without a ``prometheus`` binary the test is skipped, unless ``KVDEPOT_REQUIRE_TOOLS=1`` (CI's
``.ci/run`` installs the package and sets it), where it fails.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
import yaml

import kv_engine as ke
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import KVDepotError
from prometheus_server import query, running_prometheus

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "kvdepot-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvdepot.json"
RATE_WINDOW = "1m"  # stands for Grafana's $__rate_interval


def as_bool(expr: str) -> str:
    """``a > 0.5 and b == 0`` -> ``a > bool 0.5 and b == bool 0``."""
    return re.sub(r"\s(==|!=|>=|<=|>|<)\s", lambda mt: f" {mt.group(1)} bool ", " ".join(expr.split()))


def panel_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"].replace("$instance", ".*").replace("$__rate_interval", RATE_WINDOW))
            for p in dash["panels"] for t in p["targets"]]


def test_as_bool():
    assert as_bool("a > 0.5 and b  ==  0\n and c >= 1") == "a > bool 0.5 and b == bool 0 and c >= bool 1"


@pytest.fixture
def prometheus(tmp_path, daemon):
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "rule_files": [str(RULES)],
           "scrape_configs": [{"job_name": "kvdepot",
                               "static_configs": [{"targets": [f"127.0.0.1:{daemon.metrics_port}"]}]}]}
    with running_prometheus(tmp_path, cfg) as port:
        yield port


def _load(e: ke.Engine, seconds: float) -> dict:
    """Stores, lookups (half hits), retrieves and a few error replies for ``seconds``."""
    n = {"stored": 0, "retrieved": 0}
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        keys = e.keys(ke.prompt_tokens(6100 + i, 16 * 8))
        n["stored"] += e.client.store(e.reg, keys[:4], [[0, 1, 2, 3]]).stored
        e.client.lookup(keys, 16, num_tokens=16 * 8, model="prom-live")  # 4 of 8 chunks hit
        n["retrieved"] += e.client.retrieve(e.reg, keys[:4], [[8, 9, 10, 11]])
        if i % 10 == 0:
            with pytest.raises(KVDepotError):
                e.client.call(m.Unregister(rid=0, registration="nope"))
        i += 1
        time.sleep(0.01)
    return n


def test_dashboard_and_rules_have_data(daemon, prometheus):
    spec = ke.EngineSpec(daemon.endpoint, ke.SMOLLM2, "LBNHC", (16,), (64,), 16, 6100, model_id="prom-live")
    with ke.Engine(spec) as engine:  # registered throughout (else KVDepotEnginesGone would rightly match)
        _check_with_load(engine, prometheus)


def _check_with_load(engine: ke.Engine, prometheus: int) -> None:
    moved = _load(engine, 6.0)
    assert moved["stored"] > 0 and moved["retrieved"] > 0
    deadline = time.monotonic() + 30  # scrapes since the load, and the rules evaluated on them
    while not query(prometheus, 'count_over_time(up{job="kvdepot"}[1m]) >= 8') or \
            not query(prometheus, "kvdepot:lookup_hit_ratio:rate5m"):
        assert time.monotonic() < deadline, "prometheus did not scrape the daemon / evaluate the rules"
        time.sleep(0.5)
    assert query(prometheus, 'up{job="kvdepot"}')[0]["value"][1] == "1"

    empty = [title for title, expr in panel_queries() if not query(prometheus, expr)]
    assert not empty, f"panels without data: {empty}"
    # the panels of the traffic just made show it (finite, positive)
    for title, expr in panel_queries():
        if title in ("Prefix hit rate", "Bytes moved per second", "Tokens moved per second", "Transfer latency",
                     "Requests per second"):
            values = [float(r["value"][1]) for r in query(prometheus, expr)]
            assert any(math.isfinite(v) and v > 0 for v in values), (title, values)
    hit = [float(r["value"][1]) for r in query(prometheus, panel_queries()[0][1])]
    assert hit and all(0.4 <= v <= 0.6 for v in hit), hit  # 4 of 8 chunks of every lookup were cached

    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    missing = [r["record"] for r in rules if "record" in r and not query(prometheus, r["record"])]
    assert not missing, f"recording rules without data: {missing}"
    silent = [r["alert"] for r in rules if "alert" in r and not query(prometheus, as_bool(r["expr"]))]
    assert not silent, f"alert expressions that find no series: {silent}"
    firing = [r["alert"] for r in rules if "alert" in r and query(prometheus, r["expr"])]
    assert not firing, f"alerts firing on a healthy daemon: {firing}"
