"""A real Prometheus server for the tests that check shipped rules and dashboards against it
(the Debian package's binary on 127.0.0.1; importable because pytest puts tests/ on sys.path
for tests/conftest.py). Without a ``prometheus`` binary those tests are skipped, unless
``KVDEPOT_REQUIRE_TOOLS=1`` (CI's ``.ci/run`` installs the package and sets it): then they fail."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from daemon_proc import free_port


def prometheus_exe() -> str:
    """The ``prometheus`` binary (skips or fails the test without one, see the module docstring)."""
    exe = shutil.which("prometheus")
    if exe is None:
        if os.environ.get("KVDEPOT_REQUIRE_TOOLS") == "1":
            pytest.fail("prometheus is not installed (apt-get install prometheus)")
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    return exe


def query(port: int, expr: str) -> list[dict]:
    """The instant query's result vector (fails the test on an error answer)."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


@contextlib.contextmanager
def running_prometheus(workdir: Path, config: dict, ready_timeout_s: float = 60.0) -> Iterator[int]:
    """A Prometheus with ``config`` (its YAML as a dict) and its data under ``workdir``, ready to
    answer; yields its port and stops it after."""
    exe = prometheus_exe()
    port = free_port()
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    log_path = workdir / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([exe, f"--config.file={workdir / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + ready_timeout_s
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "prometheus did not become ready"
                time.sleep(0.2)
            yield port
        finally:
            proc.terminate()
            proc.wait(30)
