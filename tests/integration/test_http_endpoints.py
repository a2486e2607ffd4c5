"""The daemon's HTTP side as Prometheus and Kubernetes use it: every series present (at zero)
before any traffic, per-model series from a model's first registration, build info, and the
/healthz and /readyz probes apart from /metrics."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

import kv_engine as ke
import kvdepot
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode
from kvdepot.server.daemon import STORE_SKIP_REASONS, Daemon, DaemonConfig
from kvdepot.server.http import HttpEndpoints
from test_cli_metrics import scrape


def get(port: int, path: str, method: str = "GET", headers: dict | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body) of one request; HTTP errors are answers too."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def test_fresh_daemon_has_every_series_at_zero(daemon):
    """Before any engine or request: per op, tier, error code and skip reason, all at 0."""
    s = scrape(daemon.metrics_port)
    for op in ("store", "retrieve"):
        assert s[("kvdepot_transfer_seconds_count", frozenset({("op", op)}))] == 0
        assert s[("kvdepot_transfer_seconds_bucket", frozenset({("op", op), ("le", "+Inf")}))] == 0
    for name in ("kvdepot_evictions_total", "kvdepot_tier_used_bytes", "kvdepot_tier_objects"):
        assert s[(name, frozenset({("tier", "l1")}))] == 0, name
    assert s[("kvdepot_tier_capacity_bytes", frozenset({("tier", "l1")}))] == 256 << 20
    sent_codes = [c.name for c in ErrorCode if c not in (ErrorCode.TIMEOUT, ErrorCode.DISCONNECTED,
                                                         ErrorCode.UNAVAILABLE, ErrorCode.BACKPRESSURE)]
    for code in sent_codes:
        assert s[("kvdepot_errors_total", frozenset({("code", code)}))] == 0, code
    assert not any(n == "kvdepot_errors_total" and dict(lb)["code"] == "TIMEOUT" for n, lb in s)
    for reason in STORE_SKIP_REASONS:
        assert s[("kvdepot_store_skipped_chunks_total", frozenset({("reason", reason)}))] == 0
    assert s[("kvdepot_registered_engines", frozenset())] == 0
    for t in ("lookup", "store", "retrieve", "register", "unregister", "endrequest", "flush", "describe"):
        assert ("kvdepot_requests_total", frozenset({("type", t)})) in s, t
    info = [dict(lb) for n, lb in s if n == "kvdepot_build_info"]
    assert len(info) == 1 and s[("kvdepot_build_info", frozenset(info[0].items()))] == 1
    assert info[0]["version"] == kvdepot.__version__ and info[0]["protocol"] == str(m.PROTOCOL_VERSION)
    assert info[0]["kernels"] in ("env", "packaged", "cache", "jit", "torch")


def test_model_series_exist_from_registration(daemon):
    spec = ke.EngineSpec(daemon.endpoint, ke.SMOLLM2, "LBNHC", (16,), (8,), 16, 5200, model_id="http-m1")
    with ke.Engine(spec) as e:
        s = scrape(daemon.metrics_port)
        for name in ("kvdepot_lookups_total", "kvdepot_lookup_requested_tokens_total",
                     "kvdepot_lookup_hit_tokens_total"):
            assert s[(name, frozenset({("model", "http-m1")}))] == 0, name
        for op in ("store", "retrieve"):
            for name in ("kvdepot_transferred_tokens_total", "kvdepot_transferred_bytes_total"):
                assert s[(name, frozenset({("model", "http-m1"), ("op", op)}))] == 0, (name, op)
        assert s[("kvdepot_registered_engines", frozenset())] == 1
        before = s[("kvdepot_requests_total", frozenset({("type", "ping")}))]
        e.client.ping()
        assert scrape(daemon.metrics_port)[("kvdepot_requests_total", frozenset({("type", "ping")}))] == before + 1
    # the engine is gone; its model's series stay (counters never vanish while the daemon runs)
    assert ("kvdepot_lookups_total", frozenset({("model", "http-m1")})) in scrape(daemon.metrics_port)


def test_probes_and_paths(daemon):
    port = daemon.metrics_port
    assert get(port, "/healthz")[::2] == (200, b"ok\n")
    assert get(port, "/readyz")[::2] == (200, b"ready\n")
    status, ctype, body = get(port, "/metrics")
    assert status == 200 and ctype.startswith("text/plain") and b"kvdepot_build_info" in body
    status, ctype, body = get(port, "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200 and ctype.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
    for path in ("/", "/metricsx", "/healthz/x", "/debug"):
        status, _, body = get(port, path)
        assert status == 404 and b"/metrics" in body, path
    status, _, body = get(port, "/healthz", method="HEAD")
    assert status == 200 and body == b""
    assert get(port, "/metrics?name[]=kvdepot_build_info")[0] == 200  # query strings are ignored


def test_http_endpoints_answer_probe_failures():
    """503 with the probe's reason; the server runs in its own threads."""
    state = {"healthy": (False, "event loop stalled: no tick for 12.0 s"), "ready": (False, "starting")}
    http = HttpEndpoints(CollectorRegistry(), lambda: state["healthy"], lambda: state["ready"])
    port = http.serve(0)
    try:
        assert get(port, "/healthz")[::2] == (503, b"event loop stalled: no tick for 12.0 s\n")
        assert get(port, "/readyz")[::2] == (503, b"starting\n")
        state["ready"] = (True, "ready")
        assert get(port, "/readyz")[0] == 200
    finally:
        http.close()


def test_daemon_probes_follow_its_state(tmp_path):
    """/readyz is 503 until the sockets are bound and again once shutdown began; /healthz fails
    when the event loop stops ticking."""
    d = Daemon(DaemonConfig(endpoints=[f"ipc://{tmp_path}/d.sock"], l1_capacity_bytes=1 << 20, pin_l1=False))
    assert d._ready() == (False, "starting: sockets not bound yet")
    assert d._healthy()[0]
    ready = threading.Event()
    loop = asyncio.new_event_loop()

    def run() -> None:
        try:
            loop.run_until_complete(d.serve(on_ready=ready.set))
        finally:
            loop.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert ready.wait(20)
        assert d._ready() == (True, "ready")
        d._loop_tick_s = time.monotonic() - 30  # as if the loop had hung 30 s ago
        ok, why = d._healthy()
        assert not ok and why.startswith("event loop stalled")
    finally:
        loop.call_soon_threadsafe(d.stop)
        t.join(20)
    assert not t.is_alive()
    assert d._ready() == (False, "stopping")


@pytest.fixture(autouse=True)
def _no_leaked_threads():
    before = {th.name for th in threading.enumerate()}
    yield
    time.sleep(0.05)
    assert not {th.name for th in threading.enumerate() if th.name == "kvdepot-http"} - before


def test_serve_takes_its_settings_from_a_config_file(tmp_path):
    """`kvdepot serve --config FILE`: the endpoint, the HTTP port and L1's size come from it."""
    import subprocess
    import sys

    from daemon_proc import free_port, stop_daemon

    from kvdepot.client import KVDepotClient

    port = free_port()
    ep = f"ipc://{tmp_path}/from-file.sock"
    cfg = tmp_path / "kvdepot.toml"
    cfg.write_text(f'endpoint = "{ep}"\nmetrics_port = {port}\nl1_bytes = "32m"\nlog_level = "warning"\n')
    log = tmp_path / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvdepot", "serve", "--config", str(cfg)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if get(port, "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with KVDepotClient(ep) as c:
            assert c.describe().tiers[0].capacity_bytes == 32 << 20
    finally:
        stop_daemon(proc, log.read_text)
