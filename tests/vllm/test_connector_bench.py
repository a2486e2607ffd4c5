"""benchmarks/vllm_connector.py (a GPU benchmark) still runs end to end: its CPU smoke run
(shared-memory KV caches, its own daemon) with ``--timeline`` and ``--stages``, whose timers
wrap the connector's internals by name. No timing is checked: that every prompt's chunks were
stored and loaded, and that the timeline, stage and floor figures describe what ran."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]


def test_connector_benchmark_smoke_run_with_timeline_and_stages(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import vllm_connector as bench

    out = tmp_path / "r.json"
    assert bench.main(["--device", "cpu", "--shapes", "gpt-oss-20b", "--requests", "2", "--l1-bytes", "1g",
                       "--timeline", "--stages", "--evict-bytes", "1m", "--floor", "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    assert r["stored_chunks"] == r["loaded_chunks"] == 2 * bench.CHUNKS_PER_STEP
    assert r["evict_bytes"] == 1 << 20
    # the calls vLLM makes of any connector in every step are timed with the connector's own
    assert "get_kv_connector_stats" in r["decode_per_call_us_median"]
    assert "build_connector_worker_meta" in r["decode_per_call_us_median"]
    for op, sent_as in (("store", "client.submit_store"), ("load", "client.submit_retrieve")):
        t = r[f"{op}_timeline"]
        # one piece per request at least; every answer came after its send
        assert t["requests"] >= 2 and t["busy_ms"] > 0 and t["lead_in_ms"] >= 0 and t["tail_ms"] >= 0
        parts = t["lead_in_steps_before_ms"] + t["lead_in_step_to_post_ms"] + t["lead_in_post_to_send_ms"]
        assert parts == pytest.approx(t["lead_in_ms"], abs=1e-6)
        assert r[f"{op}_stages"][sent_as]["calls"] >= t["requests"]
        assert 0 <= t["post_to_take_us_median"] <= t["post_to_take_us_p99"] <= t["post_to_take_us_max"]
    # the engine thread's side is timed too: a save goes to the transfer thread through the
    # worker's `_post_quiet`, a load through `TransferThread.post`
    assert r["store_stages"]["worker._post_quiet"]["calls"] >= 2
    assert r["load_stages"]["mover.post"]["calls"] >= 1
    # vLLM's own scheduler, beside the connector's calls inside it, was timed in the same steps
    assert r["store_vllm_sched_us_median"] > 0 and r["load_vllm_sched_us_median"] > 0
    # B's hits load asynchronously: vLLM admits them in a step without a forward, whose own
    # scheduler time is kept apart (`*_vs_bound_with_admission` on a GPU)
    assert r["load_no_forward_sched_s"] > 0 and r["store_no_forward_sched_s"] >= 0
    from connector_bench import report as connector_report
    r2 = dict(r, load_vs_bound_with_admission=0.9)
    assert "counting vLLM's own scheduler in the steps without a forward" in connector_report._admission(r2, "load")
    assert connector_report._admission(dict(r2, load_no_forward_sched_s=0.0), "load") == ""
    # --floor: the same prompts on an engine whose connector does nothing, timed by the same calls:
    # each prompt is new in exactly one step (16 chunks per prompt, 16 chunks per step)
    assert r["floor_steps_measured"] == 2 and r["floor_decode_steps"] > 0
    assert {"build_connector_meta", "get_num_new_matched_tokens", "wait_for_save",
            "get_transfer_results"} <= set(r["floor_per_call_us_median"])


def test_connector_benchmark_times_hits_alone_and_while_stores_stream(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import vllm_connector as bench

    out = tmp_path / "r.json"
    traced = tmp_path / "trace"
    try:
        assert bench.main(["--device", "cpu", "--shapes", "Llama-3.1-70B TP4 shard", "--requests", "4", "--hits", "4",
                           "--chunk", "64", "--l1-bytes", "1g", "--trace", str(traced), "--out", str(out)]) == 0
    finally:
        from kvdepot import trace

        trace.POINTS = None
        os.environ.pop("KVDEPOT_TRACE_FILE", None)
    (r,) = json.loads(out.read_text())
    # --trace: the daemon's points and this process's, on the hits' clock: every hit's pieces
    # reached the daemon (a retrieve's points) between its load's post and its end (not "its
    # first piece sent": that stamp is taken after the send returns, and on a loaded machine
    # the daemon may start the retrieve milliseconds before the sending thread runs again)
    daemon = [json.loads(line) for line in (traced / "daemon-trace.jsonl").read_text().splitlines()]
    engine = [json.loads(line) for line in (traced / "engine-trace.jsonl").read_text().splitlines()]
    assert {"c_sent", "c_reply"} <= {stage for _, stage, _ in engine}
    starts: dict[int, list[int]] = {}
    retrieve_starts = []  # each retrieve's arrival: the last start of its rid before its copy was enqueued
    for rid, stage, t in sorted(daemon, key=lambda row: row[2]):
        if stage == "start":
            starts.setdefault(rid, []).append(t)
        elif stage == "r_enqueued":
            retrieve_starts.append(starts[rid][-1])
    for mode in ("lone", "streaming"):
        stamps = r[f"{mode}_stamps_ns"]
        assert len(stamps) == 2
        for s in stamps:
            assert (s["added"] <= s["asked"] <= s["answered"] <= s["posted"] <= s["first_sent"] <= s["last_sent"]
                    <= s["ended"] <= s["loaded"]), s
            assert any(s["posted"] <= t <= s["ended"] for t in retrieve_starts), s
        # the summary matched load pieces to the daemon's replies and the worker's reads of them
        # (hits whose loads are posted in one step may share one request: one piece at least)
        lag = r[f"{mode}_reply_read_lag_us"]
        assert lag["pieces"] >= 1 and 0 <= lag["median"] <= lag["p90"] <= lag["max"], lag
        quiet = r[f"{mode}_engine_silences"]
        parts = quiet["transfer_waiting_ms"] + quiet["transfer_running_ms"]
        assert quiet["count"] >= 0 and 0 <= parts <= quiet["total_ms"] + 1e-6, quiet
    # the threads' markers: the transfer thread's waits and runs, the engine thread's steps
    marks = {stage for rid, stage, _ in engine if rid < 0}
    assert {"t_wait", "t_run", "e_step", "e_step_end"} <= marks, marks
    assert r["hits_lone"] == r["hits_streaming"] == 2 and r["hit_chunks"] == bench.CHUNKS_PER_STEP
    # every hit loaded whole (a third engine: the chunks engine A stored), the streamed prompts stored
    assert r["streaming_loaded_chunks"] == 2 * bench.CHUNKS_PER_STEP
    assert r["streaming_stored_chunks"] == 4 * bench.CHUNKS_PER_STEP
    for mode in ("lone", "streaming"):
        assert r[f"{mode}_loads_timed"] == 2
        assert 0 < r[f"{mode}_post_to_loaded_ms_median"] <= r[f"{mode}_post_to_loaded_ms_max"]
        assert r[f"{mode}_post_to_loaded_ms_median"] <= r[f"{mode}_added_to_first_token_ms_max"]
        # the split of posted-to-reported: ring room, the daemon, the next report (each hit's
        # parts add up to its whole, so no part's median exceeds the largest whole)
        parts = [r[f"{mode}_{k}_ms_median"] for k in ("post_to_last_sent", "last_sent_to_ended", "ended_to_reported")]
        assert all(v is not None and 0 <= v <= r[f"{mode}_post_to_loaded_ms_max"] for v in parts), parts
        # and of added-to-posted: vLLM's queue, the lookup's answer, the rest of that step
        parts = [r[f"{mode}_{k}_ms_median"] for k in ("added_to_asked", "asked_to_answered", "answered_to_posted")]
        assert all(v is not None and v >= 0 for v in parts), parts
        assert r[f"{mode}_post_to_first_sent_ms_median"] <= r[f"{mode}_post_to_last_sent_ms_median"]
        assert r[f"{mode}_step_ms_median"] > 0


_VARIANT = '''
import json, os

def on(engine):
    conn = engine.sched_conn
    build = conn.build_connector_meta

    def counted(so):
        with open(os.environ["AB_LOG"], "a") as f:
            f.write("built\\n")
        return build(so)

    conn.build_connector_meta = counted
    with open(os.environ["AB_LOG"], "a") as f:
        f.write("on\\n")

def off(engine):
    engine.sched_conn.__dict__.pop("build_connector_meta", None)
    with open(os.environ["AB_LOG"], "a") as f:
        f.write("off\\n")
'''


def test_connector_ab_toggles_the_variant_in_abba_order_and_pairs_the_runs(tmp_path, monkeypatch):
    """benchmarks/connector_ab.py: arm B runs with the variant switched on, arm A with it off,
    in ABBA order on one engine; every run stores every chunk; each pair gives B - A."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import connector_ab as ab

    variant, log, out = tmp_path / "v.py", tmp_path / "log", tmp_path / "ab.json"
    variant.write_text(_VARIANT)
    monkeypatch.setenv("AB_LOG", str(log))
    assert ab.main([str(variant), "--device", "cpu", "--shape", "dense-2L (smoke)", "--runs", "4",
                    "--requests", "2", "--l1-bytes", "1g", "--evict-bytes", "1m", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [row["arm"] for row in r["rows"]] == list("ABBA")
    assert r["evict_bytes"] == 1 << 20
    assert set(r["per_call_us"]["build_connector_meta"]) == {"A", "B"}  # each arm's median per call
    assert all(row["stored_chunks"] == 2 * ab.CHUNKS_PER_STEP for row in r["rows"])
    events = log.read_text().split()
    # off before each A run, on before each B run, off once more at the end; the variant's
    # wrapper built metadata only while on
    switches = [e for e in events if e != "built"]
    assert switches == ["off", "on", "on", "off", "off"]
    on_spans = "".join("b" if e == "built" else " " if e == "off" else "" for e in events).split()
    assert len(on_spans) == 1 and len(on_spans[0]) > 0  # the B runs (runs 1 and 2 follow each other)
    for key in ("store_step_us", "decode_step_us"):
        assert len(r[key]["pairs_b_minus_a"]) == 2 and 0 <= r[key]["pairs_b_cheaper"] <= 2
    with pytest.raises(ValueError):
        ab.arms(6)
