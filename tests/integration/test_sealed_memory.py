"""CPU engines on sealed memfds (kvdepot.gpu.shm, kvdepot.protocol.fdpass): KV bytes move exactly
as with named segments, nobody can shrink the memory under the daemon's copies, and the daemon
refuses what would let a copy fault (an unsealed memfd, a token nobody passed)."""

from __future__ import annotations

import os
import socket

import pytest

import kv_engine as ke
from kvdepot.client import KVDepotClient
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError
from kvdepot.protocol.fdpass import fds_path, pass_fds
from kvdepot.protocol.transport import ipc_path


def _spec(endpoint: str, seed: int, layout: str = "LBNHC") -> ke.EngineSpec:
    return ke.EngineSpec(endpoint, ke.SMOLLM2, layout, (16,), (24,), 16, seed, model_id="sealed", sealed=True)


def test_sealed_engines_store_and_retrieve_every_byte_across_layouts(module_daemon):
    a_spec = _spec(module_daemon.endpoint, 8100)
    tokens = ke.prompt_tokens(8100, 4 * 16)
    with ke.Engine(a_spec) as a, ke.Engine(_spec(module_daemon.endpoint, 8101, "flashinfer")) as b:
        assert a.reg.request.storages[0].kind == "memfd"
        a_ids = ke.rotated_block_ids(a_spec, 4)
        assert a.client.store(a.reg, a.keys(tokens), a_ids).stored == 4
        b_ids = ke.shuffled_block_ids(b.spec, 4, seed=3)
        assert b.client.retrieve(b.reg, b.keys(tokens), b_ids) == 4
        assert ke.verify_cache(b.cache, b.spec, b_ids, a_spec, a_ids, 0, 64) == []
        # registering again (as after a daemon restart) passes the descriptor again
        reg2 = b.client.reregister(b.reg)
        assert reg2.id != b.reg.id and b.client.retrieve(reg2, b.keys(tokens), b_ids) == 4


def test_nobody_can_shrink_a_registered_memfd(module_daemon):
    with ke.Engine(_spec(module_daemon.endpoint, 8200)) as eng:
        with pytest.raises(PermissionError):
            os.ftruncate(eng.cache.fd, 0)
        # another process of the same user, through /proc, as a confused or hostile engine would
        fd = os.open(f"/proc/{os.getpid()}/fd/{eng.cache.fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 4096)
        finally:
            os.close(fd)
        keys = eng.keys(ke.prompt_tokens(8200, 32))
        assert eng.client.store(eng.reg, keys, [[0, 1]]).stored == 2
    assert module_daemon.alive


def _register_memfd(endpoint: str, token: str, size: int) -> None:
    with KVDepotClient(endpoint) as c:
        spec = _spec(endpoint, 8300)
        with ke.ShmKVCache(spec.groups(), list(spec.num_blocks), spec.layout) as layout_src:
            layers = layout_src.layer_specs()
        c.call(m.Register(rid=0, model="sealed", shard="tp0of1", chunk_size=16,
                          storages=[m.StorageSpec(kind="memfd", size_bytes=size, name=token)], layers=layers,
                          groups=[m.KVGroupSpec(gid=0, tokens_per_block=16)]))


def test_a_named_segment_is_refused_unless_the_operator_allows_it(module_daemon):
    """A named /dev/shm segment can be shrunk under a copy (SIGBUS would kill the daemon for
    every engine): refused with an error that names the flag (``--allow-shm-names``)."""
    spec = ke.EngineSpec(module_daemon.endpoint, ke.SMOLLM2, "LBNHC", (16,), (8,), 16, 8250, model_id="named",
                         sealed=False)
    with pytest.raises(KVDepotError) as err:
        ke.Engine(spec)
    assert err.value.code is ErrorCode.FORBIDDEN and "--allow-shm-names" in str(err.value)
    assert module_daemon.alive and not module_daemon.log().count("Traceback")


def test_the_daemon_refuses_unsealed_memfds_and_unknown_tokens(module_daemon):
    spec = _spec(module_daemon.endpoint, 8300)
    with ke.ShmKVCache(spec.groups(), list(spec.num_blocks), spec.layout) as named:
        size = named.size_bytes
    fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        token = pass_fds(fds_path(ipc_path(module_daemon.endpoint)), [fd])
        with pytest.raises(KVDepotError) as err:
            _register_memfd(module_daemon.endpoint, token, size)
        assert err.value.code is ErrorCode.ENGINE_MEMORY and "not sealed" in str(err.value)
        with pytest.raises(KVDepotError) as err:  # a token is taken once
            _register_memfd(module_daemon.endpoint, token, size)
        assert err.value.code is ErrorCode.ENGINE_MEMORY and "no descriptor was passed" in str(err.value)
    finally:
        os.close(fd)
    assert module_daemon.alive


def test_garbage_on_the_descriptor_socket_is_refused(module_daemon):
    path = fds_path(ipc_path(module_daemon.endpoint))
    for payload in (b"short", b"x" * 40, b"\xff" * 20):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(payload)  # no descriptors
            assert s.recv(1) == b"\x01"
    with KVDepotClient(module_daemon.endpoint) as c:
        assert c.ping()
