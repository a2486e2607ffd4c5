"""`benchmarks/vllm_connector.py --hits N --trace DIR`: when the worker read the daemon's replies
to a hit's load pieces, from the trace points (`kvdepot.trace`) of the daemon
(``daemon-trace.jsonl``) and of the engine process (``engine-trace.jsonl``, every client's
``c_sent`` / ``c_reply``), which share one clock with the hits' stamps (`connector_bench.hits`).

Points carry only the request's number, which no two clients of one process share (each counts
from its own base), so a piece is: a ``c_sent`` inside a hit's send window (its first piece sent
less 2 ms to its last piece sent), the daemon's first ``start`` of that number within 5 ms that an
``r_enqueued`` follows before the number's next ``start`` (a retrieve), its ``reply``, and the
engine's first ``c_reply`` of the number after that reply. (Clients of other processes may number
alike: the daemon's trace holds theirs too; the benchmark's engines are all in one process.)

* ``{mode}_reply_read_lag_us``: per load piece, the daemon's reply until the worker read it
  (median, p90, max; ``pieces``: how many were matched);
* ``{mode}_engine_silences``: stretches of more than 1.5 ms in the hits' window without any
  client trace point of the engine process (``c_*``) while at least two of the daemon's replies
  were sent (``count``, ``max_ms``, ``total_ms``): the worker's threads ran no client code while
  replies waited. Of ``total_ms``, what the threads were doing by their markers
  (`kvdepot.trace.TRANSFER_THREAD`, `kvdepot.trace.ENGINE_THREAD`): ``transfer_waiting_ms``
  (the transfer thread inside its wait for work or replies, which includes taking the GIL back
  after a reply woke it), ``transfer_running_ms`` (handling work), and ``engine_gpu_wait_ms``
  (the engine thread waiting for its step's GPU work, with the GIL let go).
"""

from __future__ import annotations

import collections
import json
import statistics
from pathlib import Path

from connector_bench.timers import pct

from kvdepot.trace import ENGINE_THREAD, TRANSFER_THREAD

SILENCE_NS = 1_500_000


def _load(path: Path) -> list[tuple[int, str, int]]:
    rows = [tuple(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda row: row[2])


def _by_rid(rows) -> dict[int, list[tuple[int, str]]]:
    out: dict[int, list[tuple[int, str]]] = collections.defaultdict(list)
    for rid, stage, t in rows:
        out[rid].append((t, stage))
    return out


def _first(points, stage: str, lo: float, hi: float = float("inf")) -> int | None:
    return next((t for t, s in points if s == stage and lo <= t < hi), None)


def _spans(marks: list[tuple[int, str]], start: str) -> list[tuple[int, int]]:
    """(begin, end) of each stretch from a ``start`` marker of one thread (its ``(t, stage)``
    points, in time order) to its next marker."""
    return [(t, nxt) for (t, stage), (nxt, _) in zip(marks, marks[1:]) if stage == start]


def _overlap_ns(a: int, b: int, spans: list[tuple[int, int]]) -> int:
    return sum(max(0, min(b, s1) - max(a, s0)) for s0, s1 in spans)


def summary(trace_dir: str | Path, r: dict) -> dict:
    """The fields above for each mode of ``r`` (one shape's result with ``{mode}_stamps_ns``)."""
    d = Path(trace_dir)
    daemon, engine = _load(d / "daemon-trace.jsonl"), _load(d / "engine-trace.jsonl")
    dby, eby = _by_rid(daemon), _by_rid(engine)
    replies = [t for _, stage, t in daemon if stage == "reply"]
    transfer = eby.get(TRANSFER_THREAD, [])
    waiting, running = _spans(transfer, "t_wait"), _spans(transfer, "t_run")
    gpu_wait = _spans(eby.get(ENGINE_THREAD, []), "e_gpu_wait")
    out = {}
    for mode in ("lone", "streaming"):
        stamps = r.get(f"{mode}_stamps_ns") or []
        lags = []
        for s in stamps:
            if "first_sent" not in s or "last_sent" not in s:
                continue
            lo, hi = s["first_sent"] - 2_000_000, s["last_sent"] + 100_000
            for rid, stage, t in engine:
                if stage != "c_sent" or not lo <= t <= hi:
                    continue
                pts = dby.get(rid, [])
                # the first start of the number after the send that a retrieve's copy follows
                # (another client's request of the same number may arrive in between)
                for start in (ts for ts, stage in pts if stage == "start" and t <= ts <= t + 5_000_000):
                    nxt = _first(pts, "start", start + 1) or float("inf")
                    if _first(pts, "r_enqueued", start, nxt) is not None:
                        break
                else:
                    continue  # a store, or not found
                reply = _first(pts, "reply", start, nxt)
                read = _first(eby.get(rid, []), "c_reply", reply) if reply is not None else None
                if read is not None:
                    lags.append((read - reply) / 1e3)
        out[f"{mode}_reply_read_lag_us"] = ({"pieces": len(lags), "median": statistics.median(lags),
                                             "p90": pct(lags, 0.9), "max": max(lags)} if lags else None)
        silences = []
        if stamps:
            w0 = min(s.get("posted", s.get("added", 0)) for s in stamps)
            w1 = max(s.get("loaded", s.get("ended", 0)) for s in stamps)
            times = [t for rid, stage, t in engine if rid >= 0 and stage.startswith("c_") and w0 <= t <= w1]
            for a, b in zip(times, times[1:]):
                if b - a > SILENCE_NS and sum(1 for t in replies if a < t < b) >= 2:
                    silences.append((a, b))
        out[f"{mode}_engine_silences"] = {
            "count": len(silences), "max_ms": max(((b - a) / 1e6 for a, b in silences), default=0.0),
            "total_ms": sum(b - a for a, b in silences) / 1e6,
            "transfer_waiting_ms": sum(_overlap_ns(a, b, waiting) for a, b in silences) / 1e6,
            "transfer_running_ms": sum(_overlap_ns(a, b, running) for a, b in silences) / 1e6,
            "engine_gpu_wait_ms": sum(_overlap_ns(a, b, gpu_wait) for a, b in silences) / 1e6}
    return out


def report(r: dict) -> str:
    """One line per mode (the fields `summary` added to ``r``)."""
    lines = []
    for mode, what in (("lone", "alone"), ("streaming", "while stores stream")):
        lag, quiet = r.get(f"{mode}_reply_read_lag_us"), r.get(f"{mode}_engine_silences")
        if lag is None or quiet is None:
            continue
        lines.append(f"\n  --trace, hits {what}: the daemon's reply to a load piece read by the worker after"
                     f" {lag['median']:.0f} us median, {lag['p90']:.0f} p90, {lag['max']:.0f} max ({lag['pieces']} pieces);"
                     f" {quiet['count']} stretches of > 1.5 ms without client code run in the engine process while"
                     f" replies waited (longest {quiet['max_ms']:.1f} ms, {quiet['total_ms']:.1f} ms in all: the transfer"
                     f" thread waiting {quiet['transfer_waiting_ms']:.1f} and running {quiet['transfer_running_ms']:.1f},"
                     f" the engine thread waiting for the GPU {quiet['engine_gpu_wait_ms']:.1f})")
    return "".join(lines)
