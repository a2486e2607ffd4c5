"""A hung daemon never stalls vLLM: vLLM 0.33's real scheduler and worker call sequence (the CPU
harness of `vllm_harness`) keeps serving requests with 32K-token prompts while the daemon is
stopped (SIGSTOP) for 20 s with stores and loads in flight. Every connector call vLLM makes
returns within 50 ms (a stalled one waits for the daemon or a timeout: seconds), the requests finish by recompute with every KV byte checked by the toy
forward, and once the daemon runs again prefix hits resume."""

from __future__ import annotations

import collections
import functools
import inspect
import time

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

PROMPT_TOKENS = 32 * 1024 - 64  # (+ 2 generated: within the toy model's 32768 positions)
PAUSE_S = 20.0
BURST = 24
# far below any wait for the daemon (its 20 s stop, the connector's timeouts of seconds), above
# what a loaded 2-core CI machine's scheduling and garbage collections gave (up to 6.6 ms); the
# figure itself is printed and kept in docs/benchmarks.md
CALL_BOUND_S = 0.050
# the connector calls vLLM makes (its base class's public methods)
VLLM_CALLS = sorted(n for n, f in inspect.getmembers(KVConnectorBase_V1, inspect.isfunction) if not n.startswith("_"))


class CallTimes:
    """Wraps every vLLM-facing method of a connector instance; ``worst_s[name]``: the longest
    call while ``on`` was set."""

    def __init__(self) -> None:
        self.on = False
        self.worst_s: dict[str, float] = collections.defaultdict(float)
        self.calls = collections.Counter()

    def wrap(self, conn) -> None:
        for name in VLLM_CALLS:
            fn = getattr(conn, name, None)
            if callable(fn):
                setattr(conn, name, self._timed(name, fn))

    def _timed(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                if self.on:
                    dt = time.perf_counter() - t0
                    self.calls[name] += 1
                    if dt > self.worst_s[name]:
                        self.worst_s[name] = dt
        return timed


def test_a_stopped_daemon_never_stalls_vllm(daemon, cfg, engines, capsys):
    extra = {"lookup_timeout_s": 0.5, "rpc_timeout_s": 1.0, "retry_interval_s": 0.2, "hold_max_s": 60.0}
    e = engines(cfg(daemon.endpoint, extra=extra, max_model_len=32 * 1024,
                    max_num_batched_tokens=8192, max_num_seqs=8), num_blocks=6 * 32 * 1024 // 16)
    times = CallTimes()
    times.wrap(e.sched_conn)
    times.wrap(e.worker_conn)
    warm = [H.tokens(900 + i, PROMPT_TOKENS) for i in range(2)]
    first = {}
    for p in warm:
        r = e.add(p, max_tokens=2)
        e.run(r, timeout_s=60)
        first[r] = e.runs[r].outputs
    assert e.worker_stats(0)["stored_chunks"] == 2 * PROMPT_TOKENS // 64

    # a load in flight: a repeat of the first prompt, stepped until its lookup hit sent the load
    w = e.worker_conn
    loads_before = w.stats["loads"] + w.stats["load_failures"]
    rl = e.add(warm[0], max_tokens=2)
    for _ in range(200):
        e.step()
        if e.sched_conn._loading:
            break
        time.sleep(0.002)
    assert e.sched_conn._loading, "the repeat's load was planned"
    daemon.pause()
    times.on = True
    # a burst of arrivals: their lookups (~18 KB each) fill the socket buffer long before the
    # first lookup's timeout marks the daemon down
    burst = [e.add(H.tokens(2000 + i, PROMPT_TOKENS), max_tokens=1) for i in range(BURST)]
    fresh, t_end, seed = [], time.monotonic() + PAUSE_S, 1000
    try:
        aborted = False
        while time.monotonic() < t_end:
            if not aborted and time.monotonic() > t_end - PAUSE_S + 3.0:
                # clients gave up on the burst's requests that wait (vLLM aborts them)
                waiting = [r for r in burst if r in e.scheduler.requests and not e.runs[r].computed]
                e.scheduler.finish_requests(waiting, RequestStatus.FINISHED_ABORTED)
                aborted = True
            elif aborted and len(e.scheduler.requests) < 3:  # requests keep arriving, a few at a time
                seed += 1
                fresh.append(e.add(H.tokens(seed, PROMPT_TOKENS), max_tokens=2))
            so = e.step()
            if not so.total_num_scheduled_tokens:
                time.sleep(0.002)
    finally:
        times.on = False
        daemon.resume()
    worst = max(times.worst_s.items(), key=lambda kv: kv[1])
    with capsys.disabled():
        print(f"\n[hung daemon] {sum(times.calls.values())} connector calls in {PAUSE_S:.0f} s stopped, "
              f"{BURST} + {len(fresh)} requests; longest: {worst[0]} {worst[1] * 1e3:.2f} ms; "
              + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(times.worst_s.items())))
    assert worst[1] < CALL_BOUND_S, f"{worst[0]} took {worst[1] * 1e3:.1f} ms while the daemon was stopped"
    done = [r for r in fresh if r not in e.scheduler.requests]
    assert len(done) >= 3, "requests finished (recomputed) while the daemon was stopped"
    assert w.stats["late_ops"] >= 1 and w.stats["loads"] + w.stats["load_failures"] > loads_before
    e.run(timeout_s=60)  # the rest finish; the repeat's load was recomputed or landed, checked byte by byte
    assert e.runs[rl].outputs == first[next(iter(first))]

    # the daemon answers again: a repeat of the second prompt hits
    deadline = time.monotonic() + 10
    while not e.sched_conn.client.available():
        assert time.monotonic() < deadline, "the scheduler never saw the daemon back"
        time.sleep(0.05)
    loaded = w.stats["loaded_chunks"]
    rr = e.add(warm[1], max_tokens=2)
    e.run(rr, timeout_s=60)
    assert w.stats["loaded_chunks"] > loaded, "prefix hits resume after SIGCONT"
    assert e.runs[rr].outputs == first[list(first)[1]]
    assert e.runs[rr].computed < PROMPT_TOKENS // 2
