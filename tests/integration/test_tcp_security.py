"""tcp:// endpoints are safe by default: a network-reachable one needs CURVE authentication
(`kvdepot keygen` keys), a loopback one without it refuses admin requests, and no tcp peer can
make the daemon map the host's shared-memory segments."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

import kv_engine as ke
from daemon_proc import free_port
from kvdepot.client import KVDepotClient
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError
from kvdepot.protocol.transport import ENV_CURVE_CLIENT_KEY, ENV_CURVE_SERVER_KEY
from kvdepot.server.netsec import is_loopback
from test_cli_metrics import metric, scrape


def kvdepot(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdepot", *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


@pytest.fixture
def keys(tmp_path):
    """A daemon key pair, an accepted client's and a stranger's (not in the clients directory)."""
    out = {}
    for name, where in (("server", "server"), ("client", "client"), ("stranger", "stranger")):
        r = kvdepot("keygen", "--dir", str(tmp_path / where), "--name", name)
        assert r.returncode == 0, r.stderr
        out[name] = (tmp_path / where / f"{name}.key", tmp_path / where / f"{name}.key_secret")
    clients = tmp_path / "clients"
    clients.mkdir()
    (clients / "client.key").write_bytes(out["client"][0].read_bytes())
    out["clients_dir"] = clients
    return out


def test_keygen_pair_and_no_overwrite(tmp_path):
    r = kvdepot("keygen", "--dir", str(tmp_path), "--name", "node1")
    assert r.returncode == 0 and "KVDEPOT_CURVE_SERVER_KEY" in r.stdout, r.stderr
    secret = tmp_path / "node1.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert "secret-key" in secret.read_text() and "secret-key" not in (tmp_path / "node1.key").read_text()
    again = kvdepot("keygen", "--dir", str(tmp_path), "--name", "node1")
    assert again.returncode == 1 and "never overwritten" in again.stderr


@pytest.mark.parametrize("endpoint, loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.0.0.2:5555", True), ("tcp://[::1]:5555", True),
    ("tcp://localhost:5555", True), ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False),
    ("tcp://10.1.2.3:5555", False), ("tcp://[::]:5555", False),
])
def test_is_loopback(endpoint, loopback):
    assert is_loopback(endpoint) is loopback


@pytest.mark.parametrize("host", ["0.0.0.0", "*"])
def test_network_endpoint_without_keys_is_refused(host, tmp_path):
    r = kvdepot("serve", "--endpoint", f"tcp://{host}:{free_port()}", "--l1-bytes", "16m")
    assert r.returncode == 1 and "no authentication configured" in r.stderr and "Traceback" not in r.stderr
    half = kvdepot("serve", "--endpoint", f"tcp://127.0.0.1:{free_port()}", "--curve-clients", str(tmp_path))
    assert half.returncode == 1 and "both" in half.stderr


def test_loopback_tcp_without_keys_refuses_admin_and_shm(daemon_factory, tmp_path):
    port = free_port()
    d = daemon_factory("--endpoint", f"tcp://127.0.0.1:{port}")
    tcp = f"tcp://127.0.0.1:{port}"
    with KVDepotClient(tcp, timeout_s=10) as c:
        c.ping()
        assert c.lookup([os.urandom(16)], 16) == 0
        with pytest.raises(KVDepotError) as ei:
            c.flush()
        assert ei.value.code is ErrorCode.FORBIDDEN and "flush" in str(ei.value)
    with pytest.raises(KVDepotError) as ei:
        ke.Engine(ke.EngineSpec(tcp, ke.SMOLLM2, "LBNHC", (16,), (8,), 16, 7100, sealed=False))
    assert ei.value.code is ErrorCode.FORBIDDEN and "shared memory" in str(ei.value)
    with KVDepotClient(d.endpoint) as c:  # the same over ipc:// is fine
        c.flush()
    with ke.Engine(ke.EngineSpec(d.endpoint, ke.SMOLLM2, "LBNHC", (16,), (8,), 16, 7101)):
        pass
    assert metric(scrape(d.metrics_port), "kvdepot_errors_total", code="FORBIDDEN") == 2


def test_curve_accepts_only_known_clients(daemon_factory, keys, monkeypatch):
    port = free_port()
    daemon_factory("--endpoint", f"tcp://0.0.0.0:{port}", "--curve-secret-key", str(keys["server"][1]),
                   "--curve-clients", str(keys["clients_dir"]))
    tcp = f"tcp://127.0.0.1:{port}"
    monkeypatch.setenv(ENV_CURVE_SERVER_KEY, str(keys["server"][0]))
    monkeypatch.setenv(ENV_CURVE_CLIENT_KEY, str(keys["client"][1]))
    with KVDepotClient(tcp, timeout_s=10) as c:
        c.ping()
        c.flush()  # authenticated: admin requests are allowed
    with pytest.raises(KVDepotError) as ei:  # but never shared memory over tcp
        ke.Engine(ke.EngineSpec(tcp, ke.SMOLLM2, "LBNHC", (16,), (8,), 16, 7102))
    assert ei.value.code is ErrorCode.FORBIDDEN
    r = kvdepot("ping", "--endpoint", tcp, "--timeout-s", "5")  # the CLI takes the keys from the environment
    assert r.returncode == 0, r.stderr
    # a client whose key the daemon does not know, and one without keys: no answer at all
    monkeypatch.setenv(ENV_CURVE_CLIENT_KEY, str(keys["stranger"][1]))
    with pytest.raises(KVDepotError) as ei:
        KVDepotClient(tcp, timeout_s=1.5)  # says hello: never answered
    assert ei.value.code is ErrorCode.TIMEOUT
    monkeypatch.delenv(ENV_CURVE_SERVER_KEY)
    monkeypatch.delenv(ENV_CURVE_CLIENT_KEY)
    with KVDepotClient(tcp, timeout_s=1.5, connect=False) as c, pytest.raises(KVDepotError) as ei:
        c.call(m.Flush(rid=0))
    assert ei.value.code is ErrorCode.TIMEOUT


def test_half_client_curve_config_fails_clearly(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_CURVE_SERVER_KEY, str(tmp_path / "server.key"))
    monkeypatch.delenv(ENV_CURVE_CLIENT_KEY, raising=False)
    with KVDepotClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=1, connect=False) as c:
        with pytest.raises(ValueError, match="set both"):
            c.ping()
