"""A paired A/B of the connector's per-step cost inside one process: one engine, a change
toggled on and off between runs, so that both arms share the host's state of the moment.

Why: the same code's store step moves by tens of microseconds from one process to the next on
one host (`vllm_connector.py`, run after run; docs/benchmarks.md). A change worth 5-20 us
cannot show between processes against that drift; run next to each other in one process, its
arms can. This is how a change to the connector's per-step calls is judged.

A variant is a Python file that defines ``on(engine)`` and ``off(engine)``: ``on`` switches the
change in (replacing methods on classes or on the engine's connectors, ``sched_conn`` and
``worker_conn`` of tests/vllm/vllm_harness.py's ``Engine``), ``off`` restores exactly what was
there. Variants are written for one decision and not kept (git history holds the one
docs/benchmarks.md cites, ``benchmarks/variants/bound_step_calls.py``, at 8817b11). Without
one (``--aa``) both arms run the same code: the instrument's own spread, to read the A/B
against.

Each run: ``--requests`` fresh prompts of 16 chunks prefilled and stored, one prompt per step
(`vllm_connector.drive`; the connector's time per store step, median over the run's steps),
then 8 requests decoding (`vllm_connector.decode_steps`). Runs go A B B A A B B A ... (ABBA:
a drift over the runs weighs on both arms alike); each pair (A B or B A) gives B - A. Reported:
each arm's median, each pair's difference, their median, and in how many pairs B was the
cheaper; ``b_over_a``: B's median / A's (the reference measured in the same run).

    python benchmarks/connector_ab.py my_variant.py --shape 'Llama-3.1-8B TP1' --runs 16 --out ab.json
    python benchmarks/connector_ab.py --aa --runs 8

Needs a CUDA GPU, the kernel library and vLLM's Python files (``--device cpu``: a smoke run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
from pathlib import Path

import vllm_connector as V
from connector_bench.model import CHUNKS_PER_STEP, shapes
from kvdepot.config import parse_bytes
from transfer_bench.procs import DaemonProc
from vllm.utils.gc_utils import freeze_gc_heap  # (after vllm_connector: its harness stubs vLLM's compiled modules)

H = V.H


class _Same:
    """``--aa``: both arms the same code."""

    @staticmethod
    def on(engine) -> None:
        return None

    @staticmethod
    def off(engine) -> None:
        return None


def load_variant(path: str):
    """The module at ``path``, which must define ``on(engine)`` and ``off(engine)``.

    Raises:
        ValueError: it lacks one of them.
    """
    spec = importlib.util.spec_from_file_location("connector_ab_variant", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not (callable(getattr(mod, "on", None)) and callable(getattr(mod, "off", None))):
        raise ValueError(f"{path} must define on(engine) and off(engine)")
    return mod


def arms(runs: int) -> str:
    """``runs`` arms in ABBA order ("ABBAABBA..."); ``runs`` a multiple of 4."""
    if runs <= 0 or runs % 4:
        raise ValueError(f"runs must be a positive multiple of 4 (ABBA), not {runs}")
    return "ABBA" * (runs // 4)


def paired(rows: list[dict], key: str) -> list[float]:
    """B - A of ``key`` for each pair of consecutive runs (AB or BA)."""
    out = []
    for first, second in zip(rows[::2], rows[1::2]):
        a, b = (first, second) if first["arm"] == "A" else (second, first)
        out.append(b[key] - a[key])
    return out


def run(variant, shape: str, runs: int, requests: int = 24, chunk: int = 256, device: str = "cuda",
        l1_bytes: str = "20g", forward_us: float = 3000.0, output_wait: str = "own", evict_bytes: int = 0) -> dict:
    specs = shapes(smoke=True)[shape]
    tokens = CHUNKS_PER_STEP * chunk
    block_bytes = sum(s.page_size_bytes for s in specs.values())
    chunk_bytes = block_bytes * chunk // 16
    order = arms(runs)
    rows = []
    with tempfile.TemporaryDirectory() as td:
        wd = Path(td)
        d = DaemonProc(l1_bytes, [], str(wd / "daemon.log"), pin=device == "cuda")
        try:
            d.wait_ready()
            if d.pin:
                d.wait_pinned(120.0)
            e = V.new_engine(specs, H.model_dir(wd), d.endpoint, name="ab", chunk=chunk, requests=requests,
                             device=device, num_blocks=(requests * tokens + 4 * tokens) // 16 + 64,
                             output_wait=output_wait if device == "cuda" else "",
                             forward_us=forward_us if device == "cuda" else 0.0, evict_bytes=evict_bytes)
            try:
                e.add(H.tokens(8, 1000), max_tokens=1)  # connect, register, first kernels
                e.run(timeout_s=60)
                freeze_gc_heap()  # as vLLM's EngineCore after start-up
                V.drive(e, [H.tokens(500 + i, tokens) for i in range(requests)], "stores", chunk_bytes)  # warm-up
                for i, arm in enumerate(order):
                    (variant.on if arm == "B" else variant.off)(e)
                    prompts = [H.tokens(100_000 * (i + 1) + j, tokens) for j in range(requests)]
                    r = V.drive(e, prompts, "stores", chunk_bytes)
                    dec = V.decode_steps(e)
                    rows.append({"arm": arm, "store_step_us": r["step_us_median"], "store_step_us_p99": r["step_us_p99"],
                                 "decode_step_us": dec["decode_step_us_median"],
                                 "per_call_us": r["per_call_us_median"],
                                 "stored_chunks": r["stats"].get("stored_chunks")})
                    print(f"run {i:2d} {arm}: store step {r['step_us_median']:.1f} us, decode step "
                          f"{dec['decode_step_us_median']:.1f} us, chunks stored {rows[-1]['stored_chunks']}", flush=True)
            finally:
                variant.off(e)
                e.close()
        finally:
            d.stop()
    res = {"shape": shape, "runs": runs, "requests": requests, "chunk_tokens": chunk, "device": device,
           "forward_us": forward_us, "evict_bytes": evict_bytes, "rows": rows}
    for key in ("store_step_us", "decode_step_us"):
        diff = paired(rows, key)
        a = statistics.median(r[key] for r in rows if r["arm"] == "A")
        b = statistics.median(r[key] for r in rows if r["arm"] == "B")
        res[key] = {"a_median": a, "b_median": b, "b_over_a": b / a, "pairs_b_minus_a": diff,
                    "diff_median": statistics.median(diff), "pairs_b_cheaper": sum(1 for x in diff if x < 0)}
    calls = sorted({k for r in rows for k in r["per_call_us"]})
    res["per_call_us"] = {k: {arm: statistics.median(r["per_call_us"].get(k, 0.0) for r in rows if r["arm"] == arm)
                              for arm in "AB"} for k in calls}
    return res


def report(res: dict) -> str:
    lines = [f"{res['shape']}, {res['runs']} runs (ABBA), {res['requests']} prompts of 16 chunks each:"]
    for key, what in (("store_step_us", "store step"), ("decode_step_us", "decode step")):
        r = res[key]
        lines.append(f"  {what}: A {r['a_median']:.1f} us, B {r['b_median']:.1f} us median (B/A {r['b_over_a']:.2f});"
                     f" B - A per pair {', '.join(f'{x:+.1f}' for x in r['pairs_b_minus_a'])}: median"
                     f" {r['diff_median']:+.1f}, B cheaper in {r['pairs_b_cheaper']} of {len(r['pairs_b_minus_a'])}")
    per = res.get("per_call_us", {})
    busy = sorted(per.items(), key=lambda kv: -max(kv[1].values()))
    lines.append("  per call in a store step, median of the runs' medians (A -> B, us): " + ", ".join(
        f"{k} {v['A']:.1f} -> {v['B']:.1f}" for k, v in busy if max(v.values()) >= 0.5))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variant", nargs="?", default="", help="a Python file defining on(engine) and off(engine)")
    p.add_argument("--aa", action="store_true", help="no variant: both arms the same code (the spread)")
    p.add_argument("--shape", default="Llama-3.1-8B TP1", help=f"one of: {', '.join(shapes(smoke=True))}")
    p.add_argument("--runs", type=int, default=16, help="runs, a multiple of 4 (default 16: 8 pairs)")
    p.add_argument("--requests", type=int, default=24, help="prompts per run (default 24)")
    p.add_argument("--l1-bytes", default="20g")
    p.add_argument("--forward-us", type=float, default=3000.0,
                   help="GPU time of each forward, spun on the stream (default 3000, as the connector table's)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--evict-bytes", default="0",
                   help="host bytes each forward writes on the engine thread, as a model runner's own work "
                        "leaves the connector's code and objects out of the CPU caches (e.g. 64m)")
    p.add_argument("--out", default="", help="write the result as JSON here")
    args = p.parse_args(argv)
    if bool(args.variant) == args.aa:
        p.error("give a variant file or --aa, not both")
    variant = _Same if args.aa else load_variant(args.variant)
    res = run(variant, args.shape, args.runs, args.requests, device=args.device, l1_bytes=args.l1_bytes,
              forward_us=args.forward_us, evict_bytes=parse_bytes(args.evict_bytes))
    res["variant"] = "(A/A)" if args.aa else args.variant
    print(report(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
