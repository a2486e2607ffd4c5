"""The `kvdepot` CLI (describe / flush / ping) and the Prometheus endpoint against a real daemon."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time

import pytest

import kv_engine as ke
from daemon_proc import metric, scrape
from kvdepot.client import KVDepotClient
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError


def kvdepot(*args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdepot", *args], capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


def ok(*args: str) -> str:
    r = kvdepot(*args)
    assert r.returncode == 0, f"kvdepot {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.fixture
def hybrid_engine(module_daemon):
    """gpt-oss-20b (12 full + 12 sliding layers, 16 / 32 tokens per block) registered as `cli-gpt-oss`,
    with 2 chunks of 64 tokens stored."""
    spec = ke.EngineSpec(module_daemon.endpoint, ke.GPT_OSS_20B, "LBHNC", (16, 32), (8, 4), 64, 5000,
                         model_id="cli-gpt-oss")
    with ke.Engine(spec) as eng:
        keys = eng.keys(ke.prompt_tokens(5000, 2 * 64))
        eng.client.flush(model="cli-gpt-oss")  # from an earlier test
        r = eng.client.store(eng.reg, keys, [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3]])
        assert r.stored == 2
        eng.stored_keys = keys
        yield eng


def test_ping(module_daemon):
    out = ok("ping", "--endpoint", module_daemon.endpoint)
    with KVDepotClient(module_daemon.endpoint) as c:
        boot = c.ping()
    assert boot in out and module_daemon.endpoint in out


def test_describe_json_shows_engine_and_groups(module_daemon, hybrid_engine):
    info = json.loads(ok("describe", "--endpoint", module_daemon.endpoint, "--json"))
    engines = {e["registration"]: e for e in info["engines"]}
    e = engines[hybrid_engine.reg.id]
    assert e["model"] == "cli-gpt-oss" and e["shard"] == "tp0of1" and e["device"] == "cpu"
    assert e["chunk_size"] == 64 and e["object_bytes"] == hybrid_engine.reg.object_bytes
    assert e["layout_fingerprint"] == hybrid_engine.reg.layout_fingerprint
    assert e["stored_chunks"] == 2
    groups = sorted(e["groups"], key=lambda g: g["gid"])
    assert [(g["gid"], g["tokens_per_block"], g["num_layers"], g["num_blocks"]) for g in groups] == \
        [(0, 16, 12, 8), (1, 32, 12, 4)]
    for g in groups:
        assert (g["layout"], g["dtype"], g["kv_dtype"]) == ("vllm", "int8", "bfloat16")
        assert (g["num_heads"], g["num_kv"], g["row_bytes"]) == (8, 2, 128)
        assert g["bytes_per_token"] == 12 * 8 * 2 * 128
    assert sum(g["bytes_per_token"] for g in groups) * 64 == e["object_bytes"]
    l1 = {t["name"]: t for t in info["tiers"]}["l1"]
    assert l1["capacity_bytes"] == 256 << 20 and l1["num_objects"] >= 2 and l1["used_bytes"] > 0
    assert info["endpoints"] == [module_daemon.endpoint] and info["metrics_port"] == module_daemon.metrics_port
    assert info["transfer_engine"] and info["protocol_version"] >= 1


def test_describe_table_names_the_model(module_daemon, hybrid_engine):
    out = ok("describe", "--endpoint", module_daemon.endpoint)
    assert "cli-gpt-oss" in out and hybrid_engine.reg.id in out
    assert "GID" in out and "TOK/BLK" in out and "l1" in out


def test_flush_cli_drops_objects(module_daemon, hybrid_engine):
    c, keys = hybrid_engine.client, hybrid_engine.stored_keys
    assert c.lookup(keys, 64) == 2
    out = ok("flush", "--endpoint", module_daemon.endpoint, "--model", "cli-gpt-oss")
    assert out.startswith("flushed 2 objects"), out
    assert c.lookup(keys, 64) == 0
    assert c.store(hybrid_engine.reg, keys, [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3]]).stored == 2
    out = ok("flush", "--endpoint", module_daemon.endpoint)
    assert out.startswith("flushed ") and "objects" in out
    assert c.lookup(keys, 64) == 0
    info = json.loads(ok("describe", "--endpoint", module_daemon.endpoint, "--json"))
    assert info["tiers"][0]["num_objects"] == 0 and info["tiers"][0]["used_bytes"] == 0


def test_prometheus_lookup_tokens_per_model(module_daemon):
    s1 = ke.EngineSpec(module_daemon.endpoint, ke.SMOLLM2, "LBNHC", (16,), (8,), 16, 5100, model_id="metrics-m1")
    s2 = ke.EngineSpec(module_daemon.endpoint, ke.QWEN_7B, "LBHNC", (16,), (4,), 32, 5101, model_id="metrics-m2")
    with ke.Engine(s1) as e1, ke.Engine(s2) as e2:
        t1 = ke.prompt_tokens(5100, 100)  # 6 whole 16-token chunks + 4 tokens
        k1 = e1.keys(t1)
        assert e1.client.store(e1.reg, k1[:4], [[0, 1, 2, 3]]).stored == 4
        t2 = ke.prompt_tokens(5101, 70)  # 2 whole 32-token chunks + 6 tokens
        k2 = e2.keys(t2)
        assert e2.client.store(e2.reg, k2[:1], [[0, 1]]).stored == 1
        # (hit chunks, requested tokens, hit tokens) of each lookup
        assert e1.client.lookup(k1, 16, num_tokens=100, model="metrics-m1") == 4  # 100 asked, 64 hit
        assert e1.client.lookup(k1[:2], 16, num_tokens=20, model="metrics-m1") == 2  # 20 asked, 20 hit (capped)
        assert e1.client.lookup(k1[4:], 16, num_tokens=36, model="metrics-m1") == 0  # 36 asked, 0 hit
        assert e1.client.lookup(k1, 16, model="metrics-m1") == 4  # no num_tokens: 96 asked (6 chunks), 64 hit
        assert e2.client.lookup(k2, 32, num_tokens=70, model="metrics-m2") == 1  # 70 asked, 32 hit
        samples = scrape(module_daemon.metrics_port)
    assert metric(samples, "kvdepot_lookup_requested_tokens_total", model="metrics-m1") == 100 + 20 + 36 + 96
    assert metric(samples, "kvdepot_lookup_hit_tokens_total", model="metrics-m1") == 64 + 20 + 0 + 64
    assert metric(samples, "kvdepot_lookup_requested_tokens_total", model="metrics-m2") == 70
    assert metric(samples, "kvdepot_lookup_hit_tokens_total", model="metrics-m2") == 32
    assert metric(samples, "kvdepot_lookups_total", model="metrics-m1") == 4
    assert metric(samples, "kvdepot_transferred_tokens_total", model="metrics-m1", op="store") == 64
    assert metric(samples, "kvdepot_transferred_bytes_total", model="metrics-m2", op="store") == \
        e2.reg.object_bytes
    assert metric(samples, "kvdepot_tier_capacity_bytes", tier="l1") == 256 << 20
    assert ("kvdepot_registered_engines", frozenset()) in samples
    for gen in ("0", "1", "2"):  # garbage collections' pauses (kvdepot.server.gcpause) and counts
        assert metric(samples, "kvdepot_gc_pause_seconds_total", generation=gen) >= 0
        assert metric(samples, "python_gc_collections_total", generation=gen) >= 0
    for (name, labels) in samples:  # labels from small fixed sets only
        allowed = {"version", "protocol", "kernels"} if name == "kvdepot_build_info" else \
            {"model", "op", "tier", "code", "reason", "type", "le", "generation", "tenant"}
        assert set(dict(labels)) <= allowed, (name, labels)
        # tenants: the salts named in --tenant-quota (none here) and "other", whatever the traffic
        assert dict(labels).get("tenant", "other") == "other", (name, labels)


def test_prometheus_counts_errors_by_code(module_daemon):
    before = metric(scrape(module_daemon.metrics_port), "kvdepot_errors_total", code="UNKNOWN_REGISTRATION")
    r = kvdepot("flush", "--endpoint", module_daemon.endpoint, "--tier", "l9")
    assert r.returncode != 0 and "INVALID_ARGUMENT" in r.stderr and "Traceback" not in r.stderr
    with KVDepotClient(module_daemon.endpoint) as c:
        with pytest.raises(KVDepotError) as ei:
            c.call(m.Unregister(rid=0, registration="nope"))
        assert ei.value.code is ErrorCode.UNKNOWN_REGISTRATION
    samples = scrape(module_daemon.metrics_port)
    assert metric(samples, "kvdepot_errors_total", code="UNKNOWN_REGISTRATION") == before + 1
    assert metric(samples, "kvdepot_errors_total", code="INVALID_ARGUMENT") >= 1


def test_cli_without_daemon_fails_with_one_line(tmp_path):
    """No daemon at an ipc:// endpoint fails at once (UNAVAILABLE), not after the timeout."""
    endpoint = f"ipc://{tmp_path}/nobody-serves-here.sock"
    commands = [  # (argv, words the one-line message must contain)
        (["ping", "--endpoint", endpoint], ["UNAVAILABLE", endpoint]),
        (["describe", "--endpoint", endpoint], ["UNAVAILABLE", endpoint]),
        (["describe", "--json", "--endpoint", endpoint], ["UNAVAILABLE", endpoint]),
        (["flush", "--model", "m", "--endpoint", endpoint], ["UNAVAILABLE", endpoint]),
        (["ping", "--endpoint", "foo://bar"], ["foo://bar", "--endpoint"]),
    ]
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "kvdepot", *argv, "--timeout-s", "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
             for argv, _ in commands]
    for (argv, words), p in zip(commands, procs):
        out, err = p.communicate(timeout=30)
        assert p.returncode == 1, (argv, p.returncode, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith(f"kvdepot {argv[0]}:") and all(w in lines[0] for w in words), lines
        assert out == ""
    assert time.monotonic() - t0 < 20


def test_client_fails_fast_on_a_dead_daemons_socket(tmp_path):
    """A socket file left by a daemon that is gone refuses connections: UNAVAILABLE at once."""
    import socket as _socket

    from kvdepot.client import KVDepotClient
    from kvdepot.protocol.errors import ErrorCode, KVDepotError

    path = tmp_path / "dead.sock"
    for p in (path, tmp_path / "dead.sock.stream"):  # bound, then closed: nothing accepts
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        s.bind(str(p))
        s.close()
    with pytest.raises(KVDepotError) as exc:
        KVDepotClient(f"ipc://{path}", timeout_s=30)
    assert exc.value.code == ErrorCode.UNAVAILABLE and "refused" in str(exc.value).lower()
    client = KVDepotClient(f"ipc://{path}", timeout_s=30, connect=False)  # made while the daemon is down
    try:
        assert client.available()  # nothing tried yet
        with pytest.raises(KVDepotError) as exc:
            client.ping()
        assert exc.value.code == ErrorCode.UNAVAILABLE
        client.mark_down()
        assert not client.available()  # the ping it sends fails at once; next one after retry_interval_s
    finally:
        client.close()


def test_serve_refuses_an_endpoint_another_daemon_serves(module_daemon):
    r = kvdepot("serve", "--endpoint", module_daemon.endpoint, "--l1-bytes", "16m", "--metrics-port", "0")
    assert r.returncode == 1, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "another kvdepot daemon is serving" in lines[0], r.stderr
    assert module_daemon.alive and module_daemon.sock_path.exists()
    ok("ping", "--endpoint", module_daemon.endpoint)


def test_client_without_daemon_times_out_cleanly(tmp_path):
    """tcp:// cannot tell a missing daemon from a slow one: the reply timeout says it (ipc://
    fails at once, `test_client_fails_fast_on_a_dead_daemons_socket`)."""
    import socket as _socket

    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(KVDepotError) as ei:
        KVDepotClient(f"tcp://127.0.0.1:{port}", timeout_s=0.3)
    assert ei.value.code is ErrorCode.TIMEOUT
    with pytest.raises(KVDepotError) as ei:
        KVDepotClient(f"ipc://{tmp_path}/nobody-serves-here.sock", timeout_s=30)
    assert ei.value.code is ErrorCode.UNAVAILABLE
    gc.collect()  # a zmq context left open by the failed constructor would warn here (an error under pytest)


def test_lookup_model_label_is_bounded_to_registered_models(module_daemon):
    """A client cannot mint metric label values: unregistered model names count as "other"."""
    with KVDepotClient(module_daemon.endpoint) as c:
        for i in range(3):
            c.lookup([bytes([i]) * 16], 16, num_tokens=16, model=f"not-registered-{i}")
        samples = scrape(module_daemon.metrics_port)
    assert not any(dict(labels).get("model", "").startswith("not-registered") for _, labels in samples)
    assert metric(samples, "kvdepot_lookups_total", model="other") >= 3


def test_pins_survive_a_client_timeout(daemon):
    """After a TIMEOUT the client rebuilds its socket with the same routing id, so the pin it
    took before is still released by its end_request."""
    import os
    import signal

    spec = ke.EngineSpec(daemon.endpoint, ke.SMOLLM2, "LBNHC", (16,), (8,), 16, 5200, model_id="pin-timeout")
    with ke.Engine(spec) as e:
        keys = e.keys(ke.prompt_tokens(5200, 32))
        assert e.client.store(e.reg, keys, [[0, 1]]).stored == 2
        assert e.client.lookup(keys, 16, pin_request="req-1") == 2
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(KVDepotError) as exc:
                e.client.call(m.Ping(rid=0), timeout_s=0.3)
            assert exc.value.code == ErrorCode.TIMEOUT
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert e.client.describe().pinned_requests == 1
        e.client.end_request("req-1")
        assert e.client.describe().pinned_requests == 0
