"""Shared by the test directories that spawn `kvdepot serve`: stopping it and checking that it
stopped cleanly (importable because pytest puts tests/ on sys.path for tests/conftest.py)."""

from __future__ import annotations

import signal
import socket
import subprocess
from collections.abc import Callable

import pytest

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
