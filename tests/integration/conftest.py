"""Fixtures of the integration tests: a real `kvdepot serve` subprocess per test or per module,
and a pair of spawned engine processes (separate client processes) that run the jobs of
``kv_engine``.

Every daemon listens on a fresh ``ipc://`` endpoint under the test's temporary directory and
on a free Prometheus port, is waited for until it prints its ready line, and at teardown gets
SIGTERM and must exit with status 0, remove its socket file and log no traceback.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import kv_engine
from daemon_proc import free_port, stop_daemon

READY_TIMEOUT_S = 30.0
_MAX_IPC_PATH = 100  # sun_path is 108 bytes on Linux; keep a margin


@dataclasses.dataclass
class DaemonProc:
    """A running `kvdepot serve` subprocess."""

    endpoint: str
    metrics_port: int
    proc: subprocess.Popen
    log_path: Path  # stderr (the daemon's log)
    out_path: Path  # stdout (the ready line)
    sock_path: Path

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM, then check a clean exit (status 0, socket file gone, no traceback logged)."""
        log = stop_daemon(self.proc, self.log)
        assert self.proc.returncode == 0, f"daemon exited with {self.proc.returncode}; log:\n{log}"
        assert "kvdepot stopped" in log, log
        assert not self.sock_path.exists(), "daemon left its ipc socket file behind"
        assert not Path(str(self.sock_path) + ".stream").exists(), "daemon left its stream socket file behind"


def start_daemon(workdir: Path, *extra_args: str, l1_bytes: str = "256m") -> DaemonProc:
    """Start `python -m kvdepot serve` in ``workdir`` and wait for its ready line."""
    workdir.mkdir(parents=True, exist_ok=True)
    sock_dir = workdir
    if len(str(workdir / "kvdepot.sock")) > _MAX_IPC_PATH:  # very long tmp paths: fall back to a short dir
        sock_dir = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))
    sock_path = sock_dir / "kvdepot.sock"
    endpoint = f"ipc://{sock_path}"
    port = free_port()
    out_path, log_path = workdir / "daemon.out", workdir / "daemon.log"
    cmd = [sys.executable, "-m", "kvdepot", "serve", "--endpoint", endpoint, "--l1-bytes", l1_bytes,
           "--metrics-port", str(port), *extra_args]
    with open(out_path, "wb") as out, open(log_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    d = DaemonProc(endpoint, port, proc, log_path, out_path, sock_path)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if "kvdepot ready on" in out_path.read_text(errors="replace"):
            return d
        if proc.poll() is not None:
            pytest.fail(f"daemon exited with {proc.returncode} before it was ready; log:\n{d.log()}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"daemon not ready within {READY_TIMEOUT_S} s; log:\n{d.log()}")
        time.sleep(0.02)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    """A fresh daemon for one test (256 MiB L1); ``.endpoint``, ``.metrics_port``."""
    d = start_daemon(tmp_path / "daemon")
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProc]]:
    """``start(*extra_args, l1_bytes="4m")``: daemons with custom flags, stopped after the test."""
    started: list[DaemonProc] = []

    def start(*extra_args: str, l1_bytes: str = "256m") -> DaemonProc:
        d = start_daemon(tmp_path / f"daemon{len(started)}", *extra_args, l1_bytes=l1_bytes)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture(scope="module")
def module_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """One daemon shared by the tests of a module (each test uses its own tokens / models)."""
    d = start_daemon(tmp_path_factory.mktemp("daemon"))
    try:
        yield d
    finally:
        d.stop()


@dataclasses.dataclass
class EnginePair:
    """Two long-lived spawned engine processes (A stores, B retrieves)."""

    a: concurrent.futures.ProcessPoolExecutor
    b: concurrent.futures.ProcessPoolExecutor

    def run_a(self, fn: Callable, *args, timeout_s: float = 120.0):
        return self.a.submit(fn, *args).result(timeout_s)

    def run_b(self, fn: Callable, *args, timeout_s: float = 120.0):
        return self.b.submit(fn, *args).result(timeout_s)


@pytest.fixture(scope="module")
def engines() -> Iterator[EnginePair]:
    """Engine processes A and B (``spawn`` context: fresh interpreters, no inherited state)."""
    ctx = multiprocessing.get_context("spawn")
    a = concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx)
    b = concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx)
    try:
        # start both interpreters (and their torch import) now, while the daemon starts;
        # the first job of each waits behind its warm-up
        a.submit(kv_engine.warm_up)
        b.submit(kv_engine.warm_up)
        yield EnginePair(a, b)
    finally:
        a.shutdown(wait=True)
        b.shutdown(wait=True)
