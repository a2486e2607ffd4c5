"""The soak orchestrator (`kvdepot soak`): a daemon, N engine processes (`kvdepot.soak.engine`)
and a fault injector driven by one seed, for ``duration_s``; then a report.

Faults, one every ``fault_interval_s`` on average (exponential gaps), picked by the seed:
``kill_engine`` (SIGKILL an engine mid-request; a new one takes its place; the time until the
daemon dropped its registration and pins is a reclaim time), ``kill_daemon`` (SIGKILL, restart
on the same endpoint and L2 directory), ``corrupt_l2`` (flip bytes of a random L2 object file),
``kill_redis`` (SIGKILL the L3 Redis, restart it 1-3 s later), ``shrink_segment`` (CPU: truncate
an engine's KV memory, which its memfd seal must refuse), ``freeze`` (SIGSTOP the daemon for 1-4
s, longer than the engines' timeouts, then SIGCONT). All along, the daemon drops and delays a
share of its replies and stalls a share of its CPU copies past its watchdog's deadline and the
engines' timeouts (late copies: a CPU engine reuses a lost store's blocks once its deadline
passed, `Store.deadline_ns`, so a late copy that committed what it read would be a corrupt byte
later; `kvdepot.server.faults`, `kvdepot.server.watchdog`), and an L1 much smaller than the
engines' working set keeps eviction busy.

Fails (exit status 1) on: a corrupt byte, a hang (an engine without a finished request for
``hang_s`` while the daemon was up), a daemon or engine that died by itself, a reclaim slower
than ``reclaim_limit_s``, or the daemon's anonymous memory beyond its start-up size + 110% of
L1 + its tier queues + 32 MiB of heap.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvdepot.soak.content import FAMILIES
from kvdepot.soak.engine import EngineSpec, engine_main


# beside L1 and the tier queues, the daemon's heap may grow this much (index entries of L1 and L2,
# connection buffers, allocator slack) before a run counts as leaking
_HEAP_ALLOWANCE_BYTES = 32 << 20
_PROGRESS_INTERVAL_S = 30.0  # between progress lines on stderr


@dataclasses.dataclass
class SoakConfig:
    """Settings of one soak run (``kvdepot soak --help`` names them the same)."""

    duration_s: float = 60.0
    engines: int = 4
    seed: int = 1
    device: str = "cpu"
    cpu_engines: int = 0  # device "cuda": this many of the engines keep their KV caches in shared memory
    l1_bytes: int = 16 << 20
    l2: bool = True
    l3: bool = False  # needs redis-server (or valkey-server) on PATH
    fault_interval_s: float = 2.0
    daemon_faults: str = "drop=0.002,delay=0.01,delay_s=0.3,stall=0.0005,stall_s=3"
    watchdog_s: float = 1.0
    client_timeout_s: float = 2.0
    hang_s: float = 10.0
    reclaim_limit_s: float = 1.0
    workdir: str = ""
    json_path: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_anon_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _Redis:
    def __init__(self, workdir: Path) -> None:
        self.exe = shutil.which("redis-server") or shutil.which("valkey-server")
        if self.exe is None:
            raise RuntimeError("--l3 needs redis-server or valkey-server on PATH")
        self.port = _free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class _Daemon:
    """``kvdepot serve`` as a subprocess; ``restart`` keeps its endpoint and L2 directory."""

    def __init__(self, cfg: SoakConfig, workdir: Path, l3_url: str) -> None:
        self.endpoint = f"ipc://{workdir}/kvdepot.sock"
        self.args = [sys.executable, "-m", "kvdepot", "serve", "--endpoint", self.endpoint,
                     "--l1-bytes", str(cfg.l1_bytes), "--pin-ttl-s", "30", "--watchdog-s", str(cfg.watchdog_s),
                     "--shutdown-drain-s", "10"]
        if cfg.device == "cpu":
            self.args.append("--no-pin-l1")
        if cfg.l2:
            self.args += ["--l2-path", str(workdir / "l2"), "--l2-bytes", str(8 * cfg.l1_bytes)]
        if l3_url:
            self.args += ["--l3-url", l3_url, "--l3-timeout-s", "0.5"]
        self.env = dict(os.environ, KVDEPOT_INJECT_FAULTS=f"{cfg.daemon_faults},seed={cfg.seed}")
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0
        self.up_since = 0.0
        self.base_rss_bytes = 0

    def start(self) -> None:
        self.incarnation += 1
        out = self.workdir / f"daemon-{self.incarnation}.out"
        with open(out, "wb") as o, open(self.workdir / f"daemon-{self.incarnation}.log", "wb") as e:
            self.proc = subprocess.Popen(self.args, stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=self.env)
        deadline = time.monotonic() + 60
        while "kvdepot ready on" not in out.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not start; see {self.workdir}/daemon-{self.incarnation}.log")
            time.sleep(0.02)
        self.up_since = time.monotonic()
        self.base_rss_bytes = _rss_anon_bytes(self.proc.pid)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        """SIGTERM; the exit status (None-like -1 if it had to be killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -1


_LOOK_GAP_S = 0.3  # the orchestrator looks every 0.1 s; a longer gap between looks is its own


@dataclasses.dataclass
class _PendingReclaim:
    """A killed engine's registration that the daemon has not reclaimed yet (times: monotonic s)."""

    registration: str
    killed_at: float
    incarnation: int  # of the daemon it was registered with
    frozen_then_s: float  # the orchestrator's frozen_s at the kill
    live_at: float  # send time of the latest look that saw it still registered
    live_frozen_s: float  # the orchestrator's frozen_s then


class Soak:
    """One run: ``Soak(cfg).run()`` returns the report (a dict; ``report["ok"]`` says pass)."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="kvd-soak-", dir="/tmp"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ctx = multiprocessing.get_context("spawn")
        self.reports = self.ctx.Queue(10_000)
        self.stop_event = self.ctx.Event()
        self.redis = _Redis(self.workdir) if cfg.l3 else None
        l3_url = f"redis://127.0.0.1:{self.redis.port}/0" if self.redis else ""
        self.daemon = _Daemon(cfg, self.workdir, l3_url)
        self.engines: dict[int, multiprocessing.Process] = {}
        self.last: dict[int, dict] = {}  # index -> latest report of the engine running now
        self.load_ring_engines: set[int] = set()  # engines that reported a ring for retrieves of their own
        self.totals = collections.Counter()  # counters of engines that ended
        self.ops_by_device = collections.Counter()  # their ops, by where the engine's KV caches were
        self.errors = collections.Counter()
        self.faults = collections.Counter()
        self.daemon_counts: dict[str, collections.Counter] = {}  # boot id -> injected faults, tier counters
        self.reclaim_s: list[float] = []
        self.pending_reclaims: list[_PendingReclaim] = []
        self.reclaims_seen_late = 0  # reclaims whose end fell in a gap of the orchestrator's looks
        self.frozen_s = 0.0  # total time the daemon spent SIGSTOPped by the freeze fault
        self.failures: list[str] = []
        self.rss: list[tuple[float, int]] = []  # (seconds since start, daemon RssAnon bytes)
        self.max_rss_over_base = 0
        self.spawned = 0
        self.redis_down_until = 0.0
        self._first_faults: list[str] | None = None  # kinds not injected yet (see _fault)

    # ------------------------------------------------------------------ processes

    def _spawn(self, index: int) -> None:
        fam = index % len(FAMILIES)
        self.spawned += 1
        spec = EngineSpec(index=index, endpoint=self.daemon.endpoint, family=fam,
                          layout=self.rng.choice(FAMILIES[fam].layouts), seed=self.cfg.seed * 1000 + self.spawned,
                          device=self._engine_device(index), timeout_s=self.cfg.client_timeout_s)
        p = self.ctx.Process(target=engine_main, args=(spec, self.reports, self.stop_event), daemon=True)
        p.start()
        self.engines[index] = p
        self.last.pop(index, None)

    def _engine_device(self, index: int) -> str:
        """Where engine ``index`` keeps its KV caches: with ``cpu_engines`` on a CUDA run, the
        first ones in shared memory (the daemon then serves both kinds at once)."""
        return "cpu" if self.cfg.device == "cpu" or index < self.cfg.cpu_engines else self.cfg.device

    def _retire(self, index: int) -> None:
        """Fold an ended engine's counters into the totals; unlink its leaked shm segment."""
        rep = self.last.pop(index, None)
        if rep is None:
            return
        self.totals.update(rep["counts"])
        self.ops_by_device[self._engine_device(index)] += _ops(rep["counts"])
        self.errors.update(rep["errors"])

    def _drain_reports(self) -> None:
        while True:
            try:
                rep = self.reports.get_nowait()
            except Exception:  # noqa: BLE001 - queue.Empty, or a half-written report of a killed engine
                return
            p = self.engines.get(rep["index"])
            if p is not None and p.pid == rep["pid"]:
                self.last[rep["index"]] = rep
                if rep.get("load_ring"):
                    self.load_ring_engines.add(rep["index"])

    # ------------------------------------------------------------------ faults

    def _fault(self) -> None:
        """Inject one fault: the first ones go through every kind once (in a seeded order, so
        a run of a few faults covers them all), later ones are drawn by weight."""
        kinds = ["kill_engine"] * 4 + ["kill_daemon", "freeze"]
        if self.cfg.device == "cpu" or self.cfg.cpu_engines:
            kinds += ["shrink_segment"] * 2
        if self.cfg.l2:
            kinds += ["corrupt_l2"] * 2
        if self.redis is not None:
            kinds += ["kill_redis"]
        if self._first_faults is None:
            self._first_faults = sorted(set(kinds))
            self.rng.shuffle(self._first_faults)
        kind = self._first_faults.pop() if self._first_faults else self.rng.choice(kinds)
        if kind == "kill_redis" and time.monotonic() < self.redis_down_until:
            kind = "kill_engine"  # still down from the last one
        if self._inject(kind):
            self.faults[kind] += 1

    def _inject(self, kind: str) -> bool:
        """Inject one fault of ``kind``; False if there was nothing to inject it into."""
        if kind == "kill_engine":
            ready = [i for i, rep in self.last.items() if rep.get("registration")]
            if not ready:
                return False
            i = self.rng.choice(ready)
            rep = self.last[i]
            os.kill(self.engines[i].pid, signal.SIGKILL)
            self.engines[i].join(10)
            now = time.monotonic()
            self.pending_reclaims.append(_PendingReclaim(rep["registration"], now, self.daemon.incarnation,
                                                         self.frozen_s, now, self.frozen_s))
            self._retire(i)
            self._spawn(i)
        elif kind == "kill_daemon":
            self.daemon.kill()
            self.pending_reclaims.clear()  # the registrations went with it
            time.sleep(self.rng.uniform(0.0, 0.5))
            self.daemon.start()
        elif kind == "shrink_segment":
            # an engine (or anyone of its uid) truncating its KV memory while the daemon copies
            # from it: the memfd's seal must refuse it (else the daemon's next copy would fault)
            ready = [rep for rep in self.last.values() if rep.get("registration") and rep.get("memfd") is not None]
            if not ready:
                return False
            rep = self.rng.choice(ready)
            try:
                fd = os.open(f"/proc/{rep['pid']}/fd/{rep['memfd']}", os.O_RDWR)
            except OSError:
                return False  # the engine just died
            try:
                os.ftruncate(fd, rep["memfd_bytes"] // 2)
                self.failures.append(f"engine {rep['index']}'s KV memory could be shrunk (not sealed)")
            except PermissionError:
                pass
            finally:
                os.close(fd)
        elif kind == "corrupt_l2":
            files = list((self.workdir / "l2" / "objects").rglob("*.kvd"))
            if not files:
                return False
            path = self.rng.choice(files)
            try:
                with open(path, "r+b") as f:
                    size = f.seek(0, os.SEEK_END)
                    f.seek(self.rng.randrange(max(1, size)))
                    f.write(os.urandom(8))
            except OSError:
                return False  # evicted meanwhile
        elif kind == "freeze":
            # the daemon stuck (in the kernel, swapped out, paused): engines time out, never hang
            self.daemon.proc.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            time.sleep(self.rng.uniform(1.0, 4.0))
            self.daemon.proc.send_signal(signal.SIGCONT)
            self.frozen_s += time.monotonic() - stopped_at
            self.daemon.up_since = time.monotonic()
        elif kind == "kill_redis":
            self.redis.kill()
            self.redis_down_until = time.monotonic() + self.rng.uniform(1.0, 3.0)
        return True

    # ------------------------------------------------------------------ watching

    def _watch(self, client, now: float) -> None:
        """Reclaims, the daemon's memory and injected faults, hangs, processes that died."""
        from kvdepot.protocol.errors import KVDepotError

        d = self.daemon
        if d.proc.poll() is not None:
            self.failures.append(f"the daemon exited by itself (status {d.proc.returncode}); "
                                 f"see {self.workdir}/daemon-{d.incarnation}.log")
            d.start()
            return
        for i, p in list(self.engines.items()):
            if not p.is_alive():
                self.failures.append(f"engine {i} exited by itself (status {p.exitcode})")
                self._retire(i)
                self._spawn(i)
        asked_at = time.monotonic()  # the daemon's state is read no earlier than this
        try:
            info = client.describe()
        except KVDepotError:
            return  # e.g. an injected dropped reply: the next look (0.1 s on) asks again
        live = {e.registration for e in info.engines}
        for item in list(self.pending_reclaims):
            if item.incarnation != d.incarnation:
                self.pending_reclaims.remove(item)
            elif item.registration in live:
                item.live_at, item.live_frozen_s = asked_at, self.frozen_s
            else:
                self.reclaim_s.append(self._reclaim_time_s(item, asked_at))
                self.pending_reclaims.remove(item)
        seen = collections.Counter(info.injected_faults)
        for tier in info.tiers:
            seen.update({f"{tier.name}_hit_chunks": tier.hit_chunks, f"{tier.name}_corrupt_objects": tier.corrupt_objects,
                         f"{tier.name}_errors": tier.errors, f"{tier.name}_dropped_writes": tier.dropped_writes})
        self.daemon_counts[info.boot_id] = seen  # counters since that daemon's start: the last look wins
        rss = _rss_anon_bytes(d.proc.pid)
        self.rss.append((now - self.t0, rss))
        self.max_rss_over_base = max(self.max_rss_over_base, rss - d.base_rss_bytes)
        if now - d.up_since > self.cfg.hang_s:
            for i, rep in self.last.items():
                if rep.get("registration") and time.time() - rep["last_progress"] > self.cfg.hang_s:
                    msg = f"engine {i} made no progress for {self.cfg.hang_s:g} s while the daemon was up"
                    if msg not in self.failures:
                        self.failures.append(msg)

    def _reclaim_time_s(self, item: _PendingReclaim, gone_at: float) -> float:
        """How long the daemon took to reclaim ``item``'s registration, from the engine's kill to
        the send time of the first look that saw it gone (``gone_at``), less the time the daemon
        was frozen meanwhile (it cannot reclaim while stopped). A reply a few ms late changes
        nothing: the send time is the bound. If a look failed or came late (an injected dropped
        or delayed reply of the orchestrator's own, a fault injected meanwhile), the reclaim
        ended somewhere in that gap; only the part before the gap is known, and that is what
        counts (``reclaims_seen_late``)."""
        if gone_at - item.live_at > _LOOK_GAP_S:
            self.reclaims_seen_late += 1
            return max(0.0, item.live_at - item.killed_at - (item.live_frozen_s - item.frozen_then_s))
        return max(0.0, gone_at - item.killed_at - (self.frozen_s - item.frozen_then_s))

    # ------------------------------------------------------------------ run

    def run(self) -> dict:
        from kvdepot.client import KVDepotClient

        cfg = self.cfg
        if self.redis is not None:
            self.redis.start()
        self.daemon.start()
        self.t0 = time.monotonic()
        for i in range(cfg.engines):
            self._spawn(i)
        # a short timeout: the injector drops some of the orchestrator's replies too
        client = KVDepotClient(self.daemon.endpoint, timeout_s=0.5, name="soak-orchestrator", connect=False)
        try:
            # the clock starts once every engine registered (spawned interpreters import torch)
            deadline = time.monotonic() + 120
            while len([r for r in self.last.values() if r.get("registration")]) < cfg.engines:
                if time.monotonic() > deadline:
                    raise RuntimeError("engines did not register within 120 s")
                self._drain_reports()
                time.sleep(0.05)
            self.t0 = start = time.monotonic()
            next_fault = start + self.rng.expovariate(1 / cfg.fault_interval_s)
            next_watch = start
            next_progress = start + _PROGRESS_INTERVAL_S
            while (now := time.monotonic()) < start + cfg.duration_s:
                self._drain_reports()
                if self.redis is not None and self.redis.proc.poll() is not None and now > self.redis_down_until:
                    self.redis.start()
                if now >= next_fault:
                    self._fault()
                    next_fault = time.monotonic() + self.rng.expovariate(1 / cfg.fault_interval_s)
                if now >= next_watch:
                    self._watch(client, now)
                    next_watch = now + 0.1
                if now >= next_progress:
                    self._progress(now - start)
                    next_progress = now + _PROGRESS_INTERVAL_S
                time.sleep(0.01)
            elapsed_s = time.monotonic() - start
            self.stop_event.set()
            # drain the reports while the engines exit: an engine's process waits at exit until
            # its queued reports are in the pipe, so joining first (the pipe full of 14 engines'
            # final reports) held every engine until its join timed out
            stop_deadline = time.monotonic() + 30
            while any(p.is_alive() for p in self.engines.values()) and time.monotonic() < stop_deadline:
                self._drain_reports()
                time.sleep(0.02)
            for p in self.engines.values():
                if p.is_alive():
                    self.failures.append(f"engine pid {p.pid} did not stop within 30 s (hung)")
                    p.kill()
            self._drain_reports()
            for i in list(self.last):
                self._retire(i)
        finally:
            self.stop_event.set()
            for p in self.engines.values():
                if p.is_alive():
                    p.kill()
            client.close()
            status = self.daemon.stop()
            if self.redis is not None:
                self.redis.kill()
        if status != 0:
            self.failures.append(f"the daemon exited with status {status} on SIGTERM")
        return self._report(elapsed_s)

    def _progress(self, elapsed_s: float) -> None:
        """One line on stderr so far: a long run shows its rate and health while it runs."""
        t = collections.Counter(self.totals)
        for rep in self.last.values():
            t.update(rep["counts"])
        ops = _ops(t)
        print(f"soak {elapsed_s:.0f} s: {ops} ops ({ops / max(elapsed_s, 1e-9):.0f}/s), "
              f"{t['verified_bytes'] >> 20} MiB verified, corrupt bytes {t['corrupt_bytes']}, "
              f"faults {sum(self.faults.values())}, failures {len(self.failures)}", file=sys.stderr, flush=True)

    def _report(self, elapsed_s: float) -> dict:
        cfg, t = self.cfg, self.totals
        daemon = collections.Counter()
        for c in self.daemon_counts.values():
            daemon.update(c)
        if t["corrupt_bytes"]:
            self.failures.append(f"{t['corrupt_bytes']} corrupt bytes in {t['corrupt_checks']} checked retrieves "
                                 "or whole-cache checks")
        slow = [s for s in self.reclaim_s if s > cfg.reclaim_limit_s]
        if slow:
            self.failures.append(f"{len(slow)} engine deaths reclaimed slower than {cfg.reclaim_limit_s:g} s "
                                 f"(max {max(slow):.2f} s)")
        # the L2 / L3 write queues hold up to l1_bytes / 8 each (their defaults, kvdepot.config)
        queues = (cfg.l2 + cfg.l3) * (cfg.l1_bytes // 8)
        rss_limit = int(1.1 * cfg.l1_bytes) + queues + _HEAP_ALLOWANCE_BYTES
        if self.max_rss_over_base > rss_limit:
            self.failures.append(f"daemon memory grew {self.max_rss_over_base >> 20} MiB over its start "
                                 f"(limit {rss_limit >> 20} MiB: 110% of L1 + tier queues)")
        ops = _ops(t)
        faults = dict(self.faults)
        faults.update({k: daemon[k] for k in ("dropped_replies", "delayed_replies", "stalled_copies")})
        tiers = {k: v for k, v in sorted(daemon.items()) if k.startswith(("l1_", "l2_", "l3_"))}
        rs = sorted(self.reclaim_s)
        return {
            "ok": not self.failures, "failures": self.failures, "seed": cfg.seed, "duration_s": round(elapsed_s, 1),
            "engines": cfg.engines, "device": cfg.device,
            "cpu_engines": cfg.engines if cfg.device == "cpu" else min(cfg.cpu_engines, cfg.engines), "l1_bytes": cfg.l1_bytes, "l2": cfg.l2, "l3": cfg.l3,
            "ops": ops, "ops_per_s": round(ops / elapsed_s, 1), "ops_by_device": dict(self.ops_by_device),
            # CUDA engine slots whose retrieves had a staging ring of their own (every other one)
            "engines_with_load_ring": len(self.load_ring_engines),
            "requests": t["requests"],
            "lookup_hit_chunks": t["lookup_hit_chunks"], "retrieved_chunks": t["retrieved_chunks"],
            "stored_chunks": t["stored_chunks"], "short_retrieves": t["short_retrieves"],
            "verified_bytes": t["verified_bytes"], "cache_checks": t["cache_checks"],
            "corrupt_bytes": t["corrupt_bytes"], "wrong_hits": t["corrupt_checks"],
            "quarantined_blocks": t["quarantined_blocks"], "registrations": t["registrations"],
            "blocks_reused_after_deadline": t["blocks_reused_after_deadline"],
            "errors": dict(self.errors), "faults": faults, "faults_total": sum(faults.values()),
            "daemon_starts": self.daemon.incarnation, "tiers": tiers,
            "reclaims": len(rs), "reclaim_p50_s": round(statistics.median(rs), 3) if rs else None,
            "reclaim_max_s": round(rs[-1], 3) if rs else None, "reclaims_seen_late": self.reclaims_seen_late,
            "daemon_rss_anon_over_start_max_bytes": self.max_rss_over_base, "daemon_rss_limit_bytes": rss_limit,
            "daemon_rss_anon_bytes": [(round(s, 1), b) for s, b in self.rss[::10]],
            "workdir": str(self.workdir),
        }


def _ops(counts) -> int:
    """Requests an engine sent: lookups, retrieves, stores, flushes and one EndRequest per request."""
    return sum(counts.get(k, 0) for k in ("lookups", "retrieves", "stores", "flushes", "requests"))


def _by_device(r: dict) -> str:
    by = r.get("ops_by_device") or {}
    return "; " + ", ".join(f"{n} by {d} engines" for d, n in sorted(by.items())) if len(by) > 1 else ""


def _engine_kinds(r: dict) -> str:
    cpu = r.get("cpu_engines", 0)
    rings = r.get("engines_with_load_ring", 0)
    of_them = f" ({rings} with a ring for retrieves)" if rings else ""
    if r["device"] == "cpu" or not cpu:
        return r["device"] + of_them
    return f"{r['engines'] - cpu} {r['device']}{of_them}, {cpu} cpu"


def format_report(r: dict) -> str:
    """The report as a person reads it."""
    mib = 1 << 20
    lines = [
        f"kvdepot soak: {'PASS' if r['ok'] else 'FAIL'}  seed {r['seed']}, {r['engines']} engines ({_engine_kinds(r)}), "
        f"{r['duration_s']} s, L1 {r['l1_bytes'] // mib} MiB, L2 {'on' if r['l2'] else 'off'}, "
        f"L3 {'on' if r['l3'] else 'off'}",
        f"  ops {r['ops']} ({r['ops_per_s']}/s{_by_device(r)}); requests {r['requests']}, chunks hit {r['lookup_hit_chunks']} / "
        f"retrieved {r['retrieved_chunks']} / stored {r['stored_chunks']}, short retrieves {r['short_retrieves']}",
        f"  verified {r['verified_bytes'] / mib:.1f} MiB ({r['cache_checks']} whole-cache checks): corrupt bytes "
        f"{r['corrupt_bytes']}, wrong hits {r['wrong_hits']}; blocks quarantined after lost copies "
        f"{r['quarantined_blocks']} (reused once a lost store's deadline passed: {r.get('blocks_reused_after_deadline', 0)})",
        f"  faults {r['faults_total']}: " + ", ".join(f"{k} {v}" for k, v in sorted(r["faults"].items())),
        "  tiers: " + (", ".join(f"{k} {v}" for k, v in r["tiers"].items() if v) or "nothing counted"),
        "  errors by code: " + (", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "none"),
        f"  daemon starts {r['daemon_starts']}; engine deaths reclaimed {r['reclaims']} "
        f"(p50 {r['reclaim_p50_s']} s, max {r['reclaim_max_s']} s; {r.get('reclaims_seen_late', 0)} seen after a gap "
        "in the orchestrator's looks, timed to the last look that saw them live)",
        f"  daemon anonymous memory over its start: max {r['daemon_rss_anon_over_start_max_bytes'] / mib:.0f} MiB "
        f"(limit {r['daemon_rss_limit_bytes'] / mib:.0f}); over time (s, MiB): "
        + " ".join(f"{s:g}:{b / mib:.0f}" for s, b in r["daemon_rss_anon_bytes"][:40]),
    ]
    lines += [f"  FAILURE: {f}" for f in r["failures"]]
    if r["failures"] and r["workdir"]:
        lines.append(f"  daemon logs and L2 files: {r['workdir']}")
    return "\n".join(lines)


def main(cfg: SoakConfig) -> int:
    """Run, print the report (and write it as JSON to ``cfg.json_path``); 0 if it passed."""
    report = Soak(cfg).run()
    if report["ok"] and not cfg.workdir:  # a directory of its own: kept only to read a failure's logs
        shutil.rmtree(report["workdir"], ignore_errors=True)
        report["workdir"] = ""
    print(format_report(report), flush=True)
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1
