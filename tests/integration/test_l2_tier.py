"""The L2 disk tier against real `kvdepot serve` processes: objects evicted from a small L1 are
written to L2 and served back bit-exact into another engine; L2 survives a clean restart and a
SIGKILL in the middle of its writes; damaged files on disk are a miss, never a wrong byte; flush
by tier; one daemon per L2 directory; metrics and describe per tier."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


import kv_engine as ke
from conftest import start_daemon
from test_store_retrieve import assert_same_tokens, blocks, small_spec

from kvdepot.client import KVDepotClient
from kvdepot.server.objfile import HEADER_BYTES

N = 8  # chunks per prompt (SmolLM2-135M, 16-token chunks of 360 KiB)
L1 = "16m"  # 45 chunks: PROMPTS prompts overflow it
PROMPTS = 8


def l2_args(path: Path, *extra: str) -> tuple[str, ...]:
    """L2 flags: a write queue of a quarter of L1 (11 chunks, more than one prompt's burst)."""
    return ("--l2-path", str(path), "--l2-bytes", "256m", "--l2-queue-bytes", "4m", *extra)


def l2_info(c: KVDepotClient):
    return next(t for t in c.describe().tiers if t.name == "l2")


def settle(c: KVDepotClient, timeout_s: float = 20.0) -> None:
    """Wait until L2 has no write queued or in progress."""
    deadline = time.monotonic() + timeout_s
    while l2_info(c).queue_depth:
        assert time.monotonic() < deadline, "L2 writes did not finish"
        time.sleep(0.01)


def object_files(path: Path) -> list[Path]:
    return sorted(path.glob("objects/*/*.kvd"))


def fill_l1_and_spill(eng: ke.Engine, seeds: range, pace: bool = True) -> list[list[bytes]]:
    """Store one N-chunk prompt per seed from blocks 0..N-1; returns their keys. ``pace``: wait
    for L2's writes after each (a disk that keeps up with the stores: no write is dropped)."""
    out = []
    for s in seeds:
        keys = eng.keys(ke.prompt_tokens(s, N * 16))
        r = eng.client.store(eng.reg, keys, blocks(*range(N)))
        assert r.stored + r.present == N, r
        out.append(keys)
        if pace:
            settle(eng.client)
    return out


def test_evicted_chunks_come_back_from_l2_bit_exact(daemon_factory, tmp_path):
    d = daemon_factory(*l2_args(tmp_path / "l2"), l1_bytes=L1)
    spec = small_spec(d.endpoint, 4100, num_blocks=2 * N)
    other_spec = dataclasses.replace(spec, layout="LBHNC", fill_seed=4101)
    with ke.Engine(spec) as eng, ke.Engine(other_spec) as other:
        x = fill_l1_and_spill(eng, range(41, 41 + PROMPTS))[0]
        settle(eng.client)
        info = eng.client.describe()
        l1, l2 = info.tiers
        assert l1.evictions > 0 and l2.num_objects >= l1.evictions and l2.written_bytes > 0
        assert l2.dropped_writes == 0 and l2.corrupt_objects == 0
        # x was evicted from L1 first: every chunk is still a hit, from L2
        assert eng.client.lookup(x, 16) == N
        got = other.client.retrieve(other.reg, x, blocks(*range(N, 2 * N)))
        assert got == N
        # every byte (eng's blocks 0..N-1, which every prompt was stored from, never changed)
        assert_same_tokens(eng, range(N), other, range(N, 2 * N))
        l2 = l2_info(other.client)
        assert l2.read_bytes > 0 and l2.hit_chunks > 0
        # the promoted chunks are in L1 now: a second retrieve needs no disk
        read = l2.read_bytes
        assert other.client.retrieve(other.reg, x, blocks(*range(N, 2 * N))) == N
        assert l2_info(other.client).read_bytes == read
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read().decode()
        for line in ('kvdepot_tier_written_bytes_total{tier="l2"}', 'kvdepot_corrupt_objects_total{tier="l2"} 0.0',
                     'kvdepot_tier_queue_depth{tier="l2"} 0.0', 'kvdepot_tier_hit_chunks_total{tier="l2"}'):
            assert line in metrics, line


def test_store_onto_a_parent_only_l2_holds(daemon_factory, tmp_path):
    """A request whose prefix was evicted to L2 stores its next chunks: the parent counts as
    present (not skipped as parent_missing), and the whole chain is a hit."""
    d = daemon_factory(*l2_args(tmp_path / "l2"), l1_bytes=L1)
    spec = small_spec(d.endpoint, 4200, num_blocks=2 * N)
    with ke.Engine(spec) as eng:
        tokens = ke.prompt_tokens(42, 2 * N * 16)
        keys = eng.keys(tokens)
        assert eng.client.store(eng.reg, keys[:N], blocks(*range(N))).stored == N
        fill_l1_and_spill(eng, range(50, 50 + PROMPTS))  # pushes keys[:N] out of L1
        settle(eng.client)
        assert all(eng.client.lookup([k], 16) == 1 for k in keys[:N])
        r = eng.client.store(eng.reg, keys[N:], blocks(*range(N)), parent=keys[N - 1])
        assert (r.stored, r.skipped) == (N, 0), r
        assert eng.client.lookup(keys, 16) == 2 * N


def test_l2_survives_restart_and_sigkill_mid_write(tmp_path):
    """Clean restart: everything L2 held is served again. SIGKILL while writes are in flight:
    whatever the restarted daemon finds is served bit-exact, torn writes are gone."""
    l2 = tmp_path / "l2"
    spec_of = lambda d: small_spec(d.endpoint, 4300, num_blocks=N)  # noqa: E731
    d = start_daemon(tmp_path / "d1", *l2_args(l2), l1_bytes=L1)
    try:
        with ke.Engine(spec_of(d)) as eng:
            prompts = fill_l1_and_spill(eng, range(60, 60 + PROMPTS))
            settle(eng.client)
            on_disk = l2_info(eng.client).num_objects
            assert on_disk >= 3 * N
    finally:
        d.stop()
    assert len(object_files(l2)) == on_disk
    d = start_daemon(tmp_path / "d2", *l2_args(l2), l1_bytes=L1)
    eng = ke.Engine(spec_of(d))
    other = ke.Engine(dataclasses.replace(spec_of(d), layout="LBHNC", fill_seed=4301))
    try:
        assert l2_info(eng.client).num_objects == on_disk
        assert eng.client.lookup(prompts[0], 16) == N  # the oldest prompt lived only in L2
        assert other.client.retrieve(other.reg, prompts[0], blocks(*range(N))) == N
        assert_same_tokens(eng, range(N), other, range(N))
        # writes in flight (on a fast disk some may be done already), then SIGKILL
        fill_l1_and_spill(eng, range(70, 90), pace=False)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
    finally:
        if d.alive:
            d.proc.kill()
        eng.close(unregister=False)
        other.close(unregister=False)
    d = start_daemon(tmp_path / "d3", *l2_args(l2), l1_bytes=L1)
    try:
        assert list((l2 / "tmp").iterdir()) == [], "torn writes are removed at start"
        with ke.Engine(spec_of(d)) as eng, ke.Engine(dataclasses.replace(spec_of(d), layout="LBHNC",
                                                                          fill_seed=4302)) as other:
            info = l2_info(eng.client)
            assert info.num_objects > 0 and info.corrupt_objects == 0
            served = 0
            for s in range(60, 90):
                keys = eng.keys(ke.prompt_tokens(s, N * 16))
                got = other.client.retrieve(other.reg, keys, blocks(*range(N)))
                if got:
                    assert_same_tokens(eng, range(got), other, range(got))
                    served += got
            assert served >= N
            assert l2_info(eng.client).corrupt_objects == 0
    finally:
        d.stop()


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_damaged_l2_files_are_a_miss_never_a_wrong_byte(daemon_factory, tmp_path):
    l2 = tmp_path / "l2"
    d = daemon_factory(*l2_args(l2), l1_bytes=L1)
    spec = small_spec(d.endpoint, 4400, num_blocks=2 * N)
    with ke.Engine(spec) as eng, ke.Engine(dataclasses.replace(spec, fill_seed=4401)) as other:
        x = fill_l1_and_spill(eng, range(80, 80 + PROMPTS))[0]
        settle(eng.client)
        files = {bytes.fromhex(p.name.split(".")[0]): p for p in object_files(l2)}
        assert all(k in files for k in x), "the first prompt lives only in L2"
        _flip(files[x[3]], HEADER_BYTES + 5000)  # payload of chunk 3
        os.truncate(files[x[5]], HEADER_BYTES + 4096)  # chunk 5 truncated
        got = other.client.retrieve(other.reg, x, blocks(*range(N, 2 * N)))
        assert got == 3, "served up to the damaged chunk"
        problems = ke.verify_cache(other.cache, other.spec, blocks(*range(N, 2 * N)), eng.spec,
                                   blocks(*range(N)), 0, got * 16)
        assert problems == [], problems  # chunks 0-2 exact, every other block untouched
        # the retrieve read all 8 chunks at once: both damaged files were found and dropped
        assert l2_info(eng.client).corrupt_objects == 2
        assert eng.client.lookup(x, 16) == 3, "the damaged chunk is gone from the index"
        assert eng.client.lookup([x[5]], 16) == 0
        deadline = time.monotonic() + 5
        while (files[x[3]].exists() or files[x[5]].exists()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not files[x[3]].exists() and not files[x[5]].exists()
        # the chunks after the damaged one are still served to whoever stores the missing one again
        assert eng.client.store(eng.reg, [x[3]], blocks(3), parent=x[2]).stored == 1
        assert eng.client.lookup(x[:5], 16) == 5


def test_flush_by_tier_and_one_daemon_per_directory(daemon_factory, tmp_path):
    l2 = tmp_path / "l2"
    d = daemon_factory(*l2_args(l2), l1_bytes=L1)
    spec = small_spec(d.endpoint, 4500, num_blocks=N)
    with ke.Engine(spec) as eng:
        fill_l1_and_spill(eng, range(90, 90 + PROMPTS))
        settle(eng.client)
        before = eng.client.describe().tiers
        r = eng.client.flush(tier="l2")
        assert r.objects == before[1].num_objects
        after = eng.client.describe().tiers
        assert after[1].num_objects == 0 and after[0].num_objects == before[0].num_objects
        deadline = time.monotonic() + 5
        while object_files(l2) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert object_files(l2) == []
    # a second daemon on the same directory refuses to start, saying why
    r = subprocess.run([sys.executable, "-m", "kvdepot", "serve", "--endpoint", f"ipc://{tmp_path}/other.sock",
                        "--l1-bytes", L1, *l2_args(l2)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "in use by another kvdepot daemon" in r.stderr, r.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "kvdepot", "describe", "--endpoint", d.endpoint],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "\nl2 " in out.stdout and f"{l2} (" in out.stdout, out.stdout
