"""The L3 tier against a real `redis-server` (Debian package) and real `kvdepot serve` processes:
two daemons with their own L1 and L2 share chunks through L3 bit-exact; Redis killed mid-run
(serving goes on from L1 at once, then L3 comes back); a damaged value in Redis is a miss, never
a wrong byte; key prefix and TTL; flush --tier l3; metrics and describe."""

from __future__ import annotations

import dataclasses
import time
import urllib.request

import pytest

import kv_engine as ke
from redis_server import RedisServer
from test_store_retrieve import assert_same_tokens, blocks, small_spec

from kvdepot.client import KVDepotClient
from kvdepot.protocol.errors import ErrorCode, KVDepotError
from kvdepot.server.objfile import HEADER_BYTES

N = 6  # chunks per prompt (SmolLM2-135M, 16-token chunks of 360 KiB)


@pytest.fixture
def redis(tmp_path):
    r = RedisServer(tmp_path / "redis")
    yield r
    r.kill()


def l3_args(r: RedisServer, *extra: str) -> tuple[str, ...]:
    return ("--l3-url", r.url, "--l3-prefix", "test:kv:", "--l3-ttl-s", "600", "--l3-timeout-s", "0.5", *extra)


def tier(c: KVDepotClient, name: str):
    return next(t for t in c.describe().tiers if t.name == name)


def settle(c: KVDepotClient, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while tier(c, "l3").queue_depth:
        assert time.monotonic() < deadline, "L3 writes did not finish"
        time.sleep(0.01)


def test_two_daemons_share_through_l3(daemon_factory, redis, tmp_path):
    d1 = daemon_factory(*l3_args(redis), "--l2-path", str(tmp_path / "l2a"))
    d2 = daemon_factory(*l3_args(redis), "--l2-path", str(tmp_path / "l2b"))
    spec1 = small_spec(d1.endpoint, 5100, num_blocks=2 * N)
    spec2 = dataclasses.replace(small_spec(d2.endpoint, 5101, num_blocks=2 * N), layout="LBHNC")
    with ke.Engine(spec1) as a, ke.Engine(spec2) as b:
        keys = a.keys(ke.prompt_tokens(51, N * 16))
        assert a.client.store(a.reg, keys, blocks(*range(N))).stored == N
        settle(a.client)
        t = tier(a.client, "l3")
        assert t.written_bytes == N * (HEADER_BYTES + a.reg.object_bytes) and t.dropped_writes == 0
        names = sorted(redis.client().keys("test:kv:*"))
        assert len(names) == N and all(n.decode().startswith("test:kv:") for n in names)
        assert 0 < int(redis.cli("TTL", names[0].decode())) <= 600
        # daemon 2 has never seen these chunks: its lookup finds them in L3 (one round trip)
        assert b.client.lookup(keys, 16) == N
        got = b.client.retrieve(b.reg, keys, blocks(*range(N, 2 * N)))
        assert got == N
        assert_same_tokens(a, range(N), b, range(N, 2 * N))
        t2 = tier(b.client, "l3")
        assert t2.hit_chunks == N and t2.read_bytes == N * (HEADER_BYTES + a.reg.object_bytes) and t2.corrupt_objects == 0
        # the fetched chunks are daemon 2's own now (L1): a second retrieve asks L3 nothing
        assert b.client.retrieve(b.reg, keys, blocks(*range(N, 2 * N))) == N
        assert tier(b.client, "l3").read_bytes == t2.read_bytes
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{d2.metrics_port}/metrics", timeout=5).read().decode()
        assert f'kvdepot_tier_hit_chunks_total{{tier="l3"}} {float(N)}' in metrics
        assert 'kvdepot_corrupt_objects_total{tier="l3"} 0.0' in metrics


def test_redis_down_mid_run_serving_goes_on(daemon_factory, redis):
    d = daemon_factory(*l3_args(redis))
    spec = small_spec(d.endpoint, 5200, num_blocks=2 * N)
    with ke.Engine(spec) as eng:
        c = eng.client
        x = eng.keys(ke.prompt_tokens(52, N * 16))
        assert c.store(eng.reg, x, blocks(*range(N))).stored == N
        settle(c)
        redis.kill()
        # L1 serves on; the lookup of an unknown prompt costs at most the L3 timeout, once
        y = eng.keys(ke.prompt_tokens(53, N * 16))
        t0 = time.monotonic()
        assert c.lookup(y, 16) == 0
        assert time.monotonic() - t0 < 1.5
        assert c.lookup(x, 16) == N
        assert c.retrieve(eng.reg, x, blocks(*range(N, 2 * N))) == N
        r = c.store(eng.reg, y, blocks(*range(N)))  # its L3 writes fail or are dropped, counted
        assert r.stored == N
        deadline = time.monotonic() + 5
        while "circuit open" not in tier(c, "l3").detail:
            assert time.monotonic() < deadline, tier(c, "l3")
            c.lookup(eng.keys(ke.prompt_tokens(54, N * 16)), 16)
        t = tier(c, "l3")
        assert t.errors >= 1
        # circuit open: lookups answer from L1 without waiting for Redis
        t0 = time.monotonic()
        for s in range(10):
            assert c.lookup(eng.keys(ke.prompt_tokens(100 + s, N * 16)), 16) == 0
        assert time.monotonic() - t0 < 0.5
        dropped = tier(c, "l3").dropped_writes
        assert c.store(eng.reg, eng.keys(ke.prompt_tokens(55, N * 16)), blocks(*range(N))).stored == N
        assert tier(c, "l3").dropped_writes == dropped + N
        # Redis back: after the retry interval the next request closes the circuit
        redis.start()
        deadline = time.monotonic() + 15
        while "circuit open" in tier(c, "l3").detail:
            assert time.monotonic() < deadline, "L3 did not come back"
            c.lookup(eng.keys(ke.prompt_tokens(56, N * 16)), 16)
            time.sleep(0.2)
        z = eng.keys(ke.prompt_tokens(57, N * 16))
        assert c.store(eng.reg, z, blocks(*range(N))).stored == N
        settle(c)
        assert len(redis.client().keys("test:kv:*")) == N
    assert d.alive


def test_damaged_value_in_redis_is_a_miss(daemon_factory, redis):
    d1 = daemon_factory(*l3_args(redis))
    d2 = daemon_factory(*l3_args(redis))
    spec1 = small_spec(d1.endpoint, 5300, num_blocks=2 * N)
    spec2 = small_spec(d2.endpoint, 5301, num_blocks=2 * N)
    with ke.Engine(spec1) as a, ke.Engine(spec2) as b:
        keys = a.keys(ke.prompt_tokens(58, N * 16))
        assert a.client.store(a.reg, keys, blocks(*range(N))).stored == N
        settle(a.client)
        r = redis.client()
        name = b"test:kv:" + keys[2].hex().encode()
        v = r.getrange(name, HEADER_BYTES + 1000, HEADER_BYTES + 1000)
        r.setrange(name, HEADER_BYTES + 1000, bytes([v[0] ^ 1]))  # one payload bit
        name4 = b"test:kv:" + keys[4].hex().encode()
        r.set(name4, r.get(name4)[:-1], keepttl=True)  # truncated by one byte
        assert b.client.lookup(keys, 16) == N  # lengths look fine (or nearly): the fetch verifies
        got = b.client.retrieve(b.reg, keys, blocks(*range(N, 2 * N)))
        assert got == 2, "served up to the damaged chunk"
        assert ke.verify_cache(b.cache, b.spec, blocks(*range(N, 2 * N)), a.spec, blocks(*range(N)), 0, 32) == []
        assert tier(b.client, "l3").corrupt_objects == 2
        deadline = time.monotonic() + 5
        while r.exists(name) or r.exists(name4):  # damaged values are deleted
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_flush_l3(daemon_factory, redis):
    d = daemon_factory(*l3_args(redis))
    spec = small_spec(d.endpoint, 5400, num_blocks=N)
    redis.client().set("other:app:key", b"not ours")
    with ke.Engine(spec) as eng:
        keys = eng.keys(ke.prompt_tokens(59, N * 16))
        eng.client.store(eng.reg, keys, blocks(*range(N)))
        settle(eng.client)
        with pytest.raises(KVDepotError) as ei:
            eng.client.flush(tier="l3", model="x")
        assert ei.value.code is ErrorCode.INVALID_ARGUMENT
        r = eng.client.flush(tier="l3")
        assert r.objects == N
        assert redis.client().keys("test:kv:*") == [] and redis.client().get("other:app:key") == b"not ours"
        assert eng.client.lookup(keys, 16) == N, "L1 keeps its copies"
        assert eng.client.flush().objects == N  # everything: L1 (N) and L3 (already empty)
        redis.kill()
        with pytest.raises(KVDepotError) as ei:
            eng.client.flush()
        assert ei.value.code is ErrorCode.TIER_UNAVAILABLE


@pytest.fixture
def redis_cluster(tmp_path):
    """Three redis-server nodes made one Redis Cluster (no replicas) with redis-cli."""
    import shutil
    import subprocess

    nodes = [RedisServer(tmp_path / f"node{i}", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                         "--cluster-node-timeout", "2000") for i in range(3)]
    try:
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        assert cli, "redis-cli comes with the redis-server package"
        r = subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
                            "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        # converged: every node serves all slots and knows the other two (a node that says
        # "ok" before gossip reached it once made the daemon's first write fail)
        want = ("cluster_state:ok", "cluster_slots_ok:16384", "cluster_known_nodes:3", "cluster_size:3")
        deadline = time.monotonic() + 30
        while not all(all(w in n.cli("CLUSTER", "INFO") for w in want) for n in nodes):
            assert time.monotonic() < deadline, "the cluster did not converge"
            time.sleep(0.1)
        time.sleep(0.5)  # and the slot map they gossip settles
        yield nodes
    finally:
        for n in nodes:
            n.kill()


def test_two_daemons_share_through_a_redis_cluster(daemon_factory, redis_cluster):
    url = redis_cluster[0].url
    args = ("--l3-url", url, "--l3-cluster", "--l3-prefix", "test:kv:")
    d1, d2 = daemon_factory(*args), daemon_factory(*args)
    spec1 = small_spec(d1.endpoint, 5500, num_blocks=2 * N)
    spec2 = dataclasses.replace(small_spec(d2.endpoint, 5501, num_blocks=2 * N), layout="LBHNC")
    with ke.Engine(spec1) as a, ke.Engine(spec2) as b:
        keys = a.keys(ke.prompt_tokens(60, N * 16))
        assert a.client.store(a.reg, keys, blocks(*range(N))).stored == N
        settle(a.client)
        assert tier(a.client, "l3").errors == 0
        per_node = [len(n.client().keys("test:kv:*")) for n in redis_cluster]
        assert sum(per_node) == N and sum(1 for x in per_node if x) >= 2, per_node  # spread over the slots
        assert b.client.lookup(keys, 16) == N
        assert b.client.retrieve(b.reg, keys, blocks(*range(N, 2 * N))) == N
        assert_same_tokens(a, range(N), b, range(N, 2 * N))
        assert b.client.flush(tier="l3").objects == N
        assert sum(len(n.client().keys("test:kv:*")) for n in redis_cluster) == 0
