"""Shared by the vLLM connector's end-to-end test modules (`test_vllm_connector.py`,
`test_vllm_connector_faults.py`): their tokens per chunk, the short timeouts of the failure
tests, and small helpers over `vllm_harness` engines (their fixtures are in conftest.py)."""

from __future__ import annotations

import time

import vllm_harness as H

from kvdepot.client import KVDepotClient

CHUNK = 64
FAST = {"rpc_timeout_s": 0.5, "hold_max_s": 1.0}  # failure tests: short timeouts


def stored_chunks(endpoint: str, engine: H.Engine, rank: int = 0) -> int:
    """Chunks the daemon stored for the registration of ``engine``'s TP rank ``rank``."""
    reg = engine.registration_id(rank)
    with KVDepotClient(endpoint, timeout_s=5) as c:
        return next(e.stored_chunks for e in c.describe().engines if e.registration == reg)


def first_output(engine: H.Engine, req_id: str, max_steps: int = 200) -> None:
    """Step until ``req_id`` has sampled its first token."""
    for _ in range(max_steps):
        so = engine.step()
        if engine.runs[req_id].outputs:
            return
        if not so.total_num_scheduled_tokens:
            time.sleep(0.002)
    raise AssertionError(f"{req_id} produced nothing in {max_steps} steps")


def wait_for_lookup_answer(engine: H.Engine, req_id: str) -> None:
    """Poll until the scheduler's lookup of ``req_id`` was answered (at most 5 s)."""
    st = engine.sched_conn._reqs[req_id]
    client = engine.sched_conn.client
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        client.poll(0.01)
        if st.answered:
            return
    raise AssertionError("no lookup answer")


def collect_scheduler_stats(engine: H.Engine) -> list[dict]:
    """Every ``SchedulerStats.kv_connector_stats`` dict vLLM's scheduler emits from now on (what
    it passes on to its metrics: the workers' stats with the scheduler side's added)."""
    got: list[dict] = []
    update = engine.scheduler.update_from_output

    def spy(so, out):
        outputs = update(so, out)
        for eco in (outputs or {}).values():
            s = getattr(eco, "scheduler_stats", None)
            if s is not None and s.kv_connector_stats:
                got.append(s.kv_connector_stats)
        return outputs

    engine.scheduler.update_from_output = spy
    return got
