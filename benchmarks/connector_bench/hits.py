"""`benchmarks/vllm_connector.py --hits N`: how long a prefix hit's load takes through the
connector, alone and while other prompts' stores stream through the same worker, next to the
time the link needs for its bytes.

A hit request's life in vLLM with an asynchronous load: the scheduler allocates its blocks and
parks it (``WAITING_FOR_REMOTE_KVS``); the worker posts the load to the transfer thread in the
next step's ``bind_connector_metadata`` (before the forward's launch; `WorkerConnector.bind_connector_metadata`); a
later ``get_transfer_results`` reports it in ``finished_recving``; the next schedule computes
its last token. Per hit this measures, on the engine thread's clock:

* ``post_to_loaded_ms``: the post of its load (in the step that carried it) until the
  ``get_transfer_results`` that reported it (what the connector and the daemon take; a step's
  length bounds its resolution: the report is read once per step);
* ``added_to_first_token_ms``: ``add_request`` until its first sampled token (the lookup's
  answer, the wait for a step, the load, the step that computes its last token), and of it
  ``added_to_posted_ms`` and ``loaded_to_first_token_ms`` (vLLM's scheduling either side);
* ``link_ms``: its chunks' bytes at the same run's pinned host-to-device roofline.

Lone: each hit runs on an engine with nothing else to do. Streaming: a new (uncached) prompt
arrives every step (a step's token budget prefills one, and stores it) and a hit every other
step.
"""

from __future__ import annotations

import statistics
import time

import vllm_harness as H

from kvdepot import trace


class HitClock:
    """Stamps, per request, when its load was posted and when it was reported loaded (wraps the
    worker's ``_start_loads`` and the connector's ``get_transfer_results``); and, on the transfer
    thread (wrapping its ``_submit`` and its loads' ``finish``), when its first and last piece
    got staging-ring room and went to the daemon, and when its last piece ended (its scatter
    queued), so that a load's time splits into waiting for ring room, at the daemon, and
    waiting for the engine's next step to report it."""

    def __init__(self, engine: H.Engine) -> None:
        self.posted: dict[str, float] = {}
        self.loaded: dict[str, float] = {}
        self.first_sent: dict[str, float] = {}
        self.last_sent: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        self.steps: list[float] = []  # perf_counter at the end of each engine step (`hit_latency`)
        conn = engine.worker_conn
        start, results = conn._start_loads, conn.get_transfer_results
        mover = conn.mover
        submit, finish = mover.sender._submit, mover.book.loads.finish

        def timed_submit(kvreg, batch, stream):
            got = submit(kvreg, batch, stream)
            if got is not None:
                now = time.perf_counter()
                for q in batch:
                    if q.kind == "load":
                        self.first_sent.setdefault(q.req_id, now)
                        self.last_sent[q.req_id] = now
            return got

        def timed_finish(job, retrieved):
            self.ended.setdefault(job.req_id, time.perf_counter())
            return finish(job, retrieved)

        mover.sender._submit, mover.book.loads.finish = timed_submit, timed_finish

        def start_loads(meta):
            now = time.perf_counter()
            for job in meta.loads:
                self.posted.setdefault(job.req_id, now)
            return start(meta)

        def get_transfer_results(finished):
            res = results(finished)
            now = time.perf_counter()
            for rid in res.finished_recving or ():
                self.loaded.setdefault(rid, now)
            return res

        conn._start_loads, conn.get_transfer_results = start_loads, get_transfer_results

        # the scheduler side: when vLLM's scheduler first asked about the request (it had token
        # budget for it) and when the connector first answered (its lookup's reply was in)
        self.asked: dict[str, float] = {}
        self.answered: dict[str, float] = {}
        sched = engine.sched_conn  # (its per-step calls are bound on the instance)
        matched = sched.get_num_new_matched_tokens

        def get_num_new_matched_tokens(request, num_computed_tokens):
            got = matched(request, num_computed_tokens)
            now = time.perf_counter()
            self.asked.setdefault(request.request_id, now)
            if got[0] is not None:
                self.answered.setdefault(request.request_id, now)
            return got

        sched.get_num_new_matched_tokens = get_num_new_matched_tokens


def _step_until(engine: H.Engine, done, timeout_s: float = 120.0, on_step=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        trace.point(trace.ENGINE_THREAD, "e_step")
        so = engine.step()
        trace.point(trace.ENGINE_THREAD, "e_step_end")
        if on_step is not None:
            on_step()
        if not so.total_num_scheduled_tokens:
            time.sleep(0.0002)
        assert time.monotonic() < deadline, "engine did not finish"


def hit_latency(engine: H.Engine, cached: list[list[int]], fresh: list[list[int]], chunk_bytes: int,
                chunk_tokens: int) -> dict:
    """``cached``: prompts whose chunks the daemon holds (a hit each: half measured lone, half
    while ``fresh`` prompts, none cached, are prefilled and stored one per step)."""
    clock = HitClock(engine)
    added: dict[str, float] = {}
    first: dict[str, float] = {}

    def note_first_tokens():
        now = time.perf_counter()
        clock.steps.append(now)
        for rid in added:
            if rid not in first and engine.runs[rid].outputs:
                first[rid] = now

    def add_hit(prompt):
        rid = engine.add(prompt, max_tokens=1)
        added[rid] = time.perf_counter()
        return rid

    half = len(cached) // 2
    lone = []
    for p in cached[:half]:
        rid = add_hit(p)
        lone.append(rid)
        _step_until(engine, lambda: not engine.scheduler.has_requests(), on_step=note_first_tokens)
    step_ends = {"lone": clock.steps}
    clock.steps = step_ends["streaming"] = []
    stored_before = engine.worker_conn.stats["stored_chunks"]
    loaded_before = engine.worker_conn.stats["loaded_chunks"]
    # one fresh prompt arrives per step (a step's token budget prefills one), a hit every other
    # step: no backlog of prompts ahead of a hit in vLLM's waiting queue
    streaming, pending, new, steps = [], list(cached[half:]), list(fresh), 0
    engine.add(new.pop(0), max_tokens=1)
    t0 = time.perf_counter()

    def on_step():
        nonlocal steps
        steps += 1
        note_first_tokens()
        if new:
            engine.add(new.pop(0), max_tokens=1)
        if pending and steps % 2 == 0:
            streaming.append(add_hit(pending.pop(0)))

    _step_until(engine, lambda: not pending and not new and not engine.scheduler.has_requests(), on_step=on_step)
    wall_s = time.perf_counter() - t0
    stats = engine.worker_conn.stats
    out = {"hit_chunks": len(cached[0]) // chunk_tokens, "hits_lone": len(lone), "hits_streaming": len(streaming),
           "streaming_stored_chunks": stats["stored_chunks"] - stored_before,
           "streaming_loaded_chunks": stats["loaded_chunks"] - loaded_before,
           "streaming_store_gbps": (stats["stored_chunks"] - stored_before) * chunk_bytes / wall_s / 1e9,
           "streaming_steps": steps}
    for name, rids in (("lone", lone), ("streaming", streaming)):
        post = [1e3 * (clock.loaded[r] - clock.posted[r]) for r in rids if r in clock.loaded and r in clock.posted]
        ttft = [1e3 * (first[r] - added[r]) for r in rids if r in first]
        before = [1e3 * (clock.posted[r] - added[r]) for r in rids if r in clock.posted]
        after = [1e3 * (first[r] - clock.loaded[r]) for r in rids if r in first and r in clock.loaded]
        out[f"{name}_added_to_posted_ms_median"] = statistics.median(before) if before else None
        out[f"{name}_loaded_to_first_token_ms_median"] = statistics.median(after) if after else None
        out[f"{name}_loads_timed"] = len(post)
        out[f"{name}_post_to_loaded_ms_median"] = statistics.median(post) if post else None
        out[f"{name}_post_to_loaded_ms_max"] = max(post) if post else None
        out[f"{name}_added_to_first_token_ms_median"] = statistics.median(ttft) if ttft else None
        out[f"{name}_added_to_first_token_ms_max"] = max(ttft) if ttft else None
        # where added-to-posted went: until vLLM's scheduler asked the connector (token budget,
        # its queue), until the connector had the lookup's answer, then until the load was posted;
        # and post-to-loaded: ring room for the first / last piece, the daemon after the last
        # piece was sent, the engine's next report after the load ended
        for part, a, b in (("added_to_asked", added, clock.asked), ("asked_to_answered", clock.asked, clock.answered),
                           ("answered_to_posted", clock.answered, clock.posted),
                           ("post_to_first_sent", clock.posted, clock.first_sent),
                           ("post_to_last_sent", clock.posted, clock.last_sent),
                           ("last_sent_to_ended", clock.last_sent, clock.ended),
                           ("ended_to_reported", clock.ended, clock.loaded)):
            got = [1e3 * (b[r] - a[r]) for r in rids if r in a and r in b]
            out[f"{name}_{part}_ms_median"] = statistics.median(got) if got else None
        ends = step_ends[name]
        spans = [t1 - t0 for t0, t1 in zip(ends, ends[1:])]
        out[f"{name}_step_ms_median"] = 1e3 * statistics.median(spans) if spans else None
        # each hit's stamps in perf_counter nanoseconds (the clock of `kvdepot.trace`'s points:
        # `--trace` lines them up with its pieces' points in the engine and in the daemon)
        out[f"{name}_stamps_ns"] = [{k: int(1e9 * d[r]) for k, d in (("added", added), ("asked", clock.asked),
                                                                   ("answered", clock.answered),
                                                                   ("posted", clock.posted),
                                                                   ("first_sent", clock.first_sent),
                                                                   ("last_sent", clock.last_sent),
                                                                   ("ended", clock.ended), ("loaded", clock.loaded))
                                     if r in d} for r in rids]
    return out


def report(r: dict) -> str:
    """One line per mode; ``r`` has the roofline (``roofline_h2d_gbps``) and ``chunk_bytes``.
    Adds ``hit_link_ms`` and ``{lone,streaming}_post_to_loaded_vs_link`` to ``r`` (saved with it)."""
    if "lone_post_to_loaded_ms_median" not in r:
        return ""
    link_ms = r["hit_chunks"] * r["chunk_bytes"] / r["roofline_h2d_gbps"] / 1e6
    r["hit_link_ms"] = link_ms
    lines = [f"\n  a hit of {r['hit_chunks']} chunks (its bytes take {link_ms:.1f} ms on the link at the roofline):"]
    for name, what in (("lone", "alone"),
                       ("streaming", f"while stores stream ({r['streaming_store_gbps']:.1f} GB/s stored, "
                                     f"{r['streaming_stored_chunks']} chunks, {r['streaming_steps']} steps)")):
        med = r[f"{name}_post_to_loaded_ms_median"]
        if med is None:
            lines.append(f"  {what}: no load timed")
            continue
        r[f"{name}_post_to_loaded_vs_link"] = link_ms / med
        lines.append(f"  {what}: posted to reported loaded {med:.1f} ms median ({100 * link_ms / med:.0f}% of the"
                     f" link's time), {r[f'{name}_post_to_loaded_ms_max']:.1f} max; added to first token"
                     f" {r[f'{name}_added_to_first_token_ms_median']:.1f} ms median,"
                     f" {r[f'{name}_added_to_first_token_ms_max']:.1f} max (of it, added to posted"
                     f" {r[f'{name}_added_to_posted_ms_median']:.1f}, reported loaded to first token"
                     f" {r[f'{name}_loaded_to_first_token_ms_median']:.1f}; {r[f'{name}_loads_timed']} hits)")
        for whole, keys, note in (
                ("posted to reported", ("post_to_first_sent", "post_to_last_sent", "last_sent_to_ended",
                                        "ended_to_reported", "step"), ""),
                ("added to posted", ("added_to_asked", "asked_to_answered", "answered_to_posted"),
                 " (asked: vLLM's scheduler first asked the connector; answered: it had the lookup's answer)")):
            parts = [(k, r.get(f"{name}_{k}_ms_median")) for k in keys]
            lines.append(f"    of {whole} (ms, medians): " + ", ".join(
                f"{k.replace('_', ' ')} {v:.1f}" for k, v in parts if v is not None) + note)
    return "\n".join(lines)
