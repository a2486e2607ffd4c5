"""deploy/prometheus with promtool (Debian package ``prometheus``): the rules and the example
configuration are valid, and ``promtool test rules`` proves when each alert fires and when it
stays quiet (kvdepot-rules.test.yml; kvdepot-vllm-rules.test.yml for the alerts on the
connector's counters in vLLM's /metrics). The same rules against a live Prometheus scraping a real
daemon: tests/integration/test_prometheus_live.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROM = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def promtool(*args: str) -> str:
    exe = shutil.which("promtool")
    if exe is None:
        if os.environ.get("KVDEPOT_REQUIRE_TOOLS") == "1":
            pytest.fail("promtool is not installed (apt-get install prometheus)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    r = subprocess.run([exe, *args], cwd=PROM, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


RULE_FILES = ["kvdepot-rules.yml", "kvdepot-vllm-rules.yml"]  # the daemon's series; the connector's in vLLM's


@pytest.mark.parametrize("rules", RULE_FILES)
def test_rules_are_valid(rules):
    assert "SUCCESS" in promtool("check", "rules", rules)


def test_example_config_is_valid():
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")


@pytest.mark.parametrize("rules", RULE_FILES)
def test_alerts_fire_and_stay_quiet_as_specified(rules):
    unit_tests = rules.replace(".yml", ".test.yml")
    out = promtool("test", "rules", unit_tests)
    assert "SUCCESS" in out and "FAILED" not in out, out
    # every alert has a unit test that expects it to fire
    alerts = {r["alert"] for g in yaml.safe_load((PROM / rules).read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((PROM / unit_tests).read_text())["tests"]
    fired = {a["alertname"] for t in tests for a in t.get("alert_rule_test", []) if a["exp_alerts"]}
    assert alerts == fired, alerts ^ fired
