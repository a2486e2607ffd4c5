"""A CPU engine's copies never touch blocks the engine may have reused (`Store.deadline_ns`):
the daemon's copies are stalled longer than the client's timeout ($KVDEPOT_INJECT_FAULTS stall),
a store's blocks are reused once its handle's ``blocks_free_at_s`` passed and its late copy is
never committed; a late retrieve copies nothing, and its blocks wait for a `Settle`."""

from __future__ import annotations

import time

import pytest
import torch

import kv_engine as ke
from daemon_proc import metric, scrape
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError
from test_watchdog import _seed_first_copy_runs_second_stalls

STALL_S = 4.0
TIMEOUT_S = 1.0  # the client's reply timeout and copy deadline


def _overwrite(eng: ke.Engine, block_ids: list[int], value: int) -> None:
    """The engine gives the blocks to another request, which writes its KV (``value``) there."""
    for layer in range(len(eng.cache.layer_names)):
        eng.cache.token_view(layer, as_bytes=True)[block_ids] = value


@pytest.fixture
def stalled_engine(daemon_factory, monkeypatch, request):
    """(daemon, engine): the daemon's first CPU copy runs at once and its second stalls STALL_S;
    the engine's client times out (and sets its copies' deadline) after TIMEOUT_S."""
    seed = _seed_first_copy_runs_second_stalls()
    monkeypatch.setenv("KVDEPOT_INJECT_FAULTS", f"stall=0.5,stall_s={STALL_S},seed={seed}")
    d = daemon_factory()
    spec = ke.EngineSpec(d.endpoint, ke.SMOLLM2, "LBNHC", (16,), (24,), 16, 7400, model_id=request.node.name[:60])
    with ke.Engine(spec) as eng:
        eng.client.conn.timeout_s = eng.client.transfers.copy_deadline_s = TIMEOUT_S
        yield d, eng
    assert d.alive


def test_a_late_cpu_store_is_never_committed_from_reused_blocks(stalled_engine):
    d, eng = stalled_engine
    c = eng.client
    keys = eng.keys(ke.prompt_tokens(7400, 32))
    assert c.store(eng.reg, keys[:1], [[0]]).stored == 1  # the first copy runs at once
    pending = c.submit_store(eng.reg, keys[1:], [[3]], parent=keys[0])  # its copy stalls STALL_S
    sent_s = time.monotonic()
    with pytest.raises(KVDepotError) as err:
        pending.result()
    assert err.value.code is ErrorCode.TIMEOUT
    free_at = pending.blocks_free_at_s
    assert free_at is not None and sent_s + TIMEOUT_S < free_at < sent_s + TIMEOUT_S + 2.0
    time.sleep(max(0.0, free_at - time.monotonic()))
    _overwrite(eng, [3], 0x55)  # block 3 now holds another request's KV
    time.sleep(max(0.0, sent_s + STALL_S + 1.0 - time.monotonic()))  # the stalled copy's thread ran
    assert c.describe().injected_faults["stalled_copies"] == 1  # (a new connection: the old one timed out)
    assert c.lookup(keys, 16) == 1, "a late store must not be committed"
    assert metric(scrape(d.metrics_port), "kvdepot_errors_total", code="DEADLINE") == 1


def test_a_late_cpu_retrieve_writes_nothing_and_its_blocks_wait_for_settle(stalled_engine):
    """A retrieve's blocks are not freed by its deadline (a copy begun before it could still be
    writing if the daemon was stopped mid-chunk): the engine settles it (`Settle`), and the
    deadline kept the stalled copy from writing at all."""
    d, eng = stalled_engine
    c = eng.client
    keys = eng.keys(ke.prompt_tokens(7450, 16))
    assert c.store(eng.reg, keys, [[0]]).stored == 1  # the first copy runs at once
    before = [eng.cache.token_view(layer, as_bytes=True)[[3]].clone() for layer in range(len(eng.cache.layer_names))]
    pending = c.submit_retrieve(eng.reg, keys, [[3]])  # its copy stalls STALL_S
    sent_s = time.monotonic()
    with pytest.raises(KVDepotError) as err:
        pending.result()
    assert err.value.code is ErrorCode.TIMEOUT and pending.blocks_free_at_s is None
    c.conn.timeout_s = STALL_S + 5
    c.call(m.Settle(rid=0, registration=eng.reg.id, through_rid=pending.rid))
    assert time.monotonic() - sent_s > STALL_S - 0.5, "Settle waited for the stalled copy"
    for layer, was in enumerate(before):
        assert torch.equal(eng.cache.token_view(layer, as_bytes=True)[[3]], was), \
            f"layer {layer}: the retrieve wrote after its deadline"
    assert metric(scrape(d.metrics_port), "kvdepot_errors_total", code="DEADLINE") == 1


def test_settle_answers_once_lost_copies_ended_and_refuses_late_arrivals(daemon_factory, monkeypatch):
    """`Settle`: the daemon answers once the client's accepted requests up to ``through_rid``
    finished their copies (a stalled one: after its stall), and refuses one that arrives later."""
    seed = _seed_first_copy_runs_second_stalls()
    monkeypatch.setenv("KVDEPOT_INJECT_FAULTS", f"stall=0.5,stall_s=2,seed={seed}")
    d = daemon_factory()
    spec = ke.EngineSpec(d.endpoint, ke.SMOLLM2, "LBNHC", (16,), (24,), 16, 7500, model_id="settle")
    with ke.Engine(spec) as eng:
        c = eng.client
        keys = eng.keys(ke.prompt_tokens(7500, 48))
        assert c.store(eng.reg, keys[:1], [[0]]).stored == 1
        stalled = c.submit_store(eng.reg, keys[1:2], [[1]], parent=keys[0])  # its copy stalls 2 s
        t0 = time.monotonic()
        c.call(m.Settle(rid=0, registration=eng.reg.id, through_rid=stalled.rid))
        assert time.monotonic() - t0 > 1.0, "Settle answered while the settled store's copy ran"
        assert stalled.result().stored == 1  # (its reply came before the Settle's)
        rid = c.call(m.Settle(rid=0, registration=eng.reg.id, through_rid=stalled.rid + 100)).rid
        assert time.monotonic() - t0 < 2.5  # nothing runs: answered at once
        with pytest.raises(KVDepotError) as err:  # a request up to through_rid arriving now copies nothing
            c.store(eng.reg, keys[2:], [[2]], parent=keys[1])
        assert err.value.code is ErrorCode.INVALID_ARGUMENT and "settled" in str(err.value)
        assert rid < stalled.rid + 100
    assert d.alive
