"""The command line of benchmarks/transfer.py (its module docstring is the --help text)."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import time

import torch

from kvdepot.client import KVDepotClient
from kvdepot.client.kvcache import ShmKVCache
from transfer_bench.baselines import Blocks, Pages
from transfer_bench.engines import evaluate_many, format_many, run_many_engines
from transfer_bench.point import Ctx, bench_point
from transfer_bench.procs import FALLBACK_FLAG, DaemonProc, kernels_missing, zmq_echo_rtt_us
from transfer_bench.report import HEADER, baseline_line, evaluate_targets, format_row, write_json
from transfer_bench import stages
from transfer_bench.shapes import SHAPES, chunks_for, say

DESCRIPTION = ""  # set by benchmarks/transfer.py


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default=None, help="use this running daemon instead of starting one")
    p.add_argument("--l1-bytes", default="48g", help="L1 size of the daemon started here (default 48g)")
    p.add_argument("--warmup-s", type=float, default=60.0,
                   help="wait at most this long for the daemon to finish pinning L1 (it logs 'L1 pinned')")
    p.add_argument("--daemon-args", default="", help="extra arguments for `kvdepot serve`, e.g. "
                   "'--staging-batch-bytes 64m'")
    p.add_argument("--daemon-log", default=None, help="daemon log file (default: in its temp dir)")
    p.add_argument("--chunk-sizes", default="64,256,1024,2048")
    p.add_argument("--shapes", default="", help="comma-separated substrings of shape names to run (default all)")
    p.add_argument("--quick", action="store_true", help="only Llama-3.1-8B TP1 at chunks 64 and 256")
    p.add_argument("--outstanding", type=int, default=4, help="requests in flight per direction")
    p.add_argument("--staging", choices=("engine", "daemon"), default="engine",
                   help="engine: this process gathers / scatters on its streams through a staging ring and the "
                        "daemon only copies over PCIe (register's local_storages); daemon: the daemon gathers")
    p.add_argument("--client-mode", choices=("pipelined", "threads"), default="pipelined",
                   help="pipelined: one thread per direction keeps --outstanding requests in flight on one client "
                        "(submit_store / submit_retrieve); threads: --outstanding threads per direction, one "
                        "blocking request each")
    p.add_argument("--per-message", type=int, default=1,
                   help="pipelined: one-chunk prompts per STORE / RETRIEVE message (submit_store_many / "
                        "submit_retrieve_many; default 1: one request per prompt); lone requests stay one chunk")
    p.add_argument("--spin-us", type=float, default=200.0, help="the clients' spin before a wait sleeps")
    p.add_argument("--bytes-per-point", type=float, default=2e9, help="bytes per stream measurement (about)")
    p.add_argument("--baseline-bytes", type=float, default=5e8, help="bytes per baseline measurement (about)")
    p.add_argument("--iters", type=int, default=5, help="repetitions of each stream / roofline measurement")
    p.add_argument("--lone-iters", type=int, default=50, help="lone requests per op")
    p.add_argument("--out", default="transfer.json", help="JSON results")
    p.add_argument(FALLBACK_FLAG, action="store_true",
                   help="run even where the CUDA kernel library does not load (the torch fallback: not the product's speed)")
    p.add_argument("--trace", action="store_true",
                   help="stage breakdown of the lone requests: the daemon and this process record per-request "
                        "points (KVDEPOT_TRACE_FILE, transfer_bench.stages), printed at the end")
    g = p.add_argument_group("many engines (transfer_bench.engines)")
    g.add_argument("--engines", type=int, default=0,
                   help="also run N engine processes against the one daemon (store, retrieve, half and half)")
    g.add_argument("--only-engines", action="store_true", help="skip the per-shape points")
    g.add_argument("--engine-shape", default="Llama-3.1-8B TP1", help="the engines' model shape")
    g.add_argument("--engine-chunk", default="256",
                   help="the engines' tokens per chunk; comma-separated: one run per size (e.g. 64,256)")
    g.add_argument("--gpus", type=int, default=1,
                   help="spread the CUDA engines over GPUs 0..N-1 (engine i on GPU i %% N) against the one daemon; "
                        "the roofline is then every GPU's link at once, next to one GPU's alone "
                        "(e.g. --gpus 4 --engines 8 --engine-shape 'Llama-3.1-70B TP4')")
    g.add_argument("--engine-outstanding", type=int, default=8, help="requests in flight per engine")
    g.add_argument("--engine-bytes", type=float, default=4e9, help="bytes all engines move per phase (about)")
    g.add_argument("--engine-device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: CPU engines in shared memory (with --only-engines, runs without a GPU)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cuda = not (args.only_engines and args.engine_device == "cpu")
    if cuda and not torch.cuda.is_available():
        say("transfer.py needs CUDA (this measures the daemon's GPU data path); "
            "--only-engines --engine-device cpu runs CPU engines without one")
        return 2
    if cuda and not args.allow_torch_fallback:
        why = kernels_missing()
        if why is not None:
            say(f"the CUDA kernel library is unavailable ({why}): the daemon and engines would run the torch "
                f"fallback. Rebuild it (`kvdepot build-kernels`), or pass {FALLBACK_FLAG} to measure that")
            return 2
    if args.engines and not any(s.name == args.engine_shape for s in SHAPES):
        say(f"--engine-shape: one of {', '.join(s.name for s in SHAPES)}")
        return 2
    engine_chunks = [int(x) for x in args.engine_chunk.split(",") if x.strip()]
    if args.gpus > 1 and (not cuda or args.gpus > torch.cuda.device_count() or args.engines < args.gpus):
        say(f"--gpus {args.gpus} needs CUDA engines, that many GPUs (this machine has "
            f"{torch.cuda.device_count() if cuda else 0}) and at least one engine per GPU (--engines)")
        return 2
    dev = None
    if cuda:
        dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    daemon = None
    endpoint = args.endpoint
    doc: dict = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
                 "cuda": torch.version.cuda, "python": sys.version.split()[0], "args": vars(args), "results": []}
    t_run = time.perf_counter()
    try:
        zmq_rtt = zmq_echo_rtt_us()
        doc["zmq_echo_rtt"] = zmq_rtt
        say(f"bare ZMQ ipc round trip: median {zmq_rtt['median_us']:.1f} us (p10 {zmq_rtt['p10_us']:.1f}, "
            f"p90 {zmq_rtt['p90_us']:.1f})")
        trace_file = ""
        if args.trace:
            if endpoint is not None:
                say("--trace needs the daemon this run starts (not --endpoint)")
                return 2
            trace_file = stages.enable_in_tempdir()
        if endpoint is None:
            daemon = DaemonProc(args.l1_bytes, shlex.split(args.daemon_args), args.daemon_log, pin=cuda)
            say(f"starting daemon: {' '.join(daemon.cmd)}  (KVDEPOT_KERNELS_SO={daemon.kernels_so or 'unset'})")
            t0 = time.monotonic()
            daemon.wait_ready()
            say(f"daemon ready in {time.monotonic() - t0:.1f} s; waiting up to {args.warmup_s:.0f} s for L1 pinning")
            pinned, waited = daemon.wait_pinned(args.warmup_s)
            if daemon.pin:
                say(f"L1 {'pinned' if pinned else 'NOT fully pinned (see the daemon log)'} after {waited:.1f} s")
            else:
                say("L1 not pinned (--no-pin-l1): copies to and from L1 run at pageable speed")
            doc["daemon"] = {"cmd": daemon.cmd, "l1_pinned": pinned, "pin_wait_s": waited,
                             "kernels_so": daemon.kernels_so}
            endpoint = daemon.endpoint
        else:
            doc["daemon"] = {"endpoint": endpoint, "external": True}
        if not args.only_engines:
            run_points(args, endpoint, dev, zmq_rtt["median_us"], doc, daemon.proc.pid if daemon is not None else None)
        targets = evaluate_targets(doc["results"])
        if args.engines:
            doc["many_engines"] = []
            for chunk in engine_chunks:
                say(f"\n{args.engines} engine processes against one daemon:")
                many = run_many_engines(endpoint, daemon.proc.pid if daemon is not None else None, args.engines,
                                        args.engine_shape, chunk, args.engine_outstanding, args.engine_bytes,
                                        args.engine_device, args.iters, args.gpus)
                doc["many_engines"].append(many)
                say(format_many(many))
                targets += evaluate_many(many)
        doc["targets"] = targets
        doc["total_s"] = time.perf_counter() - t_run
        if trace_file:
            daemon.stop()  # writes its trace
            for line in stages.report(doc["results"], trace_file):
                say(line)
        write_json(args.out, doc)
        say(f"\ndaemon transfer engine: {doc.get('transfer_engine', '?')}")
        say("targets:")
        for t in doc["targets"]:
            say(f"  {'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {t['value']:.3g} (limit {t['limit']:.3g})")
        say(f"results written to {args.out} ({doc['total_s']:.0f} s in all)")
        return 0
    finally:
        if daemon is not None:
            rc = daemon.stop()
            tail = daemon.log_tail(200)
            bad = [ln for ln in tail.splitlines() if " ERROR " in ln or " WARNING " in ln or "Traceback" in ln]
            if rc not in (0, None) or bad:
                say(f"daemon exit code {rc}; log {daemon.log_path}:\n" + "\n".join(bad[-20:] or tail.splitlines()[-20:]))


def run_points(args, endpoint: str, dev: torch.device, zmq_us: float, doc: dict, daemon_pid: int | None = None) -> None:
    """Every (shape, chunk size) point (`transfer_bench.point.bench_point`); rows go into
    ``doc["results"]`` (errors into ``doc["errors"]``), the JSON is rewritten after each."""
    shapes = SHAPES
    chunk_sizes = [int(x) for x in args.chunk_sizes.split(",") if x]
    if args.quick:
        shapes, chunk_sizes = [SHAPES[0]], [64, 256]
    elif args.shapes:
        want = [w.strip().lower() for w in args.shapes.split(",") if w.strip()]
        shapes = [s for s in SHAPES if any(w in s.name.lower() for w in want)]
    k = args.outstanding
    kc = k * (args.per_message if args.client_mode == "pipelined" else 1)  # chunks in flight per direction
    clients = [KVDepotClient(endpoint, timeout_s=120, name=f"bench-{i}", spin_us=args.spin_us) for i in range(2 * k)]
    try:
        streams = [torch.cuda.Stream(dev) for _ in range(2 * k)]
        points = [(s, cs) for s in shapes for cs in chunk_sizes]
        max_bytes = max(chunks_for(s, cs, args.bytes_per_point, kc) * s.token_bytes * cs for s, cs in points)
        host = [torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        devbuf = [torch.randint(0, 256, (max_bytes,), dtype=torch.uint8, device=dev) for _ in range(2)]
        ctx = Ctx(args, dev, clients, streams, host, devbuf, zmq_us, daemon_pid)
        say(f"device {doc['device']}, torch {torch.__version__}; {k} requests outstanding per direction"
            f"{f', {args.per_message} one-chunk prompts per request' if kc != k else ''}; "
            f"up to {max_bytes / 1e9:.2f} GB per measurement")
        say(HEADER)
        for shape in shapes:
            cs_list = [cs for cs in chunk_sizes if all(cs % g.tokens_per_block == 0 for g in shape.groups)]
            if not cs_list:
                continue
            max_tokens = max(chunks_for(shape, cs, args.bytes_per_point, kc) * cs for cs in cs_list)
            num_blocks = [2 * max_tokens // g.tokens_per_block + 16 for g in shape.groups]
            cache = ShmKVCache(list(shape.groups), num_blocks, shape.layout, device=dev)
            cache.storage.random_()
            specs = (cache.storage_specs(), cache.layer_specs(), cache.group_specs())  # IPC handle exported once
            blocks = Blocks(shape, max_tokens, num_blocks)
            pages = Pages(cache)
            for cs in cs_list:
                try:
                    r = bench_point(ctx, shape, cache, specs, blocks, pages, cs)
                except Exception as exc:  # noqa: BLE001 - report the point and go on with the next
                    say(f"{shape.name:<19} {cs:>5} FAILED: {type(exc).__name__}: {exc}")
                    doc.setdefault("errors", []).append({"shape": shape.name, "chunk_tokens": cs,
                                                         "error": f"{type(exc).__name__}: {exc}"})
                    write_json(args.out, doc)
                    continue
                doc["results"].append(r)
                if "transfer_engine" not in doc:
                    with contextlib.suppress(Exception):
                        doc["transfer_engine"] = clients[0].describe().transfer_engine
                say(format_row(r))
                say(baseline_line(r))
                write_json(args.out, doc)
            del pages, blocks, cache
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                c.close()
