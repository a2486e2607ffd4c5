"""Processes the benchmark measures against: a bare ZMQ echo server (the round trip a request
cannot beat) and the daemon (`kvdepot serve` on an ipc endpoint in a temp dir)."""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

REPO = Path(__file__).resolve().parents[2]


FALLBACK_FLAG = "--allow-torch-fallback"


def kernels_missing() -> str | None:
    """Why the CUDA kernel library cannot be used here (e.g. a .so built from other source,
    as after any edit of kvdepot/gpu/csrc, comments included), or None if it loads. A GPU
    benchmark run on the torch fallback measures something else: callers refuse to run
    unless given `FALLBACK_FLAG`."""
    from kvdepot.gpu import kernels

    if kernels.load_kernels() is not None:
        return None
    return kernels.load_error() or "the kernel library did not load (see the log above)"


@contextlib.contextmanager
def reaped(procs, timeout_s: float = 60.0):
    """Around the work with ``procs`` (``multiprocessing.Process``): when it ends normally, wait
    up to ``timeout_s`` for each to end; in any case kill those still running (a failed or hung
    measurement must not leave them behind)."""
    try:
        yield
        for p in procs:
            p.join(timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """Per live thread of process ``pid``: tid -> (its name, CPU seconds so far). The name is
    "main" for the process's first thread (the daemon's event loop), else the thread's comm
    (the kernel library names its threads kvd-issue / kvd-watch). CPU time from
    ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds), else the thread's ``stat`` (clock ticks)."""
    out: dict[int, tuple[str, float]] = {}
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for t in tids:
        try:
            with open(f"{base}/{t}/comm") as f:
                name = "main" if int(t) == pid else f.read().strip()
            try:
                with open(f"{base}/{t}/schedstat") as f:
                    cpu = int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                with open(f"{base}/{t}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / tick
        except OSError:  # the thread ended meanwhile
            continue
        out[int(t)] = (name, cpu)
    return out


def busy_threads(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                 wall_s: float) -> dict[str, float]:
    """CPU cores per thread name between two `thread_cpu_s` snapshots over ``wall_s`` (threads
    of one name summed; threads that started or ended between them left out)."""
    out: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        if tid in before:
            out[name] = out.get(name, 0.0) + (cpu - before[tid][1]) / wall_s
    return out


def busy_text(threads: dict[str, float], floor: float = 0.05) -> str:
    """'main 0.35, kvd-issue 0.05': `busy_threads`' threads of at least ``floor`` cores, busiest first."""
    busy = sorted(((v, n) for n, v in threads.items() if v >= floor), reverse=True)
    return ", ".join(f"{n} {v:.2f}" for v, n in busy)

_ECHO_SERVER = r"""
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
s.setsockopt(zmq.LINGER, 0)
s.bind(sys.argv[1])
print("ready", flush=True)
while True:
    frames = s.recv_multipart()
    s.send_multipart(frames)
    if frames[-1] == b"stop":
        break
s.close(0)
ctx.term()
"""


def zmq_echo_rtt_us(iters: int = 2000, warmup: int = 200) -> dict:
    """Round trip of a 1-byte message to a ROUTER echo server in another process over ipc://,
    blocking DEALER socket: median / p10 / p90 in microseconds."""
    with tempfile.TemporaryDirectory(prefix="kvd-echo-") as d:
        ep = f"ipc://{d}/echo.sock"
        proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER, ep], stdout=subprocess.PIPE, text=True)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            line = proc.stdout.readline()
            if "ready" not in line:
                raise RuntimeError(f"zmq echo server did not start (rc {proc.poll()})")
            sock.connect(ep)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            ts = []
            for i in range(warmup + iters):
                t0 = time.perf_counter()
                sock.send(b"x")
                sock.recv()
                if i >= warmup:
                    ts.append(time.perf_counter() - t0)
            sock.send(b"stop")
            sock.recv()
        finally:
            sock.close(0)
            ctx.term()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
    q = statistics.quantiles(ts, n=10)
    return {"median_us": statistics.median(ts) * 1e6, "p10_us": q[0] * 1e6, "p90_us": q[-1] * 1e6, "iters": iters}


class DaemonProc:
    """``python -m kvdepot serve`` in a subprocess on an ipc endpoint in a temp dir.

    Logs at info level to ``log_path`` so that the end of L1 pinning ("L1 pinned") can be seen.
    """

    def __init__(self, l1_bytes: str, extra_args: list[str], log_path: str | None, pin: bool = True) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvd-bench-")
        self.endpoint = f"ipc://{self.dir}/kvdepot.sock"
        self.log_path = log_path or os.path.join(self.dir, "daemon.log")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        so = REPO / ".kbuild" / "libkvdepot_kernels.so"
        if "KVDEPOT_KERNELS_SO" not in env and so.exists():
            env["KVDEPOT_KERNELS_SO"] = str(so)
        self.kernels_so = env.get("KVDEPOT_KERNELS_SO", "")
        self.pin = pin and "--no-pin-l1" not in extra_args
        cmd = [sys.executable, "-m", "kvdepot", "serve", "--endpoint", self.endpoint, "--l1-bytes", l1_bytes,
               "--pin-l1" if pin else "--no-pin-l1", "--log-level", "info", *extra_args]
        self.cmd = cmd
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=str(REPO),
                                     env=env)
        self._ready = threading.Event()
        self._drainer = threading.Thread(target=self._drain, name="daemon-stdout", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        with self.proc.stdout:  # closed at the daemon's exit (EOF)
            for line in self.proc.stdout:
                if "kvdepot ready" in line:
                    self._ready.set()

    def log_tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "".join(Path(self.log_path).read_text(errors="replace").splitlines(True)[-n:])
        return ""

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon not ready after {timeout_s} s:\n{self.log_tail()}")

    def wait_pinned(self, max_s: float) -> tuple[bool, float]:
        """Wait until the daemon logs that L1 is pinned (or a pinning failure), at most ``max_s``."""
        t0 = time.monotonic()
        if not self.pin:
            return False, 0.0
        while time.monotonic() - t0 < max_s:
            text = Path(self.log_path).read_text(errors="replace")
            if "L1 pinned" in text:
                return True, time.monotonic() - t0
            if "cudaHostRegister of L1" in text:  # pinning stopped part way: the log says why
                return False, time.monotonic() - t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.25)
        return False, time.monotonic() - t0

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the daemon stops cleanly
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._drainer.join(5)
        self._log.close()
        return self.proc.returncode
