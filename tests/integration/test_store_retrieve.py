"""STORE in one engine process, RETRIEVE in another, against a real daemon, with real model KV
shapes: every retrieved byte must equal the storing engine's byte, whatever the two engines'
physical layouts, block sizes and block ids; plus the daemon's caching rules (present chunks,
missing parents, pins, prefix-aware eviction, tenant salts, flush, unregister, dead engines).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import time

import pytest
import torch

import kv_engine as ke
from kv_engine import EngineSpec, RetrieveJob, StoreJob
from kvdepot.client import KVDepotClient
from kvdepot.client.kvcache import ShmKVCache
from kvdepot.protocol.errors import ErrorCode, KVDepotError


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    model: str
    a_layout: str
    b_layout: str
    a_tpb: tuple[int, ...]  # tokens per block per gid, engine A
    b_tpb: tuple[int, ...]  # engine B
    chunk_size: int
    shard: str = "tp0of1"
    prompt_chunks: int = 3  # whole chunks A stores


CASES = [
    Case("llama8b-LBNHC-to-LBHNC", ke.LLAMA_8B, "LBNHC", "LBHNC", (16,), (16,), 64),
    Case("llama8b-LBNHC-to-flash_attn_hnd-bs32", ke.LLAMA_8B, "LBNHC", "flash_attn_hnd", (16,), (32,), 64),
    Case("qwen7b-LBNHC-to-flashinfer", ke.QWEN_7B, "LBNHC", "flashinfer", (16,), (16,), 64),
    Case("qwen7b-LBNHC-to-BLHNC", ke.QWEN_7B, "LBNHC", "BLHNC", (16,), (16,), 64),
    Case("gpt-oss-20b-hybrid-LBNHC-to-LBHNC", ke.GPT_OSS_20B, "LBNHC", "LBHNC", (16, 32), (16, 32), 64),
    Case("gemma2-2b-hybrid-LBNHC-to-flash_attn_hnd", ke.GEMMA2_2B, "LBNHC", "flash_attn_hnd", (16, 32), (16, 32), 64),
    Case("gemma2-2b-hybrid-LBNHC-to-flashinfer", ke.GEMMA2_2B, "LBNHC", "flashinfer", (16, 32), (32, 16), 64),
    Case("deepseek-v3-mla-bs64-to-bs32", ke.DEEPSEEK_V3_MLA, "mla", "mla", (64,), (32,), 128, "replicated", 2),
    Case("deepseek-v3.2-fp8_ds_mla+indexer", ke.DEEPSEEK_V32_FP8, "mla", "mla", (64, 64), (32, 64), 128,
         "replicated", 2),
]


def _specs(case: Case, endpoint: str, seed: int) -> tuple[EngineSpec, EngineSpec]:
    n = case.prompt_chunks
    a_nb = tuple(n * case.chunk_size // t + 3 for t in case.a_tpb)
    b_nb = tuple((n + 1) * case.chunk_size // t + 5 for t in case.b_tpb)
    a = EngineSpec(endpoint, case.model, case.a_layout, case.a_tpb, a_nb, case.chunk_size, seed, case.shard)
    b = EngineSpec(endpoint, case.model, case.b_layout, case.b_tpb, b_nb, case.chunk_size, seed + 1, case.shard)
    return a, b


def _tuples(ids):
    return tuple(tuple(x) for x in ids)


def run_store_then_retrieve(engines, case: Case, endpoint: str, seed: int, skip_tokens: int = 0,
                            cache_salt: str = "") -> tuple[dict, dict]:
    """A stores the prompt's whole chunks; B looks up prompt + one more chunk + a partial chunk,
    retrieves every whole chunk into shuffled blocks and verifies its whole cache."""
    a, b = _specs(case, endpoint, seed)
    n, cs = case.prompt_chunks, case.chunk_size
    tokens = ke.prompt_tokens(seed, n * cs + 5)
    a_ids = ke.rotated_block_ids(a, n)
    ra = engines.run_a(ke.store_job, StoreJob(a, tuple(tokens), _tuples(a_ids), cache_salt=cache_salt))
    assert ra["num_chunks"] == n and ra["hit"] == n, ra
    assert ra["replies"] == [[1, 0, 0], [n - 1, 0, 0]], ra
    b_tokens = tokens[: n * cs] + ke.prompt_tokens(seed + 7, cs + 7)
    b_ids = ke.shuffled_block_ids(b, n + 1, seed)
    rb = engines.run_b(ke.retrieve_job, RetrieveJob(b, a, _tuples(a_ids), tuple(b_tokens), _tuples(b_ids),
                                                      skip_tokens=skip_tokens, cache_salt=cache_salt))
    assert rb["pid"] != ra["pid"]
    assert rb["fingerprint"] == ra["fingerprint"], "object format must not depend on the physical layout"
    assert rb["object_bytes"] == ra["object_bytes"]
    assert rb["num_chunks"] == n + 1 and rb["hit"] == n and rb["retrieved"] == n, rb
    assert rb["problems"] == [], "\n".join(rb["problems"])
    return ra, rb


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_store_in_one_engine_retrieve_in_another(engines, module_daemon, case: Case):
    seed = 1000 + CASES.index(case)
    print(f"seed {seed}")
    ra, _ = run_store_then_retrieve(engines, case, module_daemon.endpoint, seed)
    groups = ke.model_groups(case.model, case.a_tpb)
    assert ra["object_bytes"] == case.chunk_size * sum(g.num_layers * g.token_bytes for g in groups)


@pytest.mark.parametrize("case,skip_tokens", [
    (CASES[2], 16),  # one block of chunk 0
    (CASES[2], 80),  # all of chunk 0 and one block of chunk 1
    (CASES[4], 96),  # hybrid 16/32 tokens per block: chunk 0, and 2 resp. 1 blocks of chunk 1
], ids=["qwen-skip16", "qwen-skip80", "gpt-oss-skip96"])
def test_retrieve_skip_tokens_leaves_skipped_blocks_untouched(engines, module_daemon, case: Case, skip_tokens: int):
    seed = 2000 + skip_tokens
    print(f"seed {seed}")
    # B's verification expects its own bytes in the skipped blocks and A's bytes after them
    run_store_then_retrieve(engines, case, module_daemon.endpoint, seed, skip_tokens=skip_tokens)


def test_token_view_matches_engine_tensors(tmp_path):
    """The tests' oracle (`ShmKVCache.token_view`) agrees with the engine tensors it describes."""
    groups = ke.model_groups(ke.SMOLLM2, (16,))
    for layout in ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "flash_attn_nhd", "flash_attn_hnd", "flashinfer"):
        with ShmKVCache(groups, 3, layout) as cache:
            ke.fill_cache(cache, 5)
            for layer in (0, len(cache.layer_names) - 1):
                t = cache.engine_tensors[layer]
                if layout in ("LBNHC", "LBHNC", "BLNHC", "BLHNC"):  # [nb, H, N, C] int8
                    nb, h, n, c = t.shape
                    want = t.permute(0, 2, 1, 3).contiguous().view(torch.uint8).reshape(nb, n, h, 2, c // 2)
                elif layout.startswith("flash_attn"):  # (2, nb, N, H, D)
                    want = t.permute(1, 2, 3, 0, 4).contiguous().view(torch.uint8)
                else:  # (nb, 2, N, H, D)
                    want = t.permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8)
                assert torch.equal(cache.token_view(layer, as_bytes=True), want), (layout, layer)
    mla = ke.model_groups(ke.DEEPSEEK_V3_MLA, (16,))
    with ShmKVCache(mla, 2, "mla") as cache:
        ke.fill_cache(cache, 6)
        t = cache.engine_tensors[3]  # (nb, N, 576) bf16
        want = t.contiguous().view(torch.uint8).reshape(2, 16, 1, 1, 1152)
        assert torch.equal(cache.token_view(3, as_bytes=True), want)


# ------------------------------------------------------------------------ caching rules
# (the test process itself is the engine here; the daemon is a separate process)


def small_spec(endpoint: str, seed: int, num_blocks: int = 24, model_id: str = "", layout: str = "LBNHC",
               chunk_size: int = 16) -> EngineSpec:
    """SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, bf16): 16-token chunk = 360 KiB."""
    return EngineSpec(endpoint, ke.SMOLLM2, layout, (16,), (num_blocks,), chunk_size, seed, model_id=model_id)


def blocks(*ids: int) -> list[list[int]]:
    return [list(ids)]


def read_blocks(eng: ke.Engine, ids) -> list[torch.Tensor]:
    return [eng.cache.read_tokens(layer, ids, as_bytes=True) for layer in range(len(eng.cache.layer_names))]


def assert_same_tokens(a: ke.Engine, a_ids, b: ke.Engine, b_ids) -> None:
    for layer, (x, y) in enumerate(zip(read_blocks(a, a_ids), read_blocks(b, b_ids))):
        assert torch.equal(x, y), f"layer {layer} differs"


def test_second_store_of_same_chunks_answers_present_without_copying(engines, module_daemon):
    """A stores; another engine with different bytes stores the same token chunks: all present,
    nothing copied, and a retrieve still yields A's bytes."""
    case, seed = CASES[3], 3000
    ra, _ = run_store_then_retrieve(engines, case, module_daemon.endpoint, seed)
    a, b = _specs(case, module_daemon.endpoint, seed)
    n, cs = case.prompt_chunks, case.chunk_size
    tokens = ke.prompt_tokens(seed, n * cs + 5)
    other = dataclasses.replace(a, fill_seed=seed + 99)
    with KVDepotClient(module_daemon.endpoint) as c:
        before = c.describe()
    r2 = engines.run_b(ke.store_job, StoreJob(other, tuple(tokens), _tuples(ke.shuffled_block_ids(other, n, 5)),
                                               first_batch=n))
    assert r2["replies"] == [[0, n, 0]], r2
    with KVDepotClient(module_daemon.endpoint) as c:
        after = c.describe()
    assert after.stored_chunks == before.stored_chunks
    assert after.tiers[0].used_bytes == before.tiers[0].used_bytes
    # the cached bytes are still A's
    a_ids = ke.rotated_block_ids(a, n)
    rb = engines.run_b(ke.retrieve_job, RetrieveJob(b, a, _tuples(a_ids), tuple(tokens),
                                                      _tuples(ke.shuffled_block_ids(b, n, 8))))
    assert rb["retrieved"] == n and rb["problems"] == [], rb


def test_store_with_missing_parent_is_skipped(module_daemon):
    spec = small_spec(module_daemon.endpoint, 3100, model_id="parent-test")
    tokens = ke.prompt_tokens(3100, 4 * 16)
    with ke.Engine(spec) as eng:
        keys = eng.keys(tokens)
        c = eng.client
        r = c.store(eng.reg, keys[1:], blocks(1, 2, 3), parent=keys[0])  # chunk 0 never stored
        assert (r.stored, r.present, r.skipped) == (0, 0, 3)
        assert c.lookup(keys, 16) == 0
        assert c.lookup([keys[1]], 16) == 0, "an orphan chunk must not become visible"
        r = c.store(eng.reg, keys[2:], blocks(2, 3), parent=b"\x00" * 16)  # a parent nobody stored
        assert (r.stored, r.present, r.skipped) == (0, 0, 2)
        # with its parent in place the same store succeeds
        assert c.store(eng.reg, keys[:1], blocks(0)).stored == 1
        r = c.store(eng.reg, keys[1:], blocks(1, 2, 3), parent=keys[0])
        assert (r.stored, r.present, r.skipped) == (3, 0, 0)
        assert c.lookup(keys, 16) == 4


def _capacity_objects(client: KVDepotClient, object_bytes: int) -> int:
    cap = client.describe().tiers[0].capacity_bytes
    return cap // ((object_bytes + 4095) // 4096 * 4096)


def test_pinned_lookup_keeps_chunks_until_end_request(daemon_factory):
    d = daemon_factory(l1_bytes="4m")
    spec = small_spec(d.endpoint, 3200, num_blocks=16)
    with ke.Engine(spec) as eng:
        c = eng.client
        cap = _capacity_objects(c, eng.reg.object_bytes)
        assert 8 <= cap <= 16, cap
        x = eng.keys(ke.prompt_tokens(1, 4 * 16))
        y = eng.keys(ke.prompt_tokens(2, cap * 16))
        z = eng.keys(ke.prompt_tokens(3, cap * 16))
        assert c.store(eng.reg, x, blocks(0, 1, 2, 3)).stored == 4
        assert c.lookup(x, 16, pin_request="req-1") == 4
        assert c.describe().pinned_requests == 1
        r = c.store(eng.reg, y, blocks(*range(cap)))
        assert (r.stored, r.present, r.skipped) == (cap - 4, 0, 4), "pinned chunks must not be evicted"
        assert c.lookup(x, 16) == 4
        c.end_request("req-1")
        assert c.describe().pinned_requests == 0
        r = c.store(eng.reg, z, blocks(*range(cap)))
        assert (r.stored, r.present, r.skipped) == (cap, 0, 0)
        assert c.lookup(x, 16) == 0, "unpinned chunks are evictable again"
        assert c.lookup(z, 16) == cap
    assert d.alive


def test_eviction_keeps_serving_and_keeps_prefix_heads(daemon_factory):
    d = daemon_factory(l1_bytes="4m")
    spec = small_spec(d.endpoint, 3300, num_blocks=24)
    with ke.Engine(spec) as eng, ke.Engine(dataclasses.replace(spec, layout="LBHNC", fill_seed=3301)) as other:
        c = eng.client
        cap = _capacity_objects(c, eng.reg.object_bytes)
        n = 8
        assert n < cap < 2 * n, cap
        x = eng.keys(ke.prompt_tokens(11, n * 16))
        y = eng.keys(ke.prompt_tokens(12, n * 16))
        assert c.store(eng.reg, x, blocks(*range(0, 8))).stored == n
        assert c.store(eng.reg, y, blocks(*range(8, 16))).stored == n
        evicted = 2 * n - cap
        info = c.describe()
        assert info.evicted_chunks == evicted and info.tiers[0].num_objects == cap
        # prefix-aware: x lost its tail, never a head or a middle chunk
        assert c.lookup(x, 16) == n - evicted
        assert c.lookup(y, 16) == n
        for k in range(n - evicted):
            assert c.lookup([x[k]], 16) == 1
        # the survivors are served bit-exact (into another engine, another layout)
        got = other.client.retrieve(other.reg, x, blocks(*range(16, 24)))
        assert got == n - evicted
        assert_same_tokens(eng, range(0, got), other, range(16, 16 + got))
        # storing x again refills its tail and evicts y's tail (the least recently used leaves)
        r = c.store(eng.reg, x, blocks(*range(0, 8)))
        assert (r.stored, r.present, r.skipped) == (evicted, n - evicted, 0)
        assert c.lookup(x, 16) == n
        assert c.lookup(y, 16) == n - evicted
        assert c.describe().evicted_chunks == 2 * evicted
        # an object larger than all of L1 is skipped without evicting anything
        big = EngineSpec(d.endpoint, ke.LLAMA_8B, "LBNHC", (16,), (4,), 64, 3302)
        with ke.Engine(big) as llama:
            assert llama.reg.object_bytes > c.describe().tiers[0].capacity_bytes
            r = llama.client.store(llama.reg, llama.keys(ke.prompt_tokens(13, 64)), blocks(0, 1, 2, 3))
            assert (r.stored, r.present, r.skipped) == (0, 0, 1)
        info = c.describe()
        assert info.evicted_chunks == 2 * evicted and info.tiers[0].num_objects == cap
        assert c.lookup(x, 16) == n and c.lookup(y, 16) == n - evicted
    assert d.alive


def test_cache_salt_isolates_tenants(module_daemon):
    spec = small_spec(module_daemon.endpoint, 3400, model_id="salt-test")
    tokens = ke.prompt_tokens(3400, 3 * 16)
    with ke.Engine(spec) as eng, ke.Engine(dataclasses.replace(spec, layout="LBHNC", fill_seed=3401)) as other:
        c = eng.client
        ka, kb, k0 = eng.keys(tokens, "tenant-a"), eng.keys(tokens, "tenant-b"), eng.keys(tokens)
        assert len({*ka, *kb, *k0}) == 9, "salted keys must differ"
        r = c.store(eng.reg, ka, blocks(0, 1, 2), cache_salt="tenant-a")
        assert r.stored == 3
        assert c.lookup(ka, 16) == 3
        assert c.lookup(kb, 16) == 0
        assert c.lookup(k0, 16) == 0
        assert other.client.retrieve(other.reg, kb, blocks(5, 6, 7)) == 0
        assert other.client.retrieve(other.reg, other.keys(tokens, "tenant-b"), blocks(5, 6, 7)) == 0
        assert other.client.retrieve(other.reg, other.keys(tokens, "tenant-a"), blocks(5, 6, 7)) == 3
        assert_same_tokens(eng, [0, 1, 2], other, [5, 6, 7])
        # the unsalted chunks of the same tokens are a separate namespace
        assert c.store(eng.reg, k0, blocks(3, 4, 5)).stored == 3
        f = c.flush(cache_salt="tenant-b")
        assert f.objects == 0
        f = c.flush(cache_salt="tenant-a")
        assert (f.objects, f.bytes) == (3, 3 * eng.reg.object_bytes)
        assert c.lookup(ka, 16) == 0 and c.lookup(k0, 16) == 3
        assert c.flush(cache_salt="").objects >= 3
        assert c.lookup(k0, 16) == 0


def test_flush_by_model_and_all(daemon):
    s1 = small_spec(daemon.endpoint, 3500, model_id="flush-m1")
    s2 = small_spec(daemon.endpoint, 3501, model_id="flush-m2", layout="BLHNC")
    tokens = ke.prompt_tokens(3500, 4 * 16)
    with ke.Engine(s1) as e1, ke.Engine(s2) as e2:
        k1, k2 = e1.keys(tokens), e2.keys(tokens)
        assert k1 != k2, "the model is part of the key namespace"
        assert e1.client.store(e1.reg, k1, blocks(0, 1, 2, 3)).stored == 4
        assert e2.client.store(e2.reg, k2[:2], blocks(4, 5)).stored == 2
        f = e1.client.flush(model="flush-m1")
        assert (f.objects, f.bytes) == (4, 4 * e1.reg.object_bytes)
        assert e1.client.lookup(k1, 16) == 0
        assert e2.client.lookup(k2, 16) == 2
        assert e1.client.flush(model="flush-m1").objects == 0
        f = e2.client.flush()
        assert (f.objects, f.bytes) == (2, 2 * e2.reg.object_bytes)
        info = e2.client.describe()
        assert info.tiers[0].num_objects == 0 and info.tiers[0].used_bytes == 0
        assert e2.client.lookup(k2, 16) == 0
        # flushed chunks can be stored again
        assert e1.client.store(e1.reg, k1, blocks(0, 1, 2, 3)).stored == 4


def test_unregister(module_daemon):
    spec = small_spec(module_daemon.endpoint, 3600, model_id="unreg-test")
    eng = ke.Engine(spec)
    try:
        c = eng.client
        assert eng.reg.id in {e.registration for e in c.describe().engines}
        keys = eng.keys(ke.prompt_tokens(3600, 32))
        c.unregister(eng.reg)
        assert eng.reg.id not in {e.registration for e in c.describe().engines}
        for call in (lambda: c.store(eng.reg, keys, blocks(0, 1)), lambda: c.retrieve(eng.reg, keys, blocks(0, 1)),
                     lambda: c.unregister(eng.reg)):
            with pytest.raises(KVDepotError) as ei:
                call()
            assert ei.value.code is ErrorCode.UNKNOWN_REGISTRATION
        # re-registering gives a new id that works
        reg2 = c.reregister(eng.reg)
        assert reg2.id != eng.reg.id
        assert c.store(reg2, keys, blocks(0, 1)).stored == 2
        c.unregister(reg2)
    finally:
        eng.close(unregister=False)


def test_engine_that_exits_without_unregistering_is_reclaimed(module_daemon, tmp_path):
    spec = small_spec(module_daemon.endpoint, 3700, model_id="doomed-engine")
    tokens = ke.prompt_tokens(3700, 3 * 16)
    ctx = multiprocessing.get_context("spawn")
    registered, proceed = ctx.Event(), ctx.Event()
    out = tmp_path / "doomed.json"
    p = ctx.Process(target=ke.register_store_and_die, args=(spec, tokens, str(out), registered, proceed))
    p.start()
    try:
        assert registered.wait(60), "engine process did not register"
        info = json.loads(out.read_text())
        assert info["stored"] == 3
        with KVDepotClient(module_daemon.endpoint) as c:
            eng_info = {e.registration: e for e in c.describe().engines}[info["registration"]]
            assert eng_info.pid == info["pid"] == p.pid
            assert c.describe().pinned_requests >= 1
            proceed.set()
            p.join(30)
            assert p.exitcode == 0
            deadline = time.monotonic() + 5.0
            while info["registration"] in {e.registration for e in c.describe().engines}:
                assert time.monotonic() < deadline, "dead engine's registration not reclaimed within 5 s"
                time.sleep(0.1)
            deadline = time.monotonic() + 3.0
            while c.describe().pinned_requests:
                assert time.monotonic() < deadline, "dead engine's pins not released"
                time.sleep(0.1)
        # what it stored stays cached and is served to the next engine bit-exact
        with ke.Engine(dataclasses.replace(spec, layout="flashinfer", fill_seed=3701)) as eng:
            keys = eng.keys(tokens)
            assert eng.client.retrieve(eng.reg, keys, blocks(7, 3, 5)) == 3
            problems = ke.verify_cache(eng.cache, eng.spec, blocks(7, 3, 5), spec, ke.rotated_block_ids(spec, 3, 0),
                                       0, 48)
            assert problems == []
    finally:
        proceed.set()
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join()
        assert module_daemon.alive
