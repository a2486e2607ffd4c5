"""The daemon's metrics: plain numbers updated on the loop, read by prometheus-client at scrape time."""

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvdepot.server.metrics import Metrics


def samples(metrics: Metrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_counters_gauges_and_histograms_as_prometheus_sees_them():
    mt = Metrics()
    mt.lookups.labels("m1").inc()
    mt.lookups.labels("m1").inc(2)
    mt.bytes.labels("m1", "store").inc(4096)
    mt.tier_capacity_bytes.labels("l1").set(1 << 30)
    used = [10]
    mt.tier_used_bytes.labels("l1").set_function(lambda: used[0])
    mt.registered_engines.set(3)
    h = mt.transfer_seconds.labels("store")
    for v in (5e-5, 1e-4, 3e-4, 7.0):  # 1e-4 lands in the le="0.0001" bucket (upper bounds are inclusive)
        h.observe(v)
    used[0] = 20  # read at scrape time
    got = samples(mt)
    assert got[("kvdepot_lookups_total", frozenset({("model", "m1")}))] == 3
    assert got[("kvdepot_transferred_bytes_total", frozenset({("model", "m1"), ("op", "store")}))] == 4096
    assert got[("kvdepot_tier_capacity_bytes", frozenset({("tier", "l1")}))] == 1 << 30
    assert got[("kvdepot_tier_used_bytes", frozenset({("tier", "l1")}))] == 20
    assert got[("kvdepot_registered_engines", frozenset())] == 3
    op = ("op", "store")
    assert got[("kvdepot_transfer_seconds_bucket", frozenset({op, ("le", "0.0001")}))] == 2
    assert got[("kvdepot_transfer_seconds_bucket", frozenset({op, ("le", "0.0005")}))] == 3
    assert got[("kvdepot_transfer_seconds_bucket", frozenset({op, ("le", "2.5")}))] == 3
    assert got[("kvdepot_transfer_seconds_bucket", frozenset({op, ("le", "+Inf")}))] == 4
    assert got[("kvdepot_transfer_seconds_count", frozenset({op}))] == 4
    assert got[("kvdepot_transfer_seconds_sum", frozenset({op}))] == pytest.approx(7.00045)
    # a series appears once it is used; an unused label set is absent
    assert ("kvdepot_lookups_total", frozenset({("model", "m2")})) not in got


def test_label_misuse_and_negative_counts_are_refused():
    mt = Metrics()
    with pytest.raises(ValueError):
        mt.bytes.labels("only-model")
    with pytest.raises(ValueError):
        mt.lookups.labels("m").inc(-1)
    assert mt.lookups.labels("m") is mt.lookups.labels("m")  # one series per label set
