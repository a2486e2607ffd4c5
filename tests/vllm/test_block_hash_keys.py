"""Chunk keys taken from vLLM's own prefix-cache block hashes (`kvdepot.client.hashing.chain_from_block_hashes`,
`kvdepot.client.vllm.config.block_hash_chains`): which vLLM configurations allow them, that
they are the same in another process, that engines of the two key sources never share a key,
and that a request vLLM built without block hashes hashes its tokens instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402
from connector_testing import CHUNK, stored_chunks  # noqa: E402
from kvdepot.client.hashing import KEY_BYTES, chain_from_block_hashes, chunk_keys, namespace_seed  # noqa: E402
from kvdepot.client.vllm.config import ConnectorConfig  # noqa: E402
from kvdepot.client.vllm.config import block_hash_chains  # noqa: E402

HERE = Path(__file__).resolve().parent


def test_chain_values_are_the_last_block_hash_of_each_chunk_truncated():
    hashes = [bytes([i]) * 32 for i in range(12)]  # 12 blocks, 4 per chunk: 3 chunks
    assert chain_from_block_hashes(hashes, 4, 0, 3) == [bytes([3]) * 16, bytes([7]) * 16, bytes([11]) * 16]
    assert chain_from_block_hashes(hashes, 4, 1, 3) == [bytes([7]) * 16, bytes([11]) * 16]
    assert chain_from_block_hashes(hashes, 4, 2, 2) == []
    with pytest.raises(ValueError, match="chunk 3 needs 16 block hashes; the request has 12"):
        chain_from_block_hashes(hashes, 4, 0, 4)
    with pytest.raises(ValueError, match="shorter than 16 bytes"):
        chain_from_block_hashes([b"x" * 8] * 4, 4, 0, 1)


def _configs(algo: str, hash_block_size: int | None):
    return (types.SimpleNamespace(cache_config=types.SimpleNamespace(prefix_caching_hash_algo=algo)),
            types.SimpleNamespace(hash_block_size=hash_block_size))


@pytest.mark.parametrize("source", ["auto", "vllm"])
def test_block_hashes_are_used_only_where_vllm_makes_them_reproducible(source, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    cfg = ConnectorConfig.from_extra({"endpoint": "ipc:///x", "chunk_size": 256, "key_source": source})
    assert block_hash_chains(cfg, *_configs("sha256", 16)) == (16, "vllm-block-hash/sha256")
    assert block_hash_chains(cfg, *_configs("sha256_cbor", 64)) == (4, "vllm-block-hash/sha256_cbor")
    refused = [
        (_configs("xxhash", 16), "prefix_caching_hash_algo 'xxhash' is not one of"),  # no collision resistance
        (_configs("sha256", 48), "chunk_size 256 is not a multiple of vLLM's hash block size 48"),
        (_configs("sha256", None), "vLLM gave no hash_block_size"),
    ]
    for configs, why in refused:
        if source == "auto":
            per, reason = block_hash_chains(cfg, *configs)
            assert per == 0 and why in reason
        else:
            with pytest.raises(ValueError, match="key_source is vllm, but " + why.split("'")[0]):
                block_hash_chains(cfg, *configs)
    tokens = ConnectorConfig.from_extra({"endpoint": "ipc:///x", "key_source": "tokens"})
    assert block_hash_chains(tokens, *_configs("sha256", 16))[0] == 0
    with pytest.raises(ValueError, match="key_source: 'blocks'; one of"):
        ConnectorConfig.from_extra({"endpoint": "ipc:///x", "key_source": "blocks"})


def test_keys_come_from_vllms_block_hashes_and_match_another_process(shared_daemon, cfg, engines):
    e = engines(cfg(shared_daemon.endpoint))
    prompt = H.tokens(41, 3 * CHUNK + 5)
    rid = e.add(prompt, max_tokens=1)
    side = e.sched_conn
    st = side._reqs[rid]
    req = e.scheduler.requests[rid]
    per = CHUNK // e.hash_block_size
    assert st.from_block_hashes and side._blocks_per_chunk == per
    assert st.chain == [bytes(req.block_hashes[(i + 1) * per - 1])[:KEY_BYTES] for i in range(3)]
    # model_id with the toy model's (unquantized, KV cache in the model's dtype) other factors
    assert side.model_id == "test_keys_come_from_vllms_block_hashes_and_match_another_process|rev=|q=|kv=auto"
    assert st.seed == namespace_seed(side.model_id, side.fingerprint, "", "vllm-block-hash/sha256")
    # vLLM's block hashes of the same prompt in a fresh process (the harness seeds them as vLLM's
    # engine core does: init_none_hash(sha256)): equal, so another engine process finds these keys
    code = ("import json, sys, vllm_harness as H\n"
            "from vllm import SamplingParams\n"
            "from vllm.v1.core.kv_cache_utils import get_request_block_hasher\n"
            "from vllm.utils.hashing import sha256\n"
            "from vllm.v1.request import Request\n"
            "sp = SamplingParams(max_tokens=1)\n"
            f"r = Request('other', H.tokens(41, {3 * CHUNK + 5}), sp, None, "
            f"block_hasher=get_request_block_hasher({e.hash_block_size}, sha256))\n"
            "print(json.dumps([bytes(h).hex() for h in r.block_hashes]))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [bytes(h).hex() for h in req.block_hashes]
    e.run()
    assert e.worker_conn.stats["stored_chunks"] == 3


def test_engines_of_the_two_key_sources_never_share_a_key(shared_daemon, cfg, engines):
    prompt = H.tokens(42, 2 * CHUNK + 3)
    a = engines(cfg(shared_daemon.endpoint, extra={"key_source": "tokens"}))
    ra = a.add(prompt, max_tokens=1)
    st = a.sched_conn._reqs[ra]
    assert not st.from_block_hashes
    # the tokens' keys are those of every other kvdepot client of this namespace
    seed = namespace_seed(a.sched_conn.model_id, a.sched_conn.fingerprint, "")
    assert st.keys[0] == chunk_keys(seed, prompt, CHUNK, "tp0of1")
    a.run()
    assert stored_chunks(shared_daemon.endpoint, a) == 2
    b = engines(cfg(shared_daemon.endpoint))  # auto: vLLM's block hashes
    rb = b.add(prompt, max_tokens=1)
    b.run()
    assert b.runs[rb].computed == 2 * CHUNK + 3, "keys of another source must not hit"
    assert stored_chunks(shared_daemon.endpoint, b) == 2  # stored again under its own keys
    c = engines(cfg(shared_daemon.endpoint))
    rc = c.add(prompt, max_tokens=1)
    c.run()
    assert c.runs[rc].computed == 3, "an engine of the same source loads both chunks"


def test_a_request_without_block_hashes_hashes_its_tokens(shared_daemon, cfg, engines):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    e = engines(cfg(shared_daemon.endpoint))
    prompt = H.tokens(43, 2 * CHUNK)
    req = Request("no-hasher", prompt, SamplingParams(max_tokens=1), None)  # vLLM built it without a block hasher
    assert not req.block_hashes
    side = e.sched_conn
    st = side._state(req)
    assert not st.from_block_hashes
    assert st.keys[0] == chunk_keys(namespace_seed(side.model_id, side.fingerprint, ""), prompt, CHUNK, "tp0of1")
    side.request_finished(req)
