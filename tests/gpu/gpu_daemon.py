"""The daemon the GPU test modules run against."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


def serve(workdir: Path, l1_bytes: str, with_process: bool = False) -> Iterator:
    """Run `kvdepot serve` in ``workdir`` for a module's (or a test's) tests; yields its endpoint
    (``with_process``: ``(endpoint, Popen)``, for a test that kills it), then checks a clean exit
    (status 0 unless the test killed it, no traceback logged)."""
    ep = f"ipc://{workdir / 'kvdepot.sock'}"
    log = open(workdir / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvdepot", "serve", "--endpoint", ep, "--l1-bytes", l1_bytes],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=dict(os.environ))
    assert "ready" in proc.stdout.readline(), (workdir / "daemon.log").read_text()
    yield (ep, proc) if with_process else ep
    killed = proc.poll() is not None
    if not killed:
        proc.terminate()
    rc = proc.wait(30)
    proc.stdout.close()
    log.close()
    text = (workdir / "daemon.log").read_text()
    assert (killed or rc == 0) and "Traceback" not in text, text
