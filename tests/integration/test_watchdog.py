"""The copy watchdog (kvdepot.server.watchdog) on a real daemon whose CPU copies are stalled
on purpose ($KVDEPOT_INJECT_FAULTS stall): a request behind a stuck copy is answered TIMEOUT
once the copy's deadline passed, `describe` and the metrics show the stuck copy while it lasts,
and a stuck store's chunks are never published when its copy ends after all."""

from __future__ import annotations

import random
import time

import pytest

import kv_engine as ke
from daemon_proc import metric, scrape
from kvdepot.protocol.errors import ErrorCode, KVDepotError

STALL_S = 4.0


def _seed_first_copy_runs_second_stalls() -> int:
    """A fault seed whose first CPU copy runs at once and whose second stalls (stall=0.5)."""
    for seed in range(1000):
        r = random.Random(seed + 1)  # InjectedFaults draws copy stalls from Random(seed + 1)
        if r.random() >= 0.5 and r.random() < 0.5:
            return seed
    raise AssertionError("no such seed")


def _wait_unstuck(client, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while client.describe().stuck_transfers:
        assert time.monotonic() < deadline, "the stalled copy never ended"
        time.sleep(0.1)


@pytest.mark.parametrize("op", ["store", "retrieve"])
def test_a_stuck_copy_is_answered_timeout_shown_and_never_published(daemon_factory, monkeypatch, op):
    seed = _seed_first_copy_runs_second_stalls()
    monkeypatch.setenv("KVDEPOT_INJECT_FAULTS", f"stall=0.5,stall_s={STALL_S},seed={seed}")
    d = daemon_factory("--watchdog-s", "1")
    spec = ke.EngineSpec(d.endpoint, ke.SMOLLM2, "LBNHC", (16,), (24,), 16, 7300, model_id=f"watchdog-{op}")
    with ke.Engine(spec) as eng:
        c = eng.client
        keys = eng.keys(ke.prompt_tokens(7300, 32))
        assert c.store(eng.reg, keys[:1], [[0]]).stored == 1  # the first copy runs at once
        with pytest.raises(KVDepotError) as err:  # the second stalls STALL_S
            if op == "store":
                c.store(eng.reg, keys[1:], [[1]], parent=keys[0])
            else:
                c.retrieve(eng.reg, keys[:1], [[5]])
        assert err.value.code is ErrorCode.TIMEOUT and "watchdog" in str(err.value)
        stuck = c.describe().stuck_transfers
        assert [(s.op, s.registration, s.size_bytes) for s in stuck] == [(op, eng.reg.id, eng.reg.object_bytes)]
        assert 1.0 <= stuck[0].age_s < STALL_S
        samples = scrape(d.metrics_port)
        assert metric(samples, "kvdepot_stuck_transfers") == 1
        assert metric(samples, "kvdepot_transfers_stuck_total", op=op) == 1
        _wait_unstuck(c, within_s=STALL_S + 5)
        assert metric(scrape(d.metrics_port), "kvdepot_stuck_transfers") == 0
        # the late store copy published nothing; the first chunk is still served
        assert c.lookup(keys, 16) == 1
        assert c.describe().injected_faults["stalled_copies"] == 1
        assert "declared stuck" in d.log() and "ended after" in d.log()
    assert d.alive
