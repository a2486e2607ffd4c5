"""Unit tests of the vLLM connector's parts that need no daemon: configuration, chunk / block
arithmetic, the vLLM config -> registration mapping, and the channel's behaviour with no daemon."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402
from kvdepot.client import KVDepotClient  # noqa: E402
from kvdepot.client.vllm.config import (ConnectorConfig, auto_staging_bytes, check_chunk_size,  # noqa: E402
                                         load_ring_bytes)
from kvdepot.client.vllm.layout import (  # noqa: E402
    ShmSegments,
    build_registration,
    find_shm_segment,
    predict_fingerprint,
    transfer_groups,
)
from kvdepot.client.vllm.plan import blocks_covering, chunk_block_ids, plan_load  # noqa: E402
from kvdepot.gpu.layout import group_layers  # noqa: E402
from kvdepot.protocol import messages as m  # noqa: E402
from kvdepot.protocol.errors import ErrorCode, KVDepotError  # noqa: E402

NO_DAEMON = "ipc:///tmp/kvdepot-no-daemon-here.sock"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return H.model_dir(tmp_path_factory.mktemp("model"))


# ---------------------------------------------------------------------- configuration


def test_extra_config_defaults_and_validation(monkeypatch):
    monkeypatch.setenv("KVDEPOT_ENDPOINT", "ipc:///run/kvd.sock")
    cfg = ConnectorConfig.from_extra({})
    assert cfg.endpoint == "ipc:///run/kvd.sock" and cfg.chunk_size == 256 and cfg.store and cfg.load
    assert ConnectorConfig.from_extra({"chunk_size": 512, "lookup_timeout_s": 2}).lookup_timeout_s == 2.0
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['chunksize'\]"):
        ConnectorConfig.from_extra({"chunksize": 256})
    with pytest.raises(ValueError, match="kv_connector_extra_config.chunk_size"):
        ConnectorConfig.from_extra({"chunk_size": "big"})
    with pytest.raises(ValueError, match="kv_connector_extra_config.store: 'yes' is not a bool"):
        ConnectorConfig.from_extra({"store": "yes"})
    with pytest.raises(ValueError, match="ipc://PATH or tcp://HOST:PORT"):
        ConnectorConfig.from_extra({"endpoint": "/run/kvd.sock"})
    with pytest.raises(ValueError, match="rpc_timeout_s: must be > 0"):
        ConnectorConfig.from_extra({"rpc_timeout_s": 0})
    assert cfg.staging_bytes == 0  # auto
    assert ConnectorConfig.from_extra({"staging_bytes": 1 << 20}).staging_bytes == 1 << 20
    with pytest.raises(ValueError, match="staging_bytes: 4096 must be 0 \\(auto\\) or >= 1 MiB"):
        ConnectorConfig.from_extra({"staging_bytes": 4096})


def test_loads_get_a_staging_ring_of_their_own_unless_told_to_share():
    mib = 1 << 20
    assert load_ring_bytes(ConnectorConfig.from_extra({})) == 256 * mib  # auto
    assert load_ring_bytes(ConnectorConfig.from_extra({"load_staging_bytes": 64 * mib})) == 64 * mib
    assert load_ring_bytes(ConnectorConfig.from_extra({"load_staging_bytes": -1})) == 0  # shared
    assert load_ring_bytes(ConnectorConfig.from_extra({"load": False})) == 0  # nothing to load
    for bad in (4096, -2):
        with pytest.raises(ValueError, match="load_staging_bytes: .* must be 0 \\(auto\\), -1"):
            ConnectorConfig.from_extra({"load_staging_bytes": bad})


def test_auto_staging_ring_holds_two_steps_of_stores_for_sliding_window_models():
    mib = 1 << 20
    # gpt-oss-20b, one shard: 12 MiB per 256-token chunk; 4096 tokens per step -> 16 chunks x 2
    assert auto_staging_bytes(12 * mib, 256, 4096, sliding_window=True) == 384 * mib
    assert auto_staging_bytes(12 * mib, 256, 4097, sliding_window=True) == 408 * mib  # a 17th chunk
    assert auto_staging_bytes(12 * mib, 256, 4096, sliding_window=False) == 256 * mib  # stores wait for room
    assert auto_staging_bytes(1 * mib, 256, 2048, sliding_window=True) == 256 * mib  # at least
    assert auto_staging_bytes(32 * mib, 256, 1 << 20, sliding_window=True) == 4096 * mib  # at most


def test_chunk_size_must_be_a_multiple_of_every_groups_block_size():
    check_chunk_size(256, [16, 32])
    with pytest.raises(ValueError) as e:
        check_chunk_size(48, [16, 32])
    msg = str(e.value)
    assert "kv_connector_extra_config.chunk_size=48" in msg and "multiple of 32" in msg
    assert '"chunk_size": 32 or 64' in msg


def test_connector_refuses_to_start_with_a_bad_chunk_size_or_fail_policy(model):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = H.make_vllm_config(model, NO_DAEMON, chunk_size=48)
    kcc, sched_cfg, _, _ = H.plan_kv_cache(cfg, H.hybrid_specs(), 256)
    with pytest.raises(ValueError, match="chunk_size=48 is not a multiple of 32"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, sched_cfg)
    cfg = H.make_vllm_config(model, NO_DAEMON, policy="fail")
    kcc, sched_cfg, _, _ = H.plan_kv_cache(cfg, H.dense_specs(), 256)
    with pytest.raises(ValueError, match='"kv_load_failure_policy": "recompute"'):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, sched_cfg)


def test_vllm_gets_the_roles_class_and_the_other_roles_calls_raise(model):
    """``KVDepotConnector(...)``, as vLLM's factory builds it, is `SchedulerConnector` for the
    SCHEDULER role and `WorkerConnector` for WORKER: vLLM calls their methods directly (none on
    the instance replaces a class's); a call of the other role raises."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

    from kvdepot.client.vllm import KVDepotConnector, SchedulerConnector, WorkerConnector

    cfg = H.make_vllm_config(model, NO_DAEMON)
    kcc, sched_cfg, _, _ = H.plan_kv_cache(cfg, H.dense_specs(), 256)
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, sched_cfg)
    worker = KVDepotConnector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        assert type(sched) is SchedulerConnector and type(worker) is WorkerConnector
        assert isinstance(worker, KVDepotConnector) and sched.role == KVConnectorRole.SCHEDULER
        calls = {n for n in dir(KVConnectorBase_V1) if not n.startswith("_")}
        for conn in (sched, worker):
            assert not calls & set(vars(conn))  # no call of vLLM's replaced on the instance
        assert sched.cfg.chunk_size == worker.cfg.chunk_size and sched.fingerprint == worker.fingerprint
        with pytest.raises(RuntimeError, match="wait_for_save on its SCHEDULER-role connector"):
            sched.wait_for_save()
        with pytest.raises(RuntimeError, match="build_connector_meta on its WORKER-role connector"):
            worker.build_connector_meta(None)
        assert sched.get_kv_connector_stats() is None and worker.get_kv_connector_stats() is None  # nothing yet
        with pytest.raises(TypeError, match="subclass kvdepot.client.vllm.WorkerConnector or SchedulerConnector"):
            type("Mine", (KVDepotConnector,), {})(cfg, KVConnectorRole.WORKER, kcc)
    finally:
        sched.shutdown()
        worker.shutdown()


# ---------------------------------------------------------------------- chunk / block arithmetic


def test_plan_load_never_writes_vllms_own_blocks():
    p = plan_load(local=96, end=192, chunk_size=64)
    assert (p.first_chunk, p.num_chunks, p.skip_tokens, p.loadable_end) == (1, 2, 32, 192)
    p = plan_load(local=0, end=192, chunk_size=64)
    assert (p.first_chunk, p.num_chunks, p.skip_tokens) == (0, 3, 0)
    p = plan_load(local=128, end=200, chunk_size=64)  # end inside a chunk: the tail cannot load
    assert (p.first_chunk, p.num_chunks, p.skip_tokens, p.loadable_end) == (2, 1, 0, 192)
    p = plan_load(local=130, end=150, chunk_size=64)  # no whole chunk at all
    assert p.num_chunks == 0 and p.loadable_end == 130


def test_per_gid_block_slices_per_chunk():
    gid0 = list(range(100, 116))  # 16 tokens per block: 4 blocks per 64-token chunk
    gid1 = list(range(200, 208))  # 32 tokens per block: 2 blocks per chunk
    assert chunk_block_ids(gid0, 16, 64, 1, 3) == list(range(104, 112))
    assert chunk_block_ids(gid1, 32, 64, 1, 3) == [202, 203, 204, 205]
    assert chunk_block_ids(gid1, 32, 64, 3, 5) is None  # table too short
    assert blocks_covering(gid0, 16, 96, 130) == [106, 107, 108]


# ---------------------------------------------------------------------- vLLM config -> registration


def test_transfer_groups_of_dense_hybrid_and_recurrent_models(model):
    cfg = H.make_vllm_config(model, NO_DAEMON)
    kcc, _, _, _ = H.plan_kv_cache(cfg, H.hybrid_specs(), 256)
    groups, why = transfer_groups(kcc)
    assert not why
    assert [(g.daemon_gid, g.block_size, g.has_null_blocks) for g in groups] == [(0, 16, False), (1, 32, True)]

    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    mamba = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l0"], MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,)))])
    groups, why = transfer_groups(mamba)
    assert not groups and "MambaSpec" in why


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
def test_registration_of_vllm_views_matches_the_schedulers_fingerprint(model, layout):
    """The worker describes vLLM's real per-layer views (over one shared-memory allocation);
    the daemon's layout code accepts them and gives the fingerprint the scheduler predicted."""
    cfg = H.make_vllm_config(model, NO_DAEMON, layout=layout)
    kcc, sched_cfg, _, _ = H.plan_kv_cache(cfg, H.hybrid_specs(), 256)
    groups, _ = transfer_groups(kcc)
    segs = ShmSegments()
    try:
        with segs.allocation_context():
            caches = H.allocate_kv_cache(kcc, cfg.cache_config.get_resolved_kv_cache_layout(), H.torch.device("cpu"))
        assert len(segs.made) == 1 and find_shm_segment(next(iter(caches.values()))) is not None
        reg = build_registration(caches, kcc, groups)
        assert reg.device == "cpu" and [s.kind for s in reg.storages] == ["memfd"]  # sealed (kvdepot.gpu.shm)
        assert reg.storage_fds == [segs.made[0][0]]
        with pytest.raises(PermissionError):
            os.ftruncate(segs.made[0][0], 0)
        assert [(g.gid, g.tokens_per_block) for g in reg.groups] == [(0, 16), (1, 32)]
        lay = group_layers(reg.layers, reg.groups, 64, [s.size_bytes for s in reg.storages])
        sched_groups, _ = transfer_groups(sched_cfg)
        assert lay.fingerprint == predict_fingerprint(sched_cfg, sched_groups, 64, layout)
        assert lay.fingerprint == predict_fingerprint(kcc, groups, 64, layout)
    finally:
        segs.close()
    assert not segs.made


def test_cpu_views_outside_shared_memory_are_refused(model):
    cfg = H.make_vllm_config(model, NO_DAEMON)
    kcc, _, _, _ = H.plan_kv_cache(cfg, H.dense_specs(), 256)
    caches = H.allocate_kv_cache(kcc, cfg.cache_config.get_resolved_kv_cache_layout(), H.torch.device("cpu"))  # plain memory
    with pytest.raises(ValueError, match="must live in shared memory"):
        build_registration(caches, kcc, transfer_groups(kcc)[0])


# ---------------------------------------------------------------------- channel without a daemon


def test_client_without_a_daemon_fails_fast_and_probes_at_its_interval():
    """What the connector's two sides rely on: a client made while no daemon runs, calls that
    fail at once (UNAVAILABLE), and `available` that never blocks and pings at most every
    retry_interval_s."""
    c = KVDepotClient(NO_DAEMON, timeout_s=5.0, connect=False, retry_interval_s=0.2)
    try:
        t0 = time.monotonic()
        with pytest.raises(KVDepotError) as e:
            c.call(m.Ping(rid=0))
        assert e.value.code == ErrorCode.UNAVAILABLE and time.monotonic() - t0 < 0.5
        c.mark_down()
        t0 = time.monotonic()
        assert [c.available() for _ in range(50)] == [False] * 50
        assert time.monotonic() - t0 < 0.05
    finally:
        c.close()
