"""Fixtures of the vLLM connector tests: a real `kvdepot serve` subprocess that can be stopped
and restarted on the same endpoint (new boot id), and the import-time warnings of vLLM.

The whole directory is skipped when vLLM is not installed (every test module starts with
``pytest.importorskip("vllm")``); vLLM 0.33 is installed with ``--no-deps`` plus its import-time
modules, and imports on a CPU-only machine.
"""

from __future__ import annotations

import signal
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import stop_daemon

READY_TIMEOUT_S = 30.0

# Warnings vLLM 0.33 (and the torch modules it imports) emit at import or config time on a CPU
# machine without vLLM's compiled extension. Filtered by exact message, nothing broader.
VLLM_IMPORT_WARNINGS = (
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning",
    r"ignore:`torch\.jit\.script` is deprecated:DeprecationWarning",
)


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            for w in VLLM_IMPORT_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(w))


class Daemon:
    """A `kvdepot serve` subprocess on a fixed ipc endpoint; `stop` / `start` restart it (the
    endpoint stays, the boot id changes)."""

    def __init__(self, workdir: Path, l1_bytes: str = "256m") -> None:
        self.workdir = workdir
        self.l1_bytes = l1_bytes
        sock_dir = Path(tempfile.mkdtemp(prefix="kvdv-", dir="/tmp"))  # ipc paths must stay short
        self.sock_path = sock_dir / "kvdepot.sock"
        self.endpoint = f"ipc://{self.sock_path}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> Daemon:
        self.starts += 1
        out_path = self.workdir / f"daemon{self.starts}.out"
        self.log_path = self.workdir / f"daemon{self.starts}.log"
        cmd = [sys.executable, "-m", "kvdepot", "serve", "--endpoint", self.endpoint, "--l1-bytes", self.l1_bytes]
        with open(out_path, "wb") as out, open(self.log_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "kvdepot ready on" not in out_path.read_text(errors="replace"):
            if self.proc.poll() is not None:
                pytest.fail(f"daemon exited with {self.proc.returncode}; log:\n{self.log()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"daemon not ready within {READY_TIMEOUT_S} s; log:\n{self.log()}")
            time.sleep(0.02)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        """`stop` for good: also removes the short-path socket directory."""
        self.stop()
        shutil.rmtree(self.sock_path.parent, ignore_errors=True)

    def stop(self) -> None:
        """SIGTERM and a clean exit (status 0, no traceback logged)."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        stop_daemon(proc, self.log)

    def pause(self) -> None:
        """SIGSTOP: the daemon stays bound but answers nothing (a hung daemon)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


@pytest.fixture
def small_daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A fresh daemon with a 1 MiB L1 (32 of the toy model's 32 KiB chunks): evictions come soon."""
    d = Daemon(tmp_path, l1_bytes="1m").start()
    yield d
    d.close()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A fresh daemon for one test; ``.endpoint``, ``.stop()``, ``.start()`` (restart)."""
    d = Daemon(tmp_path).start()
    try:
        yield d
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.resume()
        d.close()


# ---------------------------------------------------------------------- the connector's end-to-end tests
# (test_vllm_connector.py, test_vllm_connector_faults.py; vllm_harness imported in each fixture:
# this file is loaded without vLLM too)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A model directory of the toy model (vllm_harness.model_dir), one per module."""
    import vllm_harness as H

    return H.model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory):
    """One daemon for the tests that never stop or pause it (each test has its own model id)."""
    d = Daemon(tmp_path_factory.mktemp("daemon")).start()
    yield d
    d.close()


@pytest.fixture
def cfg(request, model):
    """``cfg(endpoint, **make_vllm_config kwargs)`` with this test's own model id (chunk keys of
    different tests never meet in a shared daemon), `connector_testing.CHUNK` tokens per chunk
    unless given."""
    import vllm_harness as H
    from connector_testing import CHUNK

    model_id = request.node.name

    def make(endpoint: str, extra: dict | None = None, **kw):
        kw.setdefault("chunk_size", CHUNK)
        return H.make_vllm_config(model, endpoint, extra={"model_id": model_id, **(extra or {})}, **kw)

    return make


@pytest.fixture
def engines():
    """``engines(cfg, specs=None, **kw)``: a `vllm_harness.Engine` (dense model by default),
    closed after the test."""
    import vllm_harness as H

    made: list = []

    def make(cfg, specs=None, **kw):
        e = H.Engine(cfg, specs if specs is not None else H.dense_specs(), **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()

