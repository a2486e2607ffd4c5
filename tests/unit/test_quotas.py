"""Per-tenant quotas on their own (`kvdepot.server.quotas`): parsing the setting from a flag, the
environment and a TOML table; L1's index evicting only the tenant over its quota, leaves first;
L2 keeping a tenant within its share and after a restart with a lower quota."""

from __future__ import annotations

import asyncio
import mmap

import pytest
from test_config import args

from kvdepot.config import resolve
from kvdepot.server.disk import DiskTier
from kvdepot.server.index import ChunkIndex
from kvdepot.server.objfile import file_bytes, padded
from kvdepot.server.quotas import TenantLedger, parse_quotas


def test_parse_forms_and_errors(tmp_path):
    assert parse_quotas(["acme=8g", "*=2m", "=1k"]) == {"acme": 8 << 30, "*": 2 << 20, "": 1024}
    assert parse_quotas("acme=8g, b=1m") == {"acme": 8 << 30, "b": 1 << 20}
    assert parse_quotas({"acme": "8g", "*": 4096}) == {"acme": 8 << 30, "*": 4096}
    for bad in (["acme"], ["acme=0"], ["acme=lots"], ["other=1g"], [3]):
        with pytest.raises(ValueError):
            parse_quotas(bad)
    st = resolve(args("--tenant-quota", "a=1m", "--tenant-quota", "*=2m"), {})
    assert st.values["tenant_quota"] == {"a": 1 << 20, "*": 2 << 20}
    assert resolve(args(), {"KVDEPOT_TENANT_QUOTA": "a=1m,b=2m"}).values["tenant_quota"] == {"a": 1 << 20,
                                                                                               "b": 2 << 20}
    f = tmp_path / "k.toml"
    f.write_text('tenant_quota = {acme = "8g", "*" = "2g"}\n')
    st = resolve(args("--config", str(f)), {})
    assert st.values["tenant_quota"] == {"acme": 8 << 30, "*": 2 << 30}
    assert 'tenant_quota = {"acme" = 8589934592, "*" = 2147483648}' in st.to_toml()
    assert resolve(args(), {}).values["tenant_quota"] is None


def test_l1_evicts_only_the_tenant_over_its_quota_leaves_first():
    freed = []
    idx = ChunkIndex(lambda e, evicted: freed.append((e.key, evicted)), TenantLedger({"a": 300, "*": 1000}))

    def put(key: bytes, parent: bytes, salt: str, size: int = 100):
        e = idx.begin_write(key, parent, 0, size, "m", salt)
        idx.commit(e)
        return e

    put(b"b0", b"", "b")  # b is oldest of all: a global LRU eviction would take it
    put(b"a0", b"", "a")
    put(b"a1", b"a0", "a")
    put(b"a2", b"", "a")
    t = idx.tenants
    assert t.used_bytes == {"a": 300, "b": 100} and t.over("a", 100) and not t.over("b", 900) and t.over("b", 901)
    idx.touch_chain([b"a2"])
    # a's least recently used leaf: a1 (a0 is older but has a child; a2 was touched)
    assert idx.evict_own("a").key == b"a1"
    assert idx.evict_own("a").key == b"a0"  # now a leaf
    assert freed == [(b"a1", True), (b"a0", True)] and idx.get(b"b0") is not None
    held = idx.ready(b"a2")
    idx.acquire(held)
    assert idx.evict_own("a") is None, "a chunk being read is never evicted"
    idx.release(held)
    assert t.evictions == {"a": 2} and t.used_bytes == {"a": 100, "b": 100}
    assert t.by_label() == {"a": (100, 300, 2), "other": (100, 1000, 0)}
    idx.drop_where(lambda e: True)
    assert t.used_bytes == {} and t.by_label()["other"] == (0, 1000, 0)
    # an object whose tenant is known only once read (L3): counted to it from then on
    e = idx.begin_write(b"x", b"", 0, 50, "m", "")
    idx.retag(e, "m", "a", "fp")
    assert t.used_bytes == {"a": 50}


def _write(tier: DiskTier, loop, key: bytes, salt: str, size: int = 4096) -> bool:
    buf = mmap.mmap(-1, padded(size))
    ok = tier.write(key, b"", "m", salt, "fp", memoryview(buf), size, lambda: None)

    async def settle():
        while tier.queued_writes:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)
    loop.run_until_complete(settle())
    return ok


def test_l2_keeps_a_tenant_within_its_quota_and_trims_it_after_a_restart(tmp_path):
    fb = file_bytes(4096)
    loop = asyncio.new_event_loop()
    tier = DiskTier(str(tmp_path / "l2"), 100 * fb, 1 << 20, io_threads=2, quotas={"a": 3 * fb})
    tier.open()
    tier.attach(loop)
    try:
        assert _write(tier, loop, b"b" * 16, "b")
        for i in range(5):
            assert _write(tier, loop, bytes([i]) * 16, "a")
        assert tier.tenants.used_bytes == {"a": 3 * fb, "b": fb}
        assert [tier.get(bytes([i]) * 16) is not None for i in range(5)] == [False, False, True, True, True]
        assert tier.counters.evictions == 2 and tier.tenants.evictions == {"a": 2}
        assert file_bytes(6 * 4096) > 3 * fb
        assert not _write(tier, loop, b"z" * 16, "a", size=6 * 4096), "larger than the quota: not written"
    finally:
        tier.close()
    tier = DiskTier(str(tmp_path / "l2"), 100 * fb, 1 << 20, io_threads=2, quotas={"a": 2 * fb})
    try:
        assert tier.open() == 3  # the quota was lowered: a's oldest file went
        assert tier.tenants.used_bytes == {"a": 2 * fb, "b": fb}
        assert tier.get(bytes([2]) * 16) is None and tier.get(bytes([4]) * 16) is not None
    finally:
        tier.close()
        loop.close()
