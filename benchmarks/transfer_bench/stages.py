"""--trace: where a lone request's time goes, stage by stage.

The daemon records ``(rid, stage, perf_counter_ns)`` at named points of each request when
``KVDEPOT_TRACE_FILE`` is set (`kvdepot.trace`; written when it stops), and so does the client
in this process (``c_gathered`` once a store's ring region was taken, and without fence words
its gather ran; with them the gather is enqueued after the send, beside the daemon's work; ``c_sent``
after the request left, ``c_reply`` when its reply was decoded). The lone-request loop of
`transfer_bench.point` adds ``b_call`` (before the client call), ``b_replied`` (a retrieve's
``result`` returned: reply in or landed word seen (``c_landed``: a gated retrieve, or a store
that ended on its word), scatter enqueued) and ``b_end`` (the op is over: a store's reply,
a retrieve's scatter finished on the GPU). Both processes read CLOCK_MONOTONIC, so the points
of one request line up; the daemon's are matched by rid within the request's own time span
(only one client talks to the daemon during the lone requests; other clients reuse rid
numbers, so a point outside the request's span is someone else's).
"""

from __future__ import annotations

import collections
import json
import os
import statistics

from kvdepot import trace

# the order in which a lone request passes the points (those a run lacks are skipped)
ORDER = {
    "store": ("b_call", "c_gathered", "c_sent", "start", "enqueue", "enqueued", "gpu_done", "reply", "c_reply", "b_end"),
    "retrieve": ("b_call", "c_sent", "start", "enqueue", "r_enqueued", "gpu_done", "reply", "c_reply", "b_replied",
                 "b_end"),
    # a gated retrieve that took its count from the landed word (its reply dropped unread)
    "retrieve_landed": ("b_call", "c_sent", "start", "enqueue", "r_enqueued", "c_landed", "b_replied", "b_end"),
    # a store that ended on its landed word (`Store.landed`; its reply read later)
    "store_landed": ("b_call", "c_gathered", "c_sent", "start", "enqueue", "enqueued", "c_landed", "b_end"),
}
MEANING = {  # what the time between a point and the one before it is
    "c_gathered": "client: ring alloc (+ gather where no fence words)",
    "c_sent": "client: encode + send",
    "start": "ipc + daemon wakeup + decode",
    "enqueue": "daemon: index / plan",
    "enqueued": "daemon: copy enqueue",
    "r_enqueued": "daemon: copy enqueue",
    "gpu_done": "copy (incl. fence wait) + completion seen by the loop",
    "reply": "daemon: commit + reply encode",
    "c_reply": "send + ipc + client wakeup + decode",
    "c_landed": "copy (incl. fence wait) + its landed word seen by the client",
    "b_replied": "client: scatter enqueue (gated: already enqueued)",
    "b_end": "client: rest (store: handle; retrieve: scatter on GPU)",
}


def enable(path: str) -> None:
    """Trace the daemon started after this call (into ``path``) and this process."""
    os.environ["KVDEPOT_TRACE_FILE"] = path
    trace.POINTS = []


def enable_in_tempdir() -> str:
    """`enable` with a file in a new temporary directory; returns its path."""
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="kvd-trace-"), "daemon-trace.jsonl")
    enable(path)
    return path


def client_points() -> dict[int, list[tuple[str, int]]]:
    by_rid: dict[int, list[tuple[str, int]]] = collections.defaultdict(list)
    for rid, stage, t in trace.POINTS or ():
        by_rid[rid].append((stage, t))
    return by_rid


def daemon_points(path: str) -> dict[int, list[tuple[str, int]]]:
    by_rid: dict[int, list[tuple[str, int]]] = collections.defaultdict(list)
    try:
        with open(path) as f:
            for line in f:
                rid, stage, t = json.loads(line)
                by_rid[rid].append((stage, t))
    except OSError:
        pass
    return by_rid


def breakdown(op: str, rids: list[int], mine: dict, daemon: dict) -> dict:
    """Median microseconds from each point to the next for the lone requests ``rids`` of one
    op (a request whose client saw its landed word, ``c_landed``, goes by that order:
    ``<op>_landed``, its reply's points dropped), the median total, and how many requests had
    every point."""
    deltas: dict[str, list[float]] = collections.defaultdict(list)
    totals, complete = [], 0
    for rid in rids:
        own = {s: t for s, t in mine.get(rid, ()) if s.startswith("b_")}
        if "b_call" not in own or "b_end" not in own:
            continue
        lo, hi = own["b_call"], own["b_end"]
        pts = dict(own)
        # other clients of this process and the daemon's other connections reuse rid numbers:
        # only points inside the request's own span are its
        for stage, t in [*mine.get(rid, ()), *daemon.get(rid, ())]:
            if lo <= t <= hi:
                pts.setdefault(stage, t)
        order = ORDER[f"{op}_landed" if "c_landed" in pts else op]
        seq = [(s, pts[s]) for s in order if s in pts]
        complete += len(seq) == len(order)
        for (_, a), (s, b) in zip(seq, seq[1:]):
            deltas[s].append((b - a) / 1e3)
        totals.append((hi - lo) / 1e3)
    names = dict.fromkeys([*ORDER[op], *ORDER[f"{op}_landed"]])
    return {"stages_us": {s: statistics.median(deltas[s]) for s in names if deltas.get(s)},
            "stage_counts": {s: len(deltas[s]) for s in names if deltas.get(s)},
            "total_us": statistics.median(totals) if totals else None, "requests": len(totals),
            "complete": complete}


def report(results: list[dict], daemon_file: str) -> list[str]:
    """Adds ``lone_stages`` to each result that recorded lone rids; returns the lines to print."""
    mine, daemon = client_points(), daemon_points(daemon_file)
    lines = []
    if not daemon:
        lines.append(f"--trace: no daemon trace in {daemon_file} (did the daemon stop cleanly?)")
    for r in results:
        rids = r.pop("lone_rids", None)
        if not rids:
            continue
        r["lone_stages"] = {op: breakdown(op, rids[op], mine, daemon) for op in ("store", "retrieve")}
        for op, b in r["lone_stages"].items():
            if not b["requests"]:
                continue
            link = r["link_d2h_us"] if op == "store" else r["link_h2d_us"]
            n = b["stage_counts"]
            parts = ", ".join(f"{MEANING.get(s, s)} {us:.0f}" + (f" [{n[s]}]" if n[s] != b["requests"] else "")
                              for s, us in b["stages_us"].items())
            lines.append(f"{r['shape']} chunk {r['chunk_tokens']} lone {op}: median {b['total_us']:.0f} us "
                         f"(link {link:.0f}) over {b['requests']} requests ({b['complete']} with every point): "
                         f"{parts}")
    return lines
