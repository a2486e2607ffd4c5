"""The lone-request stage breakdown of ``benchmarks/transfer.py --trace``
(`transfer_bench.stages`): a daemon started with ``KVDEPOT_TRACE_FILE`` and a client tracing in
this process record every point of a store and a retrieve, and the breakdown puts them in order
and sums to each request's own time."""

import os
import time
from pathlib import Path

import pytest

import kv_engine as ke
from conftest import start_daemon

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def stages(monkeypatch):
    from kvdepot import trace

    monkeypatch.syspath_prepend(str(BENCH))
    from transfer_bench import stages as mod

    monkeypatch.setattr(trace, "POINTS", None)
    monkeypatch.delenv("KVDEPOT_TRACE_FILE", raising=False)
    yield mod
    trace.POINTS = None


def test_lone_store_and_retrieve_are_broken_down_into_every_stage(tmp_path, stages):
    from kvdepot import trace

    trace_file = str(tmp_path / "daemon-trace.jsonl")
    stages.enable(trace_file)
    assert os.environ["KVDEPOT_TRACE_FILE"] == trace_file and trace.POINTS == []
    d = start_daemon(tmp_path / "d")
    try:
        spec = ke.EngineSpec(d.endpoint, ke.SMOLLM2, "LBNHC", (16,), (8,), 16, 4100, model_id="trace")
        rids = {"store": [], "retrieve": []}
        with ke.Engine(spec) as eng:
            c, reg = eng.client, eng.reg
            keys = eng.keys(ke.prompt_tokens(4100, 2 * 16))
            for i, key in enumerate(keys):
                t0 = time.perf_counter_ns()
                p = c.submit_store(reg, [key], [[i]])
                assert p.result().stored == 1
                rids["store"].append(p.rid)
                trace.point_at(p.rid, "b_call", t0)
                trace.point_at(p.rid, "b_end", time.perf_counter_ns())
            for i, key in enumerate(keys):
                t0 = time.perf_counter_ns()
                p = c.submit_retrieve(reg, [key], [[4 + i]])
                assert p.result() == 1
                t1 = time.perf_counter_ns()
                rids["retrieve"].append(p.rid)
                for stage, t in (("b_call", t0), ("b_replied", t1), ("b_end", t1)):
                    trace.point_at(p.rid, stage, t)
    finally:
        d.stop()  # the daemon writes its trace as it stops
    results = [{"shape": "smollm2", "chunk_tokens": 16, "link_d2h_us": 1.0, "link_h2d_us": 1.0, "lone_rids": rids}]
    lines = stages.report(results, trace_file)
    got = results[0]["lone_stages"]
    for op, b in got.items():
        assert b["requests"] == 2 and b["complete"] == 2, (op, b)
        # every point of the op's order was seen, and the stages add up to the request's own time
        assert list(b["stages_us"]) == list(stages.ORDER[op][1:]), (op, b)
        assert all(us >= 0 for us in b["stages_us"].values()), b
        assert sum(b["stages_us"].values()) == pytest.approx(b["total_us"], rel=0.5)
    assert len(lines) == 2 and "lone store" in lines[0] and "daemon: index / plan" in lines[0], lines


def test_points_of_other_requests_with_the_same_rid_are_left_out(stages):
    """A point of the same rid outside a lone request's own span belongs to another request,
    which the breakdown leaves out (rids repeat across processes' clients; one process's clients
    each number from their own base, but the breakdown does not rely on it)."""
    from kvdepot import trace

    trace.POINTS = [(7, "c_sent", 50), (7, "b_call", 1000), (7, "c_sent", 1010), (7, "c_reply", 1090),
                    (7, "b_end", 1100), (7, "c_reply", 5000)]
    daemon = {7: [("start", 20), ("start", 1020), ("enqueue", 1030), ("r_enqueued", 1040), ("gpu_done", 1070),
                  ("reply", 1080), ("reply", 4000)]}
    b = stages.breakdown("retrieve", [7], stages.client_points(), daemon)
    assert b["total_us"] == pytest.approx(0.1) and b["requests"] == 1
    assert b["stages_us"]["c_sent"] == pytest.approx(0.010) and b["stages_us"]["start"] == pytest.approx(0.010)
    assert b["stages_us"]["c_reply"] == pytest.approx(0.010) and b["stages_us"]["b_end"] == pytest.approx(0.010)


def test_a_gated_retrieve_goes_by_its_landed_word(stages):
    """A gated retrieve whose client took the count from the landed word (``c_landed``) and
    dropped the reply: its stages run to the word, not through the reply's points, and a table
    over a mix of gated and replied requests says how many requests each stage covers."""
    from kvdepot import trace

    trace.POINTS = [(7, "b_call", 1000), (7, "c_sent", 1010), (7, "c_landed", 1070), (7, "b_replied", 1075),
                    (7, "b_end", 1100),
                    (8, "b_call", 2000), (8, "c_sent", 2010), (8, "c_reply", 2090), (8, "b_replied", 2095),
                    (8, "b_end", 2100)]
    daemon = {7: [("start", 1020), ("enqueue", 1030), ("r_enqueued", 1040), ("gpu_done", 1072), ("reply", 1080)],
              8: [("start", 2020), ("enqueue", 2030), ("r_enqueued", 2040), ("gpu_done", 2070), ("reply", 2080)]}
    b = stages.breakdown("retrieve", [7, 8], stages.client_points(), daemon)
    assert b["requests"] == 2 and b["complete"] == 2, b
    assert b["stages_us"]["c_landed"] == pytest.approx(0.030) and b["stage_counts"]["c_landed"] == 1
    assert b["stage_counts"]["gpu_done"] == 1 and b["stages_us"]["gpu_done"] == pytest.approx(0.030)
    assert b["stage_counts"]["b_replied"] == 2 and b["stages_us"]["b_replied"] == pytest.approx(0.005)
    lines = stages.report([{"shape": "x", "chunk_tokens": 16, "link_d2h_us": 1.0, "link_h2d_us": 1.0,
                            "lone_rids": {"store": [], "retrieve": [7, 8]}}], "/nonexistent")
    assert any("landed word seen by the client 0 [1]" in ln for ln in lines), lines
