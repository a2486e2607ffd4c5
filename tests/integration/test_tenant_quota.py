"""Per-tenant quotas (`kvdepot.server.quotas`) through a real daemon: a tenant that floods L1
evicts only its own chunks once at its quota, so another tenant's working set keeps hitting; the
same flood on a daemon without the quota evicts it. Also describe's and /metrics' per-tenant
figures, and the quota in L2."""

from __future__ import annotations

import urllib.request

import kv_engine as ke
from prometheus_client.parser import text_string_to_metric_families
from test_l2_tier import settle
from test_store_retrieve import blocks, small_spec

CHUNKS = 3  # per prompt (16-token chunks of SmolLM2: 360 KiB each)
L1 = "16m"  # about 44 chunks


def _round(eng: ke.Engine, prompts: list[list[bytes]], salt: str) -> tuple[int, int]:
    """Each prompt looked up (as an engine's scheduler would), and stored again where it missed
    (as the engine would after recomputing it): (chunks hit, chunks asked for)."""
    hit = 0
    for keys in prompts:
        n = eng.client.lookup(keys, 16)
        hit += n
        if n < len(keys):
            r = eng.client.store(eng.reg, keys, blocks(*range(len(keys))), cache_salt=salt)
            assert r.stored + r.present == len(keys), r
    return hit, sum(len(k) for k in prompts)


def _flood(eng: ke.Engine, seed: int, prompts: int, salt: str) -> None:
    for s in range(seed, seed + prompts):
        eng.client.store(eng.reg, eng.keys(ke.prompt_tokens(s, CHUNKS * 16), salt), blocks(*range(CHUNKS)),
                         cache_salt=salt)


def _b_hit_ratio(d, seed: int, rounds: int = 4) -> float:
    """Tenant "b" keeps 4 prompts (12 chunks) hot while tenant "flood" stores 24 new prompts
    (72 chunks, more than L1) between b's rounds: b's hit ratio after its first round."""
    spec = small_spec(d.endpoint, seed, num_blocks=CHUNKS)
    with ke.Engine(spec) as eng:
        work = [eng.keys(ke.prompt_tokens(seed + i, CHUNKS * 16), "b") for i in range(4)]
        _round(eng, work, "b")  # b's working set stored
        hit = asked = 0
        for r in range(rounds):
            _flood(eng, seed + 1000 + 100 * r, 24, "flood")
            h, a = _round(eng, work, "b")
            hit, asked = hit + h, asked + a
        return hit / asked


def test_a_flooding_tenant_evicts_its_own_chunks_not_anothers(daemon_factory):
    quota = 6 << 20  # about 17 chunks for the flooding tenant
    capped = daemon_factory("--tenant-quota", f"flood={quota}", "--tenant-quota", "b=8m", l1_bytes=L1)
    with_quota = _b_hit_ratio(capped, 5100)
    free = daemon_factory(l1_bytes=L1)
    without = _b_hit_ratio(free, 5100)
    print(f"\ntenant b's hit ratio while tenant 'flood' floods L1: {with_quota:.3f} with flood's quota of 6 MiB, "
          f"{without:.3f} without quotas")
    assert with_quota == 1.0, "b's chunks were evicted for another tenant"
    assert without < 0.5, "the flood must evict b's chunks where there is no quota (else this test shows nothing)"

    spec = small_spec(capped.endpoint, 5200, num_blocks=CHUNKS)
    with ke.Engine(spec) as eng:
        info = eng.client.describe()
        object_bytes = eng.reg.object_bytes
    tenants = {(t.tier, t.tenant): t for t in info.tenants}
    flood, b, other = tenants["l1", "flood"], tenants["l1", "b"], tenants["l1", "other"]
    assert flood.quota_bytes == quota and quota - object_bytes < flood.used_bytes <= quota
    assert flood.quota_evictions >= 4 * 24 * CHUNKS - quota // object_bytes - 1
    assert b.used_bytes == 12 * object_bytes and b.quota_evictions == 0
    assert other.used_bytes == 0 and other.quota_bytes == 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{capped.metrics_port}/metrics", timeout=5).read().decode()
    samples = {(s.name, s.labels["tenant"]): s.value for fam in text_string_to_metric_families(text)
               for s in fam.samples if s.labels.get("tier") == "l1" and "tenant" in s.labels}
    assert set(t for _, t in samples) == {"flood", "b", "other"}, "one series per configured tenant, and other"
    assert samples["kvdepot_tenant_quota_bytes", "flood"] == quota
    assert samples["kvdepot_tenant_used_bytes", "b"] == 12 * object_bytes
    assert samples["kvdepot_tenant_quota_evictions_total", "flood"] == flood.quota_evictions
    assert samples["kvdepot_tenant_used_bytes", "other"] == 0


def test_unnamed_salts_each_get_the_default_quota_and_l2_its_share(daemon_factory, tmp_path):
    """``*=BYTES`` bounds every salt not named, each on its own; L2's quota is the same share of
    L2 as of L1 (here L2 = 2 x L1: twice the bytes), and chunks evicted from L1 for the quota
    spill to L2 within it."""
    d = daemon_factory("--tenant-quota", "*=2m", "--l2-path", str(tmp_path / "l2"), "--l2-bytes", "32m",
                       "--l2-queue-bytes", "4m", l1_bytes=L1)
    spec = small_spec(d.endpoint, 5300, num_blocks=CHUNKS)
    with ke.Engine(spec) as eng:
        ob = eng.reg.object_bytes
        for salt in ("t1", "t2"):
            for s in range(8):  # 24 chunks of 360 KiB each: far more than 2 MiB
                _flood(eng, 5300 + s, 1, salt)
                settle(eng.client)
        info = eng.client.describe()
        l1_objects = next(t for t in info.tiers if t.name == "l1").num_objects
    other = {t.tier: t for t in info.tenants if t.tenant == "other"}
    assert other["l1"].quota_bytes == 2 << 20 and other["l2"].quota_bytes == 4 << 20
    # each of the two salts at most its own 2 MiB in L1 (5 chunks), so both together at most 10
    assert l1_objects <= 2 * ((2 << 20) // ob) and other["l1"].quota_evictions > 0
    assert other["l2"].used_bytes <= 2 * (4 << 20) and other["l2"].quota_evictions > 0
