"""deploy/prometheus with promtool (Debian package ``prometheus``): the rules and the example
configuration are valid, and ``promtool test rules`` proves when each alert fires and when it
stays quiet (kvdepot-rules.test.yml). The same rules against a live Prometheus scraping a real
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


def test_rules_are_valid():
    assert "SUCCESS" in promtool("check", "rules", "kvdepot-rules.yml")


def test_example_config_is_valid():
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")


def test_alerts_fire_and_stay_quiet_as_specified():
    out = promtool("test", "rules", "kvdepot-rules.test.yml")
    assert "SUCCESS" in out and "FAILED" not in out, out
    # every alert has a unit test that expects it to fire
    alerts = {r["alert"] for g in yaml.safe_load((PROM / "kvdepot-rules.yml").read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((PROM / "kvdepot-rules.test.yml").read_text())["tests"]
    fired = {a["alertname"] for t in tests for a in t.get("alert_rule_test", []) if a["exp_alerts"]}
    assert alerts == fired, alerts ^ fired
