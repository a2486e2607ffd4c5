"""The kvdepot vLLM connector when the daemon fails: down, restarted, slow, hung, or losing a
load, against vLLM 0.33's real scheduler and worker-side call sequence (see
`test_vllm_connector.py` for the harness): vLLM recomputes what was not loaded, no step waits
on the daemon, and no block is written after vLLM gave it to another request."""

from __future__ import annotations

import socket
import time

import pytest
from conftest import Daemon

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402
from connector_testing import CHUNK, FAST, wait_for_lookup_answer  # noqa: E402


def _stored_then_looked_up(daemon, cfg, engines, prompt: list[int], specs=None):
    """Engine A stores ``prompt`` (and finishes it); engine B adds it and has its lookup answer
    (a hit) before anything fails: (A, A's request, B, B's request)."""
    a = engines(cfg(daemon.endpoint, extra=FAST), specs)
    ra = a.add(prompt, max_tokens=2)
    a.run()
    b = engines(cfg(daemon.endpoint, extra=FAST), specs)
    rb = b.add(prompt, max_tokens=2)
    wait_for_lookup_answer(b, rb)
    return a, ra, b, rb


def test_hybrid_load_failure_is_recomputed(daemon, cfg, engines):
    """Hybrid models report a failed load per request (failed_recving); vLLM recomputes."""
    specs = H.hybrid_specs(sliding_window=16)
    a, ra, b, rb = _stored_then_looked_up(daemon, cfg, engines, H.tokens(6, 200), specs)
    daemon.stop()  # the lookup said "hit"; the retrieve finds no daemon
    t0 = time.monotonic()
    b.run()
    assert time.monotonic() - t0 < 10
    assert b.runs[rb].outputs == a.runs[ra].outputs
    assert b.runs[rb].computed == 200 + 1  # everything recomputed
    assert b.worker_conn.stats["load_failures"] == 1


# ---------------------------------------------------------------------- (e) daemon down, slow, restarted


def test_daemon_down_then_restarted(daemon, cfg, engines):
    # replies from the restarted daemon may take longer than FAST's 0.5 s on a loaded machine (the
    # suite's workers share two cores), and a store unanswered that long counts the daemon as down
    # again; with nothing listening every call fails at once, whatever the timeout
    restart = dict(FAST, rpc_timeout_s=5.0)
    e = engines(cfg(daemon.endpoint, extra=restart))
    w = e.worker_conn
    first_reg = w.registration_id
    assert first_reg
    prompt = H.tokens(9, 200)
    r0 = e.add(prompt, max_tokens=2)
    e.run()
    expected = e.runs[r0].outputs

    daemon.stop()
    # a fresh instance (empty prefix cache) keeps serving by recomputing, without hanging
    f = engines(cfg(daemon.endpoint, extra=restart))
    t0 = time.monotonic()
    r1 = f.add(prompt, max_tokens=2)
    f.run()
    assert time.monotonic() - t0 < 5
    assert f.runs[r1].outputs == expected and f.runs[r1].computed == 200 + 1
    assert f.worker_conn.registration_id is None  # registration failed: nothing stored or loaded

    daemon.start()  # same endpoint, new boot id, empty cache
    for _ in range(400):  # idle engine steps: the worker probes the daemon and registers
        f.step()
        if f.worker_conn.registration_id:
            break
        time.sleep(0.005)
    r2 = f.add(H.tokens(10, 3) + prompt, max_tokens=2)  # new prefix: not in vLLM's prefix cache
    f.run()
    assert f.worker_conn.registration_id, "the worker must register with the restarted daemon"
    assert f.worker_conn.stats["stored_chunks"] >= 3
    # the first instance notices the restart (its connection closed, a new boot id) and
    # registers again, idle (its transfer thread looks every 50 ms)
    for _ in range(400):
        e.step()
        if w.registration_id not in (None, first_reg):
            break
        time.sleep(0.005)
    r3 = e.add(H.tokens(10, 3) + prompt, max_tokens=2)
    e.run()
    assert w.registration_id and w.registration_id != first_reg
    assert e.runs[r3].computed == 203 - 3 * CHUNK + 1, "a chunk stored by the other instance must load"
    assert e.runs[r3].outputs == f.runs[r2].outputs


def test_failed_load_is_reported_as_failed_blocks_and_recomputed(daemon, cfg, engines):
    a, ra, b, rb = _stored_then_looked_up(daemon, cfg, engines, H.tokens(11, 250))
    daemon.stop()
    errors = []
    orig = b.worker_conn.get_block_ids_with_load_errors

    def spy():
        got = orig()
        errors.append(got)
        return got

    b.worker_conn.get_block_ids_with_load_errors = spy
    t0 = time.monotonic()
    b.run()
    assert time.monotonic() - t0 < 10
    failed = set().union(*errors)
    assert len(failed) == 3 * CHUNK // 16, "every block of the promised chunks is reported failed"
    assert b.runs[rb].outputs == a.runs[ra].outputs
    assert b.runs[rb].computed == 250 + 1


def test_slow_daemon_load_times_out_and_blocks_wait_for_its_late_answer(daemon, cfg, engines):
    a, ra, b, rb = _stored_then_looked_up(daemon, cfg, engines, H.tokens(12, 140))
    daemon.pause()  # hung: bound, answers nothing
    w = b.worker_conn
    try:
        worst, t_end = 0.0, time.monotonic() + 0.8  # past rpc_timeout_s (0.5 s), short of hold_max_s (1 s)
        while time.monotonic() < t_end:
            t0 = time.monotonic()
            b.step()
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.005)
        assert worst < 0.2, f"an engine step waited {worst:.3f} s on a hung daemon"
        assert w.stats["late_ops"] == 1 and not w.client.up  # no new ones are sent meanwhile
        from vllm.v1.request import RequestStatus

        # its blocks wait for the late answer (a late copy never touches reallocated blocks)
        assert b.scheduler.requests[rb].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    finally:
        daemon.resume()
    b.run()
    assert not w.mover.book.ops
    assert b.runs[rb].outputs == a.runs[ra].outputs


def test_scheduler_never_blocks_on_a_hung_daemon(daemon, cfg, engines):
    e = engines(cfg(daemon.endpoint, extra=FAST))
    daemon.pause()
    try:
        sched = e.sched_conn
        req = H.Request("hung", H.tokens(13, 100), H.SamplingParams(max_tokens=1), None)
        answers, worst = [], 0.0
        t_end = time.monotonic() + 2.0
        while time.monotonic() < t_end:
            t0 = time.monotonic()
            answers.append(sched.get_num_new_matched_tokens(req, 0))
            worst = max(worst, time.monotonic() - t0)
            if answers[-1][0] is not None:
                break
            time.sleep(0.01)
        assert answers[0] == (None, False)  # pending: vLLM skips the request this step
        assert answers[-1] == (0, False)  # after lookup_timeout_s: recompute
        assert worst < 0.05, f"get_num_new_matched_tokens blocked for {worst:.3f} s"
        # while down, new requests are answered at once
        t0 = time.monotonic()
        req2 = H.Request("hung2", H.tokens(14, 100), H.SamplingParams(max_tokens=1), None)
        assert sched.get_num_new_matched_tokens(req2, 0) == (0, False)
        assert time.monotonic() - t0 < 0.05
        sched.request_finished_all_groups(req, ([],))
        sched.request_finished_all_groups(req2, ([],))
    finally:
        daemon.resume()


def test_blocks_of_requests_lost_with_a_connection_return_at_once(tmp_path, monkeypatch, cfg, engines):
    """The connection to a healthy daemon breaks while stores run (each CPU copy takes 0.3 s):
    the worker asks the daemon which of them still run (`Settle`) and gives their request's
    blocks back as soon as their copies ended, not after its deadline (rpc_timeout_s + 1 s) or
    hold_max_s."""
    monkeypatch.setenv("KVDEPOT_INJECT_FAULTS", "stall=1,stall_s=0.3")
    d = Daemon(tmp_path).start()
    try:
        e = engines(cfg(d.endpoint, extra={"rpc_timeout_s": 5.0, "hold_max_s": 30.0}))
        w = e.worker_conn
        r = e.add(H.tokens(31, 200), max_tokens=1)
        for _ in range(500):
            e.step()
            if w.mover.book.ops:
                break
            time.sleep(0.002)
        assert w.mover.book.ops, "a store is in flight"
        t_loss = time.monotonic()
        w.client.conn._sock._sock.shutdown(socket.SHUT_RDWR)  # the connection breaks under it
        e.run(r, timeout_s=10)
        took_s = time.monotonic() - t_loss
        assert w.stats["late_ops"] >= 1, "the store was lost with the connection"
        assert took_s < 1.0, f"the request's blocks came back after {took_s:.2f} s"
        assert not w.mover.book.ops
    finally:
        d.close()
