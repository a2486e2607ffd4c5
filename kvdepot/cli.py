"""``kvdepot serve | describe | flush | ping | build-kernels | keygen | demo | soak`` (subcommands import lazily).

The daemon's settings (flags, environment variables, configuration file) are declared once in
`kvdepot.config`. Every client subcommand takes ``--endpoint`` (default ``$KVDEPOT_ENDPOINT``,
else ``ipc://<tmp>/kvdepot-<uid>.sock``).
"""

from __future__ import annotations

import argparse
import sys

from kvdepot.config import add_arguments as add_serve_arguments

def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _endpoint(args) -> str:
    from kvdepot.protocol.transport import default_endpoint

    return args.endpoint or default_endpoint()


def cmd_serve(args) -> int:
    import logging

    from kvdepot.config import resolve
    from kvdepot.server.daemon import DaemonConfig, run_daemon
    from kvdepot.server.netsec import CurveConfig

    st = resolve(args)
    if args.print_config:
        print(st.to_toml(), end="")
        return 0
    v = st.values
    logging.basicConfig(level=getattr(logging, v["log_level"].upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if bool(v["curve_secret_key"]) != bool(v["curve_clients"]):
        raise ValueError("CURVE needs both --curve-secret-key and --curve-clients (or neither)")
    curve = CurveConfig(v["curve_secret_key"], v["curve_clients"]) if v["curve_secret_key"] else None
    cfg = DaemonConfig(
        endpoints=v["endpoint"], l1_capacity_bytes=v["l1_bytes"], metrics_port=v["metrics_port"],
        metrics_addr=v["metrics_addr"], pin_ttl_s=v["pin_ttl_s"], transfer_threads=v["transfer_threads"],
        staging_batch_bytes=v["staging_batch_bytes"], copy_piece_bytes=v["copy_piece_bytes"], pin_l1=v["pin_l1"], busy_poll_us=v["busy_poll_us"],
        busy_poll_max_inflight=v["busy_poll_max_inflight"],
        curve=curve, l2_path=v["l2_path"], l2_capacity_bytes=v["l2_bytes"], l2_queue_bytes=v["l2_queue_bytes"],
        l2_io_threads=v["l2_io_threads"], l2_direct_io=v["l2_direct_io"], shutdown_drain_s=v["shutdown_drain_s"], l3_url=v["l3_url"],
        l3_cluster=v["l3_cluster"], l3_prefix=v["l3_prefix"], l3_ttl_s=v["l3_ttl_s"], l3_timeout_s=v["l3_timeout_s"],
        l3_queue_bytes=v["l3_queue_bytes"], watchdog_s=v["watchdog_s"], allow_shm_names=v["allow_shm_names"],
        tenant_quotas=v["tenant_quota"] or {})
    run_daemon(cfg)
    return 0


def _client(args):
    from kvdepot.client import KVDepotClient

    return KVDepotClient(_endpoint(args), timeout_s=args.timeout_s, name="kvdepot-cli")


def describe_text(info) -> str:
    """Human-readable table of a `DaemonInfo`."""
    lines = [
        f"kvdepot {info.version} (protocol {info.protocol_version})  boot {info.boot_id}  up {info.uptime_s:.0f} s",
        f"endpoints: {', '.join(info.endpoints)}   metrics port: {info.metrics_port or 'off'}   "
        f"transfer engine: {info.transfer_engine}",
    ]
    req, hit = info.lookup_requested_tokens, info.lookup_hit_tokens
    rate = f"{100 * hit / req:.1f}%" if req else "n/a"
    lines.append(f"lookups: {hit}/{req} tokens hit ({rate})   stored {info.stored_chunks} chunks   "
                 f"retrieved {info.retrieved_chunks}   evicted {info.evicted_chunks}   pinned requests "
                 f"{info.pinned_requests}")
    lines.append("")
    lines.append(f"{'TIER':<6}{'USED':>14}{'CAPACITY':>14}{'OBJECTS':>10}{'HITS':>10}{'EVICTED':>9}{'READ':>12}"
                 f"{'WRITTEN':>12}{'QUEUE':>7}{'DROPPED':>9}{'ERRORS':>8}{'CORRUPT':>9}")
    for t in info.tiers:
        lines.append(f"{t.name:<6}{_fmt_bytes(t.used_bytes):>14}{_fmt_bytes(t.capacity_bytes):>14}{t.num_objects:>10}"
                     f"{t.hit_chunks:>10}{t.evictions:>9}{_fmt_bytes(t.read_bytes):>12}{_fmt_bytes(t.written_bytes):>12}"
                     f"{t.queue_depth:>7}{t.dropped_writes:>9}{t.errors:>8}{t.corrupt_objects:>9}"
                     + (f"   {t.detail}" if t.detail else ""))
    if info.tenants:
        lines.append("")
        lines.append(f"{'TIER':<6}{'TENANT':<24}{'USED':>14}{'QUOTA':>14}{'QUOTA EVICTIONS':>17}")
        for t in info.tenants:
            lines.append(f"{t.tier:<6}{t.tenant:<24}{_fmt_bytes(t.used_bytes):>14}"
                         f"{_fmt_bytes(t.quota_bytes) if t.quota_bytes else '-':>14}{t.quota_evictions:>17}")
    lines.append("")
    if not info.engines:
        lines.append("no engines registered")
    for e in info.engines:
        lines.append(f"engine {e.registration}  model {e.model}  shard {e.shard}  pid {e.pid}  device {e.device}  "
                     f"chunk {e.chunk_size} tokens = {_fmt_bytes(e.object_bytes)}  stored {e.stored_chunks}  "
                     f"retrieved {e.retrieved_chunks}")
        if e.device != "cpu":
            lines.append(f"  transfers: {'engine-side staging, ring ' + _fmt_bytes(e.staging_bytes) if e.staging_bytes else 'the daemon gathers and scatters'}")
        lines.append(f"  {'GID':>4} {'LAYOUT':<11}{'DTYPE':<10}{'KV DTYPE':<14}{'LAYERS':>7}{'BLOCKS':>8}"
                     f"{'TOK/BLK':>8}{'HEADS':>6}{'KV':>3}{'ROW B':>7}{'B/TOKEN':>9}")
        for g in e.groups:
            lines.append(f"  {g.gid:>4} {g.layout:<11}{g.dtype:<10}{g.kv_dtype:<14}{g.num_layers:>7}{g.num_blocks:>8}"
                         f"{g.tokens_per_block:>8}{g.num_heads:>6}{g.num_kv:>3}{g.row_bytes:>7}{g.bytes_per_token:>9}")
    if info.stuck_transfers:
        lines.append("")
        lines.append(f"STUCK COPIES (past the watchdog's deadline, not ended): {len(info.stuck_transfers)}")
        for t in info.stuck_transfers:
            lines.append(f"  {t.op} of request {t.rid} for {t.registration}: {_fmt_bytes(t.size_bytes)}, "
                         f"{t.age_s:.1f} s old")
    if info.injected_faults:
        lines.append("")
        lines.append("FAULT INJECTION ON ($KVDEPOT_INJECT_FAULTS): " +
                     ", ".join(f"{k} {v}" for k, v in sorted(info.injected_faults.items())))
    return "\n".join(lines)


def cmd_describe(args) -> int:
    import msgspec

    with _client(args) as c:
        info = c.describe()
    if args.json:
        print(msgspec.json.encode(info).decode())
    else:
        print(describe_text(info))
    return 0


def cmd_flush(args) -> int:
    with _client(args) as c:
        r = c.flush(model=args.model or "", cache_salt=args.cache_salt, tier=args.tier or "")
    print(f"flushed {r.objects} objects ({_fmt_bytes(r.bytes)})")
    return 0


def cmd_ping(args) -> int:
    with _client(args) as c:
        print(f"kvdepot daemon at {c.endpoint} boot {c.ping()}")
    return 0


def cmd_build_kernels(args) -> int:
    from pathlib import Path

    from kvdepot.gpu.kernels import _cache_dir, build_kernels

    out = Path(args.out) if args.out else _cache_dir(args.arch) / "libkvdepot_kernels.so"
    out.parent.mkdir(parents=True, exist_ok=True)
    build_kernels(out, args.arch)
    print(f"built {out} for sm_{args.arch}; it links only the CUDA runtime (static). "
          f"Point KVDEPOT_KERNELS_SO at it, or leave it in the per-user cache.")
    return 0


def cmd_keygen(args) -> int:
    from kvdepot.server.netsec import keygen

    public, secret = keygen(args.dir, args.name)
    print(f"public key {public} (hand it out)\nsecret key {secret} (mode 0600; keep it)\n"
          "daemon: --curve-secret-key <its .key_secret> --curve-clients <a directory of its clients' .key files>\n"
          "client: KVDEPOT_CURVE_SERVER_KEY=<the daemon's .key> KVDEPOT_CURVE_CLIENT_KEY=<its own .key_secret>")
    return 0


def cmd_demo(args) -> int:
    from kvdepot.demo.run import main as demo_main

    return demo_main(args)


def cmd_soak(args) -> int:
    from kvdepot.config import parse_bytes
    from kvdepot.soak.run import SoakConfig, main as soak_main

    return soak_main(SoakConfig(
        duration_s=args.duration_s, engines=args.engines, seed=args.seed, device=args.device,
        cpu_engines=args.cpu_engines,
        l1_bytes=parse_bytes(args.l1_bytes), l2=not args.no_l2, l3=args.l3, fault_interval_s=args.fault_interval_s,
        daemon_faults=args.daemon_faults, watchdog_s=args.watchdog_s, client_timeout_s=args.client_timeout_s,
        hang_s=args.hang_s,
        reclaim_limit_s=args.reclaim_limit_s, workdir=args.workdir or "", json_path=args.json or ""))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvdepot", description="KV-cache server daemon for LLM serving engines.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--endpoint", default=None,
                        help="daemon address, ipc://PATH or tcp://127.0.0.1:PORT (env KVDEPOT_ENDPOINT)")
        sp.add_argument("--timeout-s", type=float, default=10.0, help="reply timeout in seconds")

    s = sub.add_parser("serve", help="run the daemon (settings: flag > environment > --config file > default)")
    s.set_defaults(endpoint=None)
    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser("describe", help="show engines, layer groups, memory and hit rates of a running daemon")
    common(d)
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(func=cmd_describe)

    f = sub.add_parser("flush", help="drop cached KV (all, or by model / cache salt / tier)")
    common(f)
    f.add_argument("--model", help="only this model's chunks")
    f.add_argument("--cache-salt", default=None, help="only this tenant's chunks ('' = unsalted)")
    f.add_argument("--tier", help="only this tier (l1, l2, l3; the daemon names its tiers if this is not one)")
    f.set_defaults(func=cmd_flush)

    pg = sub.add_parser("ping", help="check that a daemon answers")
    common(pg)
    pg.set_defaults(func=cmd_ping)

    bk = sub.add_parser("build-kernels", help="compile the CUDA transfer kernels with nvcc (ahead of first use)")
    bk.add_argument("--arch", default="90", help="compute capability without the dot (90 = H100/H200)")
    bk.add_argument("--out", default=None, help="output .so (default: the per-user kernel cache)")
    bk.set_defaults(func=cmd_build_kernels)

    kg = sub.add_parser("keygen", help="write a CURVE key pair for tcp:// endpoints (a daemon's or a client's)")
    kg.add_argument("--dir", default=".", help="where to write NAME.key and NAME.key_secret (default .)")
    kg.add_argument("--name", default="kvdepot", help="file name stem, e.g. server or the client's host name")
    kg.set_defaults(func=cmd_keygen)

    dm = sub.add_parser("demo", help="two engine processes share a real model's prompt KV through the daemon")
    common(dm)
    dm.add_argument("--chunk-size", type=int, default=256)
    dm.add_argument("--max-new-tokens", type=int, default=40)
    dm.add_argument("--threads", type=int, default=2, help="torch threads per engine process")
    dm.add_argument("--json-out", default=None, help="also write the results as JSON here")
    dm.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the model runs and the engines' KV caches live (cuda: CUDA IPC and the kernels)")
    dm.add_argument("--random-weights", action="store_true",
                    help="the model's architecture with seeded random weights (no GGUF file needed; the byte "
                         "and token checks stay exact, the answers are noise)")
    dm.set_defaults(func=cmd_demo)

    sk = sub.add_parser("soak", help="a daemon, engine processes checking every byte, and injected faults; "
                                     "exit 1 on a corrupt byte, a hang, a crash or unbounded memory")
    sk.add_argument("--duration-s", type=float, default=60.0, help="seconds of load once every engine registered")
    sk.add_argument("--engines", type=int, default=4, help="engine processes (3 model families, mixed layouts)")
    sk.add_argument("--seed", type=int, default=1, help="seed of the workload and of every fault")
    sk.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the engines' KV caches live")
    sk.add_argument("--cpu-engines", type=int, default=0,
                    help="with --device cuda: this many of the engines keep their KV caches in shared memory "
                         "(both kinds on one daemon; CPU engines also get the shrunk-segment fault)")
    sk.add_argument("--l1-bytes", default="16m", help="the daemon's L1 (small: eviction all the time)")
    sk.add_argument("--no-l2", action="store_true", help="no L2 disk tier (else one under the work directory)")
    sk.add_argument("--l3", action="store_true", help="an L3 tier on a redis-server the soak starts and kills")
    sk.add_argument("--fault-interval-s", type=float, default=2.0, help="mean seconds between injected faults")
    sk.add_argument("--daemon-faults", default="drop=0.002,delay=0.01,delay_s=0.3,stall=0.0005,stall_s=3",
                    help="replies the daemon drops / delays and CPU copies it stalls ($KVDEPOT_INJECT_FAULTS "
                         "format; '' = none)")
    sk.add_argument("--watchdog-s", type=float, default=1.0, help="the daemon's --watchdog-s (stalled copies)")
    sk.add_argument("--client-timeout-s", type=float, default=2.0, help="the engines' reply timeout")
    sk.add_argument("--hang-s", type=float, default=10.0, help="an engine without progress this long is a hang")
    sk.add_argument("--reclaim-limit-s", type=float, default=1.0,
                    help="an engine death reclaimed slower than this fails the run")
    sk.add_argument("--workdir", default=None, help="daemon logs, sockets and L2 (default: a new /tmp directory)")
    sk.add_argument("--json", default=None, help="also write the report as JSON here")
    sk.set_defaults(func=cmd_soak)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - CLI prints a one-line error
        import zmq

        from kvdepot.protocol.errors import KVDepotError

        # error replies, and misuse / environment errors whose messages name what to change
        # (a bad --endpoint, an endpoint already served, a socket directory that does not exist)
        if isinstance(exc, (KVDepotError, ValueError, OSError, zmq.ZMQError)):
            print(f"kvdepot {args.command}: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
