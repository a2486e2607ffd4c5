"""The daemon the GPU test modules run against."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


def serve(workdir: Path, l1_bytes: str) -> Iterator[str]:
    """Run `kvdepot serve` in ``workdir`` for a module's tests; yields its endpoint, then checks
    a clean exit (status 0, no traceback logged)."""
    ep = f"ipc://{workdir / 'kvdepot.sock'}"
    log = open(workdir / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvdepot", "serve", "--endpoint", ep, "--l1-bytes", l1_bytes],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=dict(os.environ))
    assert "ready" in proc.stdout.readline(), (workdir / "daemon.log").read_text()
    yield ep
    proc.terminate()
    rc = proc.wait(30)
    proc.stdout.close()
    log.close()
    text = (workdir / "daemon.log").read_text()
    assert rc == 0 and "Traceback" not in text, text
