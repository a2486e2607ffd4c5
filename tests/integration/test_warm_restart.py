"""Warm restarts with L2: stored chunks are written through to L2 as they commit, so a daemon
killed with SIGKILL finds every chunk committed at least a second before the kill again, and one
stopped with SIGTERM writes what L2 still lacked before it exits (``--shutdown-drain-s``)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

import kv_engine as ke
from conftest import start_daemon
from test_l2_tier import N, l2_info
from test_store_retrieve import blocks, small_spec

PROMPTS = 20  # 160 chunks of 360 KiB: 56 MiB, in an L1 of 64 MiB (nothing evicted)


def _store_all(d, seed: int) -> list[list[bytes]]:
    with ke.Engine(small_spec(d.endpoint, seed, num_blocks=N)) as eng:
        prompts = []
        for s in range(PROMPTS):
            keys = eng.keys(ke.prompt_tokens(seed + s, N * 16))
            r = eng.client.store(eng.reg, keys, blocks(*range(N)))
            assert r.stored == N, r
            prompts.append(keys)
        eng.close(unregister=False)
        return prompts


def _hits(d, seed: int, prompts: list[list[bytes]]) -> int:
    with ke.Engine(small_spec(d.endpoint, seed, num_blocks=N)) as eng:
        assert l2_info(eng.client).corrupt_objects == 0
        return sum(eng.client.lookup(keys, 16) for keys in prompts)


@pytest.mark.parametrize("stop", ["SIGKILL", "SIGTERM"])
def test_a_restart_finds_the_hot_cache(tmp_path: Path, stop: str):
    l2 = tmp_path / "l2"
    # a write queue of 4 MiB (11 chunks): the stores outrun it, so write-through falls behind and catches up
    args = ("--l2-path", str(l2), "--l2-bytes", "256m", "--l2-queue-bytes", "4m")
    d = start_daemon(tmp_path / "d1", *args, "--shutdown-drain-s", "30", l1_bytes="64m")
    try:
        prompts = _store_all(d, 5100)
        if stop == "SIGKILL":
            time.sleep(1.0)  # every chunk committed at least 1 s before the kill
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait(10)
        else:
            d.stop()  # SIGTERM: a clean exit after the drain
    finally:
        if d.alive:
            d.proc.kill()
    d = start_daemon(tmp_path / "d2", *args, l1_bytes="64m")
    try:
        hits = _hits(d, 5100, prompts)
        print(f"\n[warm restart] after {stop}: {hits} of {PROMPTS * N} chunks hit")
        assert hits == PROMPTS * N
    finally:
        d.stop()
