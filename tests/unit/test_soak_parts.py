"""The soak's byte oracle (kvdepot.soak.content) and the daemon's reply fault injector
(kvdepot.server.faults): the soak is only as good as these."""

from __future__ import annotations

import hashlib

import pytest

from kvdepot.client.kvcache import ShmKVCache
from kvdepot.server.faults import InjectedFaults
from kvdepot.soak.content import FAMILIES, chunk_layers, corrupt_bytes, write_chunk


def _key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.model)
def test_chunk_bytes_survive_any_layout_and_one_flipped_byte_is_found(fam):
    ids = [[(5 + 3 * i) % n for i in range(fam.blocks_per_chunk(g))] for g, n in enumerate(fam.num_blocks)]
    items = [(g, b, _key(1), p) for g, blocks in enumerate(ids) for p, b in enumerate(blocks)]
    for layout in fam.layouts:
        with ShmKVCache(list(fam.groups), list(fam.num_blocks), layout) as cache:
            write_chunk(cache, fam, _key(1), ids)
            compared, differ = corrupt_bytes(cache, fam, items)
            assert (compared, differ) == (fam.object_bytes, 0), layout
            # the same blocks read as another key's chunk: almost every byte differs
            assert corrupt_bytes(cache, fam, [(g, b, _key(2), p) for g, b, _, p in items])[1] > fam.object_bytes // 2
            last = len(cache.layer_names) - 1
            view = cache.token_view(last, as_bytes=True)
            view[ids[cache.layer_gids[last]][-1], -1, -1, -1, -1] ^= 0x10
            assert corrupt_bytes(cache, fam, items) == (fam.object_bytes, 1), layout


def test_chunk_bytes_are_a_function_of_the_key_only():
    fam = FAMILIES[0]
    a, b, c = chunk_layers(fam, _key(7)), chunk_layers(fam, _key(7)), chunk_layers(fam, _key(8))
    assert all(x.equal(y) for x, y in zip(a, b))
    assert not any(x.equal(z) for x, z in zip(a, c))
    assert sum(x.numel() for x in a) == fam.object_bytes


def test_faults_spec_and_shares():
    f = InjectedFaults("drop=0.1,delay=0.2,delay_s=0.5,seed=3")
    decisions = [f.decide() for _ in range(20_000)]
    dropped = sum(d is None for d in decisions)
    delayed = [d for d in decisions if d]
    assert 1700 < dropped < 2300 and 3500 < len(delayed) < 4500
    assert all(0 < d <= 0.5 for d in delayed)
    assert f.counts == {"dropped_replies": dropped, "delayed_replies": len(delayed), "stalled_copies": 0}
    assert f.copy_stall_s() == 0.0  # no stall asked for
    g = InjectedFaults("stall=0.25,stall_s=7,seed=1")
    stalls = [g.copy_stall_s() for _ in range(4000)]
    assert set(stalls) == {0.0, 7.0} and 800 < stalls.count(7.0) < 1200
    assert g.counts["stalled_copies"] == stalls.count(7.0) and g.decide() == 0.0
    runs = [InjectedFaults(f"drop=0.5,delay=0.3,seed={s}") for s in (3, 3, 4)]
    a, b, c = ([f.decide() for _ in range(64)] for f in runs)
    assert a == b != c  # the seed decides


@pytest.mark.parametrize("spec", ["drop", "drop=x", "lose=0.1", "drop=0.7,delay=0.7", "delay_s=-1", "drop=2",
                                  "stall=1.5", "stall_s=-2"])
def test_faults_refuse_bad_specs(spec):
    with pytest.raises(ValueError, match="KVDEPOT_INJECT_FAULTS"):
        InjectedFaults(spec)


def test_faults_are_off_unless_asked(monkeypatch):
    monkeypatch.delenv("KVDEPOT_INJECT_FAULTS", raising=False)
    assert InjectedFaults.from_env() is None
    monkeypatch.setenv("KVDEPOT_INJECT_FAULTS", "  ")
    assert InjectedFaults.from_env() is None
    monkeypatch.setenv("KVDEPOT_INJECT_FAULTS", "drop=1")
    assert InjectedFaults.from_env().decide() is None


def test_corrupt_l2_fault_changes_an_l2_object_file(tmp_path):
    """Each fault kind must do what it is counted as (a lost ``elif`` once made corrupt_l2 on
    CUDA runs count faults that never happened)."""
    from kvdepot.soak.run import Soak, SoakConfig

    soak = Soak(SoakConfig(workdir=str(tmp_path), device="cuda"))
    assert soak._inject("corrupt_l2") is False  # no L2 file yet: nothing injected, nothing counted
    obj = tmp_path / "l2" / "objects" / "ab" / "x.kvd"
    obj.parent.mkdir(parents=True)
    before = bytes(64 << 10)
    obj.write_bytes(before)
    assert soak._inject("corrupt_l2") is True
    after = obj.read_bytes()
    assert after[:len(before)] != before  # 8 random bytes at a random offset (may run past the end)


def test_cpu_engines_of_a_cuda_run_keep_their_kv_in_shared_memory(tmp_path):
    """``--cpu-engines K`` on a CUDA run: engines 0..K-1 are CPU engines (shared memory, the
    shrunk-segment fault applies to them), the others CUDA; the report names both kinds."""
    from kvdepot.soak.run import Soak, SoakConfig, _engine_kinds

    soak = Soak(SoakConfig(workdir=str(tmp_path), device="cuda", engines=6, cpu_engines=4))
    assert [soak._engine_device(i) for i in range(6)] == ["cpu"] * 4 + ["cuda"] * 2
    assert _engine_kinds({"device": "cuda", "engines": 6, "cpu_engines": 4}) == "2 cuda, 4 cpu"
    assert (_engine_kinds({"device": "cuda", "engines": 6, "cpu_engines": 4, "engines_with_load_ring": 1})
            == "2 cuda (1 with a ring for retrieves), 4 cpu")
    only_cuda = Soak(SoakConfig(workdir=str(tmp_path / "b"), device="cuda", engines=2))
    assert [only_cuda._engine_device(i) for i in range(2)] == ["cuda", "cuda"]
    cpu = Soak(SoakConfig(workdir=str(tmp_path / "c"), device="cpu", engines=2, cpu_engines=0))
    assert cpu._engine_device(1) == "cpu"
    assert _engine_kinds({"device": "cpu", "engines": 2, "cpu_engines": 2}) == "cpu"


def test_ops_are_counted_by_where_the_engine_kept_its_kv(tmp_path):
    """A mixed run's report splits its ops by engine kind (which one the rate came from)."""
    from kvdepot.soak.run import Soak, SoakConfig, _by_device, _ops

    soak = Soak(SoakConfig(workdir=str(tmp_path), device="cuda", engines=3, cpu_engines=2))
    counts = {"lookups": 3, "retrieves": 2, "stores": 1, "requests": 3}  # no flushes: absent keys count 0
    assert _ops(counts) == 9
    for i in range(3):
        soak.last[i] = {"counts": counts, "errors": {}}
        soak._retire(i)
    assert soak.ops_by_device == {"cpu": 18, "cuda": 9}
    assert _by_device({"ops_by_device": {"cpu": 18, "cuda": 9}}) == "; 18 by cpu engines, 9 by cuda engines"
    assert _by_device({"ops_by_device": {"cpu": 18}}) == ""
