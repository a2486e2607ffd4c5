"""Shared by the test directories that spawn `kvdepot serve`: stopping it and checking that it
stopped cleanly (importable because pytest puts tests/ on sys.path for tests/conftest.py)."""

from __future__ import annotations

import signal
import socket
import subprocess
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

STOP_TIMEOUT_S = 15.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_daemon(proc: subprocess.Popen, log: Callable[[], str]) -> str:
    """SIGTERM ``proc`` (if running), fail the test if it does not exit within STOP_TIMEOUT_S or
    logged a traceback; returns the log."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"daemon did not stop within {STOP_TIMEOUT_S} s; log:\n{log()}")
    text = log()
    assert "Traceback" not in text, f"daemon logged a traceback:\n{text}"
    return text


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """``{(sample name, labels): value}`` of the daemon's /metrics on 127.0.0.1:``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(samples, name: str, **labels: str) -> float:
    """One sample of `scrape`'s result (0 when absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)
