"""Engine liveness (kvdepot.server.liveness): a stream client's registrations and pins belong to
its connection, whatever pid it reports; a ZMQ client is watched by pid; a client that
reconnects in time (a timed-out wait) keeps what it owns."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

import kv_engine as ke
from daemon_proc import metric, scrape
from kvdepot.client import KVDepotClient
from kvdepot.protocol.errors import ErrorCode

RECLAIMED = "kvdepot_engines_reclaimed_total"


def _spec(endpoint: str, seed: int) -> ke.EngineSpec:
    return ke.EngineSpec(endpoint, ke.SMOLLM2, "LBNHC", (16,), (24,), 16, seed, model_id=f"liveness-{seed}")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _engines(client: KVDepotClient) -> set[str]:
    return {e.registration for e in client.describe().engines}


def _start_doomed(spec: ke.EngineSpec, tokens, out, report_pid: int = 0, env: dict | None = None):
    ctx = multiprocessing.get_context("spawn")
    registered = ctx.Event()
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})  # a spawned child takes the environment of the moment it starts
    try:
        p = ctx.Process(target=ke.register_store_and_hang, args=(spec, tokens, str(out), registered, report_pid))
        p.start()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if not registered.wait(60):
        p.kill()
        pytest.fail("engine process did not register")
    return p, json.loads(out.read_text())


def _wait_gone(client: KVDepotClient, reg_id: str, within_s: float) -> float:
    t0 = time.monotonic()
    while reg_id in _engines(client) or client.describe().pinned_requests:
        assert time.monotonic() - t0 < within_s, f"registration {reg_id} or its pins not reclaimed in {within_s} s"
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.parametrize("reported", ["dead-pid", "live-pid-of-another-process"])
def test_stream_engine_is_reclaimed_with_its_connection_whatever_pid_it_reports(daemon, tmp_path, reported):
    """An engine in another PID namespace reports a pid that means nothing here: a dead one must
    not get it reclaimed while it runs, a live one must not keep it after it died."""
    report_pid = _dead_pid() if reported == "dead-pid" else os.getpid()
    tokens = ke.prompt_tokens(4100, 3 * 16)
    p, info = _start_doomed(_spec(daemon.endpoint, 4100), tokens, tmp_path / "doomed.json", report_pid)
    try:
        assert info["transport"] == "stream" and info["stored"] == 3
        with KVDepotClient(daemon.endpoint) as c:
            time.sleep(2.5)  # > 2 pid sweeps (--liveness 1 s): a pid-watching daemon would act now
            assert info["registration"] in _engines(c)
            assert c.describe().pinned_requests == 1
            before = metric(scrape(daemon.metrics_port), RECLAIMED, reason="connection_closed")
            os.kill(p.pid, signal.SIGKILL)
            _wait_gone(c, info["registration"], within_s=5.0)
            samples = scrape(daemon.metrics_port)
            assert metric(samples, RECLAIMED, reason="connection_closed") == before + 1
            assert metric(samples, RECLAIMED, reason="pid_exited") == 0
            # what it stored stays cached
            assert c.lookup([bytes.fromhex(k) for k in info["keys"]], 16) == 3
    finally:
        p.kill()
        p.join(10)
    assert daemon.alive


def test_zmq_engine_is_reclaimed_by_its_pid(daemon, tmp_path):
    """ZMQ says nothing of a peer's connection: a ZMQ client's pid is watched."""
    tokens = ke.prompt_tokens(4200, 2 * 16)
    p, info = _start_doomed(_spec(daemon.endpoint, 4200), tokens, tmp_path / "doomed.json",
                            env={"KVDEPOT_TRANSPORT": "zmq"})
    try:
        assert info["transport"] == "zmq"
        with KVDepotClient(daemon.endpoint) as c:
            assert info["registration"] in _engines(c)
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)  # a zombie's pid still exists
            _wait_gone(c, info["registration"], within_s=5.0)
            assert metric(scrape(daemon.metrics_port), RECLAIMED, reason="pid_exited") == 1
    finally:
        p.kill()
        p.join(10)


def test_a_client_that_reconnects_after_a_timeout_keeps_its_registration(daemon):
    """A timed-out wait drops the connection (late replies must never be taken for new requests);
    the client connects again at once, so the daemon does not reclaim a live engine."""
    with ke.Engine(_spec(daemon.endpoint, 4300)) as eng:
        c = eng.client
        assert c.conn.transport == "stream"
        keys = eng.keys(ke.prompt_tokens(4300, 32))
        assert c.store(eng.reg, keys[:1], [[0]]).stored == 1
        assert c.lookup(keys, 16, pin_request="kept") == 1
        c.conn._reset(ErrorCode.TIMEOUT)  # what a timed-out wait does
        time.sleep(1.0)  # well past the daemon's reclaim grace
        assert eng.reg.id in _engines(c)
        assert c.describe().pinned_requests == 1
        assert c.store(eng.reg, keys[1:], [[1]], parent=keys[0]).stored == 1
        assert metric(scrape(daemon.metrics_port), RECLAIMED, reason="connection_closed") == 0
