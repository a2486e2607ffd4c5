"""Timers of `vllm_connector.py` (the vLLM connector benchmark): `CallTimer` around the
connector's methods, `LayerProbe` for the per-layer calls' share of the timer's cost,
`StageTimers` (``--stages``: the worker's internal calls) and `Timeline` (``--timeline``: when
the worker's transfers were sent and answered, and the engine's steps ran)."""

from __future__ import annotations

import collections
import gc
import statistics
import threading
import time

from kvdepot.client.vllm import commands as cmds


def pct(xs, q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank, from below); NaN if empty."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class LayerProbe:
    """A method that does nothing, wrapped by a `CallTimer` and called once per layer beside
    the connector's per-layer calls: what the timer costs per call there (interleaved with the
    forward's tensor work it costs more than in `CallTimer.overhead_s`'s tight loop), taken off
    the per-layer calls' figures (``has_connector_metadata``, ``wait_for_layer_load``,
    ``save_kv_layer``)."""

    _one = None

    @classmethod
    def get(cls) -> LayerProbe:
        if cls._one is None:
            cls._one = cls()
            cls._one.timer = CallTimer(cls._one, ["noop"])
        return cls._one

    def noop(self) -> None:
        return None

    def take_per_call_s(self) -> float | None:
        """Seconds per probe call since the last take (beyond `CallTimer.overhead_s`, which
        every figure has taken off already); None if no forward ran."""
        calls = self.timer.calls.get("noop", 0)
        spent = self.timer.take().get("noop", 0.0)
        return spent / calls if calls else None


PER_LAYER_CALLS = ("has_connector_metadata", "wait_for_layer_load", "save_kv_layer")


class GcClock:
    """Seconds of Python's garbage collections per thread (``gc.callbacks``; installed on first
    use): a collection runs on the thread whose allocation triggered it, inside whatever call
    that was, so `CallTimer` takes the calling thread's collections out of a call's figures
    and reports them apart (`CallTimer.gc_s`). What triggers one is the whole process's count
    of allocations (vLLM's mostly); what it costs is the number of objects it scans."""

    by_thread: dict[int, float] = {}
    count = 0  # collections on any thread
    total_s = 0.0  # their seconds
    _start: dict[int, float] = {}
    _installed = False

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            gc.callbacks.append(cls._cb)
            cls._installed = True

    @classmethod
    def _cb(cls, phase: str, info: dict) -> None:
        t = threading.get_ident()
        if phase == "start":
            cls._start[t] = time.perf_counter()
        else:
            spent = time.perf_counter() - cls._start.pop(t, time.perf_counter())
            cls.by_thread[t] = cls.by_thread.get(t, 0.0) + spent
            cls.count += 1
            cls.total_s += spent


class GcMeter:
    """Python's garbage collections on any thread (`GcClock`'s totals): ``take()`` returns
    (collections, seconds in them) since the last call. A collection runs inside whatever call
    allocated the object that triggered it, so a connector method's time may hold one that the
    connector's objects did not cause alone."""

    def __init__(self) -> None:
        GcClock.install()
        self._seen = (GcClock.count, GcClock.total_s)

    def take(self) -> tuple[int, float]:
        now = (GcClock.count, GcClock.total_s)
        out = (now[0] - self._seen[0], now[1] - self._seen[1])
        self._seen = now
        return out


def less_probe(work: dict[str, float], calls: dict[str, int]) -> dict[str, float]:
    """``work`` (a worker `CallTimer.take`) less the probe's in-place timer cost per
    per-layer call (``calls``: the timer's call counts before the take)."""
    per = LayerProbe.get().take_per_call_s()
    if not per:
        return work
    LayerProbe.in_situ_us.append(1e6 * per)
    return {n: max(0.0, v - per * calls.get(n, 0)) if n in PER_LAYER_CALLS else v for n, v in work.items()}


LayerProbe.in_situ_us = []  # per step: the probe's cost per call beyond the tight-loop figure


class Timeline:
    """``--timeline``: when the worker's stores / retrieves were sent and answered, and when the
    engine's steps ran, during one `drive`; `take` splits the wall time into the lead-in (first
    step until the first transfer is sent), the time with at least one transfer at the daemon
    (sent, not answered: the link can be busy), the time with none between the first send and
    the last answer (the link idles because of the client), and the tail (last answer until
    vLLM freed every request). ``busy_gbps``: the bytes / the time with one or more at the daemon."""

    enabled = False

    def __init__(self, engine, t0: float) -> None:
        self.t0, self.sent, self.answered, self.steps = t0, {}, {}, []
        if not self.enabled:
            return
        worker = engine.worker_conn
        client, mover = worker.client, worker.mover
        submit, on_reply, post, quiet = client.conn.submit, client.conn._on_reply, mover.post, worker._post_quiet
        self._undo = (client, submit, on_reply, mover, post)
        self._worker, self._quiet = worker, quiet
        self.posted = []  # (perf_counter, is a load or save) of each command the engine thread posted

        def timed_post(cmd):
            self.posted.append((time.perf_counter(), isinstance(cmd, (cmds.Load, cmds.Save))))
            return post(cmd)

        def timed_quiet(cmd):  # the worker's saves and releases (`TransferThread.post_quiet`)
            self.posted.append((time.perf_counter(), isinstance(cmd, (cmds.Load, cmds.Save))))
            return quiet(cmd)

        def timed_submit(req):
            rid = submit(req)
            if type(req).__name__ in ("Store", "Retrieve"):
                self.sent[rid] = (time.perf_counter(), len(req.keys))
            return rid

        def timed_reply(got):
            self.answered.setdefault(got.rid, time.perf_counter())
            return on_reply(got)

        handle = mover._handle
        self.handled = []  # perf_counter of each command the transfer thread took, in order

        def timed_handle(cmd):
            self.handled.append(time.perf_counter())
            return handle(cmd)

        self._undo = (*self._undo, handle)
        self.reported = []  # perf_counter of each result taken that handed the engine finished requests
        # the worker takes the transfer thread's results from its outbox itself: a deque that
        # notes the time of each such take, put in once (at a drive's start, when nothing is in
        # flight to publish) and kept; it notes only while a timeline runs
        box = mover.outbox
        if not isinstance(box, _NotingOutbox):
            old, box = box, _NotingOutbox(())
            mover.outbox = worker._outbox = box
            while old:
                box.append(old.popleft())
        box.noted = self.reported
        self._box = box

        client.conn.submit, client.conn._on_reply, mover.post, worker._post_quiet = timed_submit, timed_reply, timed_post, timed_quiet
        mover._handle = timed_handle

    def step(self, start_s: float, end_s: float, forward: bool) -> None:
        if self.enabled:
            self.steps.append((start_s, end_s, forward))

    def take(self, end_s: float, chunk_bytes: int) -> dict | None:
        if not self.enabled:
            return None
        client, submit, on_reply, mover, post, handle = self._undo
        client.conn.submit, client.conn._on_reply, mover.post, mover._handle = submit, on_reply, post, handle
        self._worker._post_quiet, self._box.noted = self._quiet, None
        # each posted command until the thread took it (one queue, taken in order; the engine
        # posts every command through `post` but a preemption's)
        pickup = sorted(1e6 * (h - p) for (p, _), h in zip(self.posted, self.handled))
        spans = sorted((t, self.answered.get(rid, end_s), n) for rid, (t, n) in self.sent.items())
        if not spans:
            return None
        busy_s, reach = 0.0, spans[0][0]
        for a, b, _ in spans:  # the union of the [sent, answered] spans
            if b > reach:
                busy_s += b - max(a, reach)
                reach = b
        first, last = spans[0][0], max(b for _, b, _ in spans)
        reported = max([t for t in self.reported if t >= last] or [last])
        # the lead-in: steps before the one whose command led to the first send, that step until
        # it posted the command, the transfer thread until it sent
        post_s = max((t for t, moves in self.posted if moves and t <= first), default=first)
        step_s = max((a for a, _, _ in self.steps if a <= post_s), default=self.t0)
        depth = [sum(1 for a, b, _ in spans if a <= t < b) for t, _, _ in spans]
        return {"lead_in_ms": 1e3 * (first - self.t0), "lead_in_steps_before_ms": 1e3 * (step_s - self.t0),
                "lead_in_step_to_post_ms": 1e3 * (post_s - step_s), "lead_in_post_to_send_ms": 1e3 * (first - post_s),
                "busy_ms": 1e3 * busy_s,
                "client_idle_ms": 1e3 * (last - first - busy_s), "tail_ms": 1e3 * (end_s - last),
                # the tail: the last answer until the worker handed the engine its last finished
                # request (a load's scatter queued, the results published, the next get_finished),
                # then vLLM's own steps until it freed every request (the last forward, the finish)
                "tail_to_reported_ms": 1e3 * (reported - last), "tail_after_reported_ms": 1e3 * (end_s - reported),
                "busy_gbps": sum(n for *_, n in spans) * chunk_bytes / busy_s / 1e9 if busy_s else None,
                "requests": len(spans), "depth_at_send_median": statistics.median(depth),
                "post_to_take_us_median": statistics.median(pickup) if pickup else None,
                "post_to_take_us_p99": pickup[min(len(pickup) - 1, int(0.99 * len(pickup)))] if pickup else None,
                "post_to_take_us_max": pickup[-1] if pickup else None,
                "forward_steps_ms": 1e3 * sum(e - s for s, e, f in self.steps if f),
                "idle_steps": sum(1 for *_, f in self.steps if not f)}


class _NotingOutbox(collections.deque):
    """The transfer thread's outbox (`TransferThread.outbox`) for `Timeline`: notes in
    ``noted`` (a list, or None: nothing) the time of each result taken that ends requests."""

    def __init__(self, items) -> None:
        super().__init__(items)
        self.noted: list[float] | None = None

    def popleft(self):
        got = super().popleft()
        noted = self.noted
        if noted is not None and (got.sending or got.recving):
            noted.append(time.perf_counter())
        return got


class CallTimer:
    """Wraps the named methods of a connector instance; ``take()`` returns and resets the
    seconds spent inside each since the last call, less the part of the timer's own cost that
    falls inside the timed window (`overhead_s`: the clock read's return and the forwarding of
    the arguments, measured once per process around a method that does nothing). The rest of
    the wrapper's cost (the thread-CPU clock, the bookkeeping: `wrapper_s`) lies outside the
    window and is not in any figure.
    It also keeps the calling thread's CPU seconds inside each (``time.thread_time``, which
    takes no lock and does not let another thread run): ``take()`` leaves them in ``cpu_s``. A
    call's wall time beyond its CPU time is time it waited: for the GIL, which another thread of
    the process (the worker's transfer thread) held, or in a blocking call. ``cpu_clock =
    False`` (``--no-cpu-clock``) leaves that clock out (a system call before and after every
    wrapped call); ``cpu_s`` then equals the wall figures. Garbage collections the calling
    thread ran inside a call (`GcClock`) are taken out of both and kept apart: ``take()``
    leaves them in ``gc_s``.
    """

    _overhead_s: float | None = None
    _wrapper_s: float | None = None
    cpu_clock = True  # also read the thread's CPU clock around each call (`cpu_s`)

    def __init__(self, obj, names) -> None:
        GcClock.install()
        self.spent_s: dict[str, float] = {}
        self.cpu_s: dict[str, float] = {}  # after take(): the taken calls' CPU seconds
        self._cpu_s: dict[str, float] = {}
        self.gc_s: dict[str, float] = {}  # after take(): the taken calls' garbage collections
        self._gc_s: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        for name in names:
            if hasattr(obj, name):
                fn = getattr(obj, name)
                # a method an earlier timer wrapped is wrapped afresh, not once more: nested
                # wrappers would count the inner one's cost as the connector's
                setattr(obj, name, self._wrap(name, getattr(fn, "timed_fn", fn)))

    def _wrap(self, name, fn):
        clock, ident, gcs = time.perf_counter, threading.get_ident, GcClock.by_thread
        cpu_clock = time.thread_time if self.cpu_clock else None

        def timed(*a, **kw):
            me = ident()
            g0 = gcs.get(me, 0.0)
            c0 = cpu_clock() if cpu_clock is not None else 0.0
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                t1 = clock()
                g = gcs.get(me, 0.0) - g0
                c = cpu_clock() - c0 if cpu_clock is not None else t1 - t0
                self._cpu_s[name] = self._cpu_s.get(name, 0.0) + c - g
                self.spent_s[name] = self.spent_s.get(name, 0.0) + t1 - t0 - g
                if g:
                    self._gc_s[name] = self._gc_s.get(name, 0.0) + g
                self.calls[name] = self.calls.get(name, 0) + 1
        timed.timed_fn = fn
        return timed

    @classmethod
    def overhead_s(cls) -> float:
        """What the wrapper adds inside its own timed window per call: the least of 5 rounds
        of 20000 calls of a method that returns at once, its timed seconds per call less a
        bare call's (the clock read's return, the arguments' forwarding). Taken off every
        call's figure."""
        if cls._overhead_s is None:
            cls._measure()
        return cls._overhead_s

    @classmethod
    def wrapper_s(cls) -> float:
        """What the whole wrapper adds to one call (measured with `overhead_s`): what a
        connector call timed inside another timed call (vLLM's ``schedule``) adds to the
        outer one's figure."""
        if cls._wrapper_s is None:
            cls._measure()
        return cls._wrapper_s

    @classmethod
    def _measure(cls) -> None:
        class Nothing:
            def noop(self, *a):
                return None

        bare, wrapped = Nothing(), Nothing()
        timer = cls(wrapped, ["noop"])  # wraps wrapped.noop
        inside, whole = [], []
        n = 20000
        for _ in range(5):
            timer.spent_s.clear()
            t0 = time.perf_counter()
            for _ in range(n):
                bare.noop(1)
            t1 = time.perf_counter()
            for _ in range(n):
                wrapped.noop(1)
            t2 = time.perf_counter()
            bare_s = (t1 - t0) / n
            whole.append((t2 - t1) / n - bare_s)
            inside.append(timer.spent_s["noop"] / n - bare_s)
        # the least round: a fixed cost is best read where the machine's other work added the
        # least to it (a load that slowed the wrapped loop alone would make it too large and take
        # off more than the window's own cost)
        cls._overhead_s = max(0.0, min(inside))
        cls._wrapper_s = max(0.0, statistics.median(whole))

    def take(self) -> dict[str, float]:
        per = self.overhead_s()
        s = {n: max(0.0, v - per * self.calls.get(n, 0)) for n, v in self.spent_s.items()}
        # the CPU figures keep the timer's own CPU (a fraction of a microsecond per call): a
        # call's wait is max(0, wall - CPU), never negative because of it
        self.cpu_s = {n: min(v, s.get(n, 0.0)) for n, v in self._cpu_s.items()}
        self.gc_s = self._gc_s
        self.spent_s, self._cpu_s, self._gc_s, self.calls = {}, {}, {}, {}
        return s


STAGE_CALLS = {  # --stages: the parts of the worker's transfer path, timed per call
    "mover": ("_keys", "_block_ids", "_pump", "_collect", "_publish", "_handle", "post", "merge_rest", "stage_saves",
              "_store_pieces", "_stage_pieces", "_send_staged"),
    "worker": ("_engine_event", "_current_stream", "_stream_now", "_take_release", "_post_quiet"),
    "scheduler": ("_state", "_lookup_answer", "_load_job", "_store_job", "_blocks_of", "_send"),
    "scheduler_client": ("poll", "wait", "done", "submit"),
    "client": ("submit_store", "submit_retrieve", "submit", "poll", "_fence", "wait", "stage_store",
               "stage_store_pieces"),
    "staging": ("gather", "gather_pieces", "scatter", "flat_ids"),
    "ring": ("alloc", "alloc_pieces"),
    "fence": ("signal",),
    "pending": ("done", "result"),
}


class StageTimers:
    """--stages: `CallTimer` around the worker's internal calls (`STAGE_CALLS`), for the figures
    of one `drive`. Nested inside the connector's methods, each adds its own timer's cost to
    the per-step figures (about a microsecond per call): those are not comparable with a run
    without ``--stages``."""

    enabled = False

    def __init__(self, engine) -> None:
        self.timers = []
        if not self.enabled:
            return
        w = engine.worker_conn
        sched = engine.sched_conn
        objs = {"mover": w.mover, "client": w.client, "worker": w, "scheduler": sched,
                "scheduler_client": sched.client}
        if w.registrar.kvreg is not None and w.registrar.kvreg.staging is not None:
            objs["staging"], objs["ring"] = w.registrar.kvreg.staging, w.registrar.kvreg.staging.ring
            if w.registrar.kvreg.staging.fence is not None:
                objs["fence"] = w.registrar.kvreg.staging.fence
        for kind, obj in objs.items():
            self.timers.append((kind, CallTimer(obj, STAGE_CALLS[kind])))
        import kvdepot.client.pending as pending_mod

        # handles are made per request: time their methods on the classes
        for cls in (pending_mod.PendingStore, pending_mod.PendingRetrieve):
            self.timers.append((cls.__name__, CallTimer(cls, STAGE_CALLS["pending"])))

    def take(self) -> dict[str, dict]:
        out = {}
        for kind, t in self.timers:
            calls = dict(t.calls)
            for name, spent in t.take().items():
                out[f"{kind}.{name}"] = {"calls": calls[name], "us_per_call": 1e6 * spent / calls[name]}
        return out
