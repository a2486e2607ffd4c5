"""The worker's transfer thread: every store and load of a vLLM worker runs here, off the
engine's step. `kvdepot.client.vllm.worker.WorkerConnector` (the engine thread's side) only posts
commands and takes results; this thread owns the `KVDepotClient`, the staging ring and every
piece in flight.

Ordering with the engine's CUDA stream (the thread gathers and scatters on a stream of its own,
the *side stream*; loads' scatters on a stream of their own were measured no faster, twice):

* a store's gather waits (GPU-side) on an event this thread records on the engine's stream
  when it takes the step's save, after the forward that wrote the blocks (``wait_for_save``
  posts it); the blocks stay the request's until its store ended (vLLM's
  ``delay_free_blocks``), so the gather may run any time later, after later forwards too.
  Models with a sliding-window group (vLLM frees blocks that leave the window while the
  request runs) too, where the scheduler pins the sliding-window blocks of each step's stores
  until every worker reported the save ended (`PinnedSaves`, ``KVDepotWorkerMeta``); without
  pins they are the exception: a later forward that may write one of their blocks (the
  scheduler's ``written_block_ids``) must follow their gathers (`WorkerConnector.bind_connector_metadata`). CUDA: the
  save comes with the engine's stream (`PostedSave`), and this thread gathers it on that
  stream when it takes it (`Sender.stage_saves`; every forward enqueued later follows),
  unless ``bind_connector_metadata`` claimed it first and gathered it there; without fence words the gathers go
  on the side stream after an event recorded on the engine's stream at that point, and
  ``bind_connector_metadata`` makes the engine's stream wait for them.
* a load's scatter waits on an event recorded in ``bind_connector_metadata`` (after vLLM gave
  the request its blocks and queued its own work on them: work an earlier owner of those
  blocks queued runs first; `WorkerConnector.bind_connector_metadata`); the engine's
  stream waits on an event recorded after the scatter before the request is reported in
  ``finished_recving``.
* preemption: `WorkerConnector.handle_preemptions` waits until this thread dropped the preempted
  requests' queued stores, and makes the engine's stream wait for the gathers already queued.

Ring full: a store or load waits in a queue (in order, so a request's chunks reach the daemon
parent first) and goes out once the ring has room; stores of sliding-window models never wait
(skipped and counted). A load or store larger than a quarter of the ring goes in pieces. Daemon
down, hung or restarted: see `kvdepot.client.client` (fail fast, `available` probes, a new boot
-> register again). A store or retrieve without an answer after ``rpc_timeout_s`` marks the
daemon down; its request keeps its blocks until the answer, the daemon's restart, its deadline
passed with margin (CPU engines: `kvdepot.client.pending.DEADLINE_MARGIN_S`) or ``hold_max_s``,
so a late copy never touches blocks vLLM gave to another request. One lost with its connection
is settled on the next (`m.Settle`): its blocks come back once the daemon says its copies ended.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvdepot import trace
from kvdepot.client.client import KVDepotClient
from kvdepot.client.vllm import commands as cmds
from kvdepot.client.vllm.pieces import Book, LoadOutcomes, Op, PinnedSaves, PostedSave, Preemption, Results, Wake
from kvdepot.client.vllm.planner import Planner
from kvdepot.client.vllm.sender import DOWN, Sender
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError

log = logging.getLogger("kvdepot.vllm")

_REPLY_POLL_S = 1e-3  # while replies are due: the socket is watched this long at a time (a reply wakes it)
_ROOM_POLL_S = 100e-6  # while pieces wait for ring room and no reply is due
_IDLE_S = 0.05  # nothing in flight: wait this long for a command at a time
_FULL_PASS_S = 0.01  # ops in flight: look at them at least this often (timeouts), replies or not


class TransferThread:
    """The transfers of one vLLM worker (stores, loads, registration with the daemon), run on
    a thread of their own. The engine thread calls `post`, `preempt`, `saves_gathered`,
    `gathered`, `forget_gathered`, `merge_rest` and ``sender.stage_saves``; everything else
    runs on the thread. It owns the ``book`` of pieces (`Book`), the ``planner`` and the
    ``sender``, and reads the replies (`_collect`).

    Args:
        side: the `WorkerConnector` (configuration, layout, stats, registration helpers).
    """

    def __init__(self, side) -> None:
        self.side = side
        self.registrar = side.registrar
        self.cfg = side.cfg
        self.client: KVDepotClient = side.client
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.book = Book(LoadOutcomes(side), side.stats)
        self.planner = Planner(side)
        self.sender = Sender(side, self.client, self.planner, self.book, self._collect)
        self._release: set[str] = set()  # finished requests vLLM keeps blocks for
        # to the engine thread without a lock (deque appends and pops are atomic): a lock the
        # engine thread blocked on would hand the GIL to this thread for a whole switch interval
        self.outbox: collections.deque[Results] = collections.deque()
        self._saves_cond = threading.Condition()  # notified as _saves_gathered grows
        self._saves_gathered = 0  # "save" commands handled
        # sliding-window models: save number (1-based) -> side-stream event after its gathers
        # (None on CPU); the engine thread removes an entry once it no longer needs it
        self._gather_events: dict[int, object] = {}
        self._gathered_forgotten = 0  # saves up to this one: no event kept (`forget_gathered`)
        self._side: torch.cuda.Stream | None = None
        self._scattered = False  # a load's scatter was queued since the last publish
        self._thread: threading.Thread | None = None
        self._failed = False
        self._pinned = PinnedSaves()  # pinned saves (`KVDepotMetadata.pin_seq`) not reported yet
        self._wake = Wake()  # a load, preemption or stop ends the thread's wait for replies
        # requests lost with a connection (`m.Settle`): the highest rid a Settle asked for, the
        # highest the daemon answered (their copies ended: their blocks are free), the Settle in flight
        self._settle_asked = 0
        self._settled_through = 0
        self._settle_rid: int | None = None
        # `post` of a command that wakes nobody (a `cmds.Save`, a `cmds.Release`), as one C
        # call: the engine thread's most common post, every store step
        self.post_quiet = self._inbox.put

    # ------------------------------------------------------------------ engine thread

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kvdepot-{self.side.shard}", daemon=True)
        self._thread.start()

    def post(self, cmd: cmds.Command) -> None:
        """Queue one command (`kvdepot.client.vllm.commands`). A `cmds.Load` cuts short the
        thread's wait for replies (`_wait`); the others wait for the next reply or the end of
        that wait."""
        self._put(cmd, type(cmd) is cmds.Load)

    def _put(self, cmd: cmds.Command, wake: bool = True) -> None:
        self._inbox.put(cmd)
        if wake:
            self._wake.signal()

    def preempt(self, req_ids: set[str], timeout_s: float) -> Preemption:
        """Drop the queued stores of ``req_ids`` (their blocks go to other requests in this
        step's forward); returns once the thread did (or after ``timeout_s``)."""
        p = Preemption(req_ids)
        self._put(cmds.Preempt(p))
        if not p.done.wait(timeout_s):
            log.error("kvdepot: the transfer thread did not answer a preemption within %.1f s", timeout_s)
        return p

    def saves_gathered(self, count: int, timeout_s: float):
        """Wait until the first ``count`` "save" commands were handled (their gathers queued or
        skipped); returns the side-stream event after the gathers of save ``count`` (None on
        CPU, or if the thread did not answer within ``timeout_s``). Sliding-window models only."""
        if self._saves_gathered < count:
            with self._saves_cond:
                if not self._saves_cond.wait_for(lambda: self._saves_gathered >= count, timeout_s):
                    log.error("kvdepot: the transfer thread did not gather a step's stores within %.1f s",
                              timeout_s)
        return self._gather_events.get(count)

    def gathered(self, seq: int) -> tuple[bool, object]:
        """(whether save ``seq`` was handled, the side-stream event after its gathers); never waits."""
        if seq > self._saves_gathered:
            return False, None
        return True, self._gather_events.get(seq)

    def forget_gathered(self, seq: int) -> None:
        """The engine thread no longer asks about saves ``<= seq`` (its stream is ordered after
        their gathers, or they ran)."""
        if seq > self._gathered_forgotten:
            self._gathered_forgotten = seq
        for k in [k for k in self._gather_events if k <= seq]:
            self._gather_events.pop(k, None)

    def merge_rest(self, out: Results) -> Results:
        """``out`` (the oldest published result, which the engine thread took from `outbox`
        itself) with every later one still in `outbox` merged into it."""
        box = self.outbox
        while box:
            more = box.popleft()
            out.sending |= more.sending
            out.recving |= more.recving
            out.failed_recving |= more.failed_recving
            out.invalid_blocks |= more.invalid_blocks
            out.saves_ended |= more.saves_ended
            if more.scatter_event is not None:
                out.scatter_event = more.scatter_event
        return out

    def stop(self, timeout_s: float) -> None:
        if self._thread is None:
            self.client.close()
            self._wake.close()
            return
        self._put(cmds.Stop())
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        reg = self.registrar.reg
        if reg is not None and reg.device == "cuda":
            dev = reg.local[0].device if reg.local else torch.device("cuda")
            torch.cuda.set_device(dev)
            self._side = self.sender.stream = torch.cuda.Stream(dev)
            torch.cuda.set_stream(self._side)  # a ring reclaim's scatter goes there too
        t_cpu = time.thread_time()
        seen_replies = -1  # the client's replies_read at the last pass over the ops
        full_pass_s = 0.0  # time.monotonic() of the last pass
        while True:
            trace.point(trace.TRANSFER_THREAD, "t_wait")  # (a disabled point costs a global lookup)
            cmd = self._wait()
            trace.point(trace.TRANSFER_THREAD, "t_run")
            try:
                changed = cmd is not None
                while cmd is not None:
                    if type(cmd) is cmds.Stop:
                        self._shutdown()
                        return
                    self._handle(cmd)
                    cmd = self._next()
                now_s = time.monotonic()
                if self.book.queue or self.book.ops:
                    c = self.client
                    c.poll()
                    # a pass only when it can find something: a command or a reply came, the
                    # ring's oldest region freed (a load's scatter ran), or timeouts are due
                    if (changed or c.conn.replies_read != seen_replies or now_s - full_pass_s > _FULL_PASS_S
                            or (self.book.queue and self._oldest_region_free())):
                        seen_replies, full_pass_s = c.conn.replies_read, now_s
                        self._collect()
                        self.sender.pump()
                        changed = True
                elif not changed and now_s - full_pass_s > _IDLE_S:
                    full_pass_s = now_s
                    self.registrar.ready()  # idle: notices a restarted daemon (registers again)
                if changed or self._pinned:
                    self._publish()
            except Exception as exc:  # a bug here must not leave requests waiting forever
                self._fail_all(exc)
            now = time.thread_time()
            self.side.stats["thread_cpu_s"] += now - t_cpu
            t_cpu = now

    def _oldest_region_free(self) -> bool:
        kvreg = self.registrar.kvreg
        if kvreg is None or kvreg.staging is None:
            return False
        return any(ring.live and ring.live[0].is_free() for ring in kvreg.staging.rings)

    def _next(self):
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _wait(self):
        """The next command, or None once there may be transfer work to do."""
        if not (self.book.queue or self.book.ops or self._pinned):
            try:
                return self._inbox.get(timeout=_IDLE_S)
            except queue.Empty:
                return None
        cmd = self._next()
        if cmd is not None:
            return cmd
        if self.client.conn.awaiting_replies:
            # returns at the first reply, or at a load, preemption or stop (`_put`), which
            # need not wait for a reply or the whole _REPLY_POLL_S
            wake = self._wake
            wake.waiting = True
            try:
                cmd = self._next()  # after the flag: a command put before it was set is seen here
                if cmd is None:
                    self.client.poll(_REPLY_POLL_S, wake.fd)
            finally:
                wake.waiting = False
            wake.drain()
            return cmd if cmd is not None else self._next()
        try:
            return self._inbox.get(timeout=_ROOM_POLL_S)
        except queue.Empty:
            return None

    def _handle(self, cmd: cmds.Command) -> None:
        if isinstance(cmd, cmds.Save):
            try:
                self._handle_save(cmd)
            finally:  # after the save's stores were queued (each keeps its request busy until it ends)
                if cmd.release:
                    self._release.update(cmd.release)
        elif type(cmd) is cmds.Release:
            self._release.update(cmd.req_ids)
        elif type(cmd) is cmds.Load:
            ready = self.registrar.ready()
            # the first job's pieces go out before the others are planned; the others' pieces
            # then go together (`_batch`: several requests' small pieces in one request)
            jobs = cmd.jobs
            for i, job in enumerate(jobs):
                self.sender.load(job, ready, cmd.null_block_id, cmd.event)
                if i == 0 or i == len(jobs) - 1:
                    self.sender.pump()
        elif type(cmd) is cmds.Preempt:
            self._preempt(cmd.preemption)

    def _handle_save(self, cmd: cmds.Save) -> None:
        """One step's save (the four kinds: `kvdepot.client.vllm.commands`)."""
        jobs, staged, event, pin = cmd.jobs, None, None, 0
        if type(cmd) is cmds.SaveOnStream:  # blocks kept until stored: `WorkerConnector.wait_for_save`
            pin = cmd.pin_seq
            if cmd.stream is not None:
                event = torch.cuda.Event()
                event.record(cmd.stream)
        elif type(cmd) is cmds.SaveAfterEvent:
            event = cmd.event
        elif type(cmd) is cmds.SaveStaged:
            staged = cmd.staged
        seq = self._saves_gathered + 1
        if pin:  # every piece made for the save from here on keeps its pins (`PinnedSaves`)
            had = self.book.live_piece_ids()
        try:
            sliding = not self.side.stores_may_wait
            if type(cmd) is cmds.SavePosted:
                staged, event = self._claim_save(cmd.posted, jobs)
            if staged is not None:
                self.sender.send_staged(jobs, staged)
            else:
                before = {id(op) for op in self.book.ops} if sliding else None
                self.sender.save(jobs, event)
                if sliding:
                    self.sender.await_unstaged([op for op in self.book.ops if id(op) not in before])
        finally:  # counted even if it failed: the engine thread may wait for the count
            if pin:
                self._pinned.add(pin, [op.piece for op in self.book.ops if id(op.piece) not in had]
                                 + [p for p in self.book.queue if id(p) not in had])
            if not self.side.stores_may_wait and staged is None:  # only `bind_connector_metadata` of those waits on it
                ev = None
                if self._side is not None:
                    ev = torch.cuda.Event()
                    ev.record(self._side)
                # before the count: a reader that sees the count sees the event
                if seq > self._gathered_forgotten:
                    self._gather_events[seq] = ev
                for k in [k for k in self._gather_events if k <= self._gathered_forgotten]:
                    self._gather_events.pop(k, None)  # raced with forget_gathered
            with self._saves_cond:
                self._saves_gathered = seq
                self._saves_cond.notify_all()

    def _claim_save(self, posted: PostedSave, jobs) -> tuple[cmds.StagedSaves | None, object]:
        """A sliding-window model's save posted with the engine's stream (`PostedSave`): gathered
        here on that stream, unless ``bind_connector_metadata`` claimed it first (then what it staged is taken).
        Returns (what was staged or None, the event the thread's own gathers follow or None)."""
        if posted.claim("thread", blocking=True):
            try:
                staged = self.sender.stage_saves(jobs, posted.stream, self.book.stopped)
                # no fence words now: gathered on the side stream after this point
                return staged, (posted.event_here() if staged is None else None)
            finally:
                posted.lock.release()
        if posted.staged is None and posted.event is None:  # bind's gather raised: after this point then
            posted.event_here()
        return posted.staged, posted.event

    def _publish(self) -> None:
        sending = set()
        if self._release:
            sending = {r for r in self._release if not self.book.busy(r)}
            self._release -= sending
            self.book.stopped -= sending
        ended = self._pinned.ended(self.book.live_piece_ids, self._side) if self._pinned else set()
        lo = self.book.loads
        if not (sending or lo.recving or lo.failed_recving or lo.invalid_blocks or ended):
            return
        ev = None
        if self._scattered and self._side is not None:
            ev = torch.cuda.Event()
            ev.record(self._side)
            self._scattered = False
        r = Results(sending, lo.recving, lo.failed_recving & lo.recving, lo.invalid_blocks, ev, ended)
        r.transfer = KVConnectorTransferResults(finished_sending=r.sending, finished_recving=r.recving,
                                                failed_recving=r.failed_recving)
        self.outbox.append(r)
        lo.failed_recving -= lo.recving
        lo.recving, lo.invalid_blocks = set(), set()

    def _fail_all(self, exc: BaseException) -> None:
        """An unexpected error in this thread: log it, stop using the daemon on this worker
        (vLLM keeps serving without it) and end every load (recomputed) and store (skipped)."""
        if not self._failed:
            log.exception("kvdepot: the transfer thread failed; the connector is disabled on this worker",
                          exc_info=exc)
        self._failed = True
        self.registrar.disable(f"the transfer thread failed: {exc!r}")
        for op in self.book.ops:
            self._failed_op(op, None)
        for p in self.book.queue:
            self.book.drop(p, "the transfer thread failed")
        self.book.ops, self.book.queue = [], collections.deque()
        self._pinned.abandon()
        try:
            self._publish()
        except Exception:
            pass

    def _shutdown(self) -> None:
        c, kvreg = self.client, self.registrar.kvreg
        if kvreg is not None and c.up:
            try:
                for op in self.book.ops:  # the ring and the blocks must outlive the daemon's copies
                    op.pending.result(timeout_s=self.cfg.rpc_timeout_s)
                c.unregister(kvreg)
            except KVDepotError:
                pass
        c.close()
        self._wake.close()  # only this thread's wait sets ``waiting``: nothing signals it now

    # ------------------------------------------------------------------ preemption

    def _preempt(self, p: Preemption) -> None:
        """Drop the queued stores of preempted requests; an unstaged store (the daemon reads the
        blocks itself) is waited for; ``p.event`` follows every gather queued so far."""
        try:
            self.sender.drop_preempted(p.req_ids)
        finally:  # the engine thread waits for done
            if self._side is not None:
                p.event = torch.cuda.Event()
                p.event.record(self._side)
            p.done.set()
        self._collect()

    # ------------------------------------------------------------------ sending and collecting

    def _collect(self) -> None:
        """End the ops whose answer is in (never waits); give up on those of a daemon that
        restarted or after ``hold_max_s``. A load's scatter is queued on the side stream."""
        if not self.book.ops:
            return
        now = time.monotonic()
        c, side = self.client, self.side
        left = []
        lost_rid = 0  # the highest rid of the ops lost with a connection and not settled yet
        for op in self.book.ops:
            p = op.piece
            age_s = now - op.sent_at
            if op.pending.done():
                try:
                    if p.kind == "store":
                        r = op.pending.result()
                        if op.run >= 0:
                            r = r.chains[op.run]
                        side.stats["stores"] += 1
                        side.stats["stored_chunks"] += r.stored
                        if r.skipped:
                            self.book.stopped.add(p.req_id)
                    else:
                        got = op.pending.result(before=self._side)
                        if op.run >= 0:
                            got = op.pending.chains_retrieved[op.run]
                        self._scattered = True
                        self.book.loads.piece_ended(p, got)
                except KVDepotError as exc:
                    if (exc.code in (ErrorCode.TIMEOUT, ErrorCode.DISCONNECTED) and op.generation == c.generation
                            and age_s <= self.cfg.hold_max_s and not _blocks_free(op, now)
                            and op.pending.rid > self._settled_through):
                        # lost with the connection, not refused: the daemon may still run it, so its
                        # blocks stay the request's until a Settle says its copies ended, the daemon
                        # restarted, its deadline passed (CPU) or hold_max_s passed
                        if not op.late:
                            op.late = True
                            side.stats["late_ops"] += 1
                            c.mark_down()
                        lost_rid = max(lost_rid, op.pending.rid)
                        left.append(op)
                        continue
                    self._failed_op(op, exc)
                continue
            if op.generation != c.generation or age_s > self.cfg.hold_max_s or _blocks_free(op, now):
                if op.generation == c.generation:
                    log.warning("kvdepot: no answer for request %s after %.0f s; releasing its blocks",
                                p.req_id, age_s)
                self._failed_op(op, None)
                continue
            if age_s > self.cfg.rpc_timeout_s and not op.late:
                op.late = True
                side.stats["late_ops"] += 1
                log.warning("kvdepot: %s of request %s unanswered after %.1f s; the daemon is considered down",
                            p.kind, p.req_id, self.cfg.rpc_timeout_s)
                c.mark_down()
            left.append(op)
        self.book.ops = left
        if lost_rid > self._settle_asked and self._settle_rid is None:
            self._settle(lost_rid)

    def _settle(self, through_rid: int) -> None:
        """Ask the daemon (`m.Settle`) to refuse this worker's lost requests up to ``through_rid``
        and to answer once the ones it accepted ended: their blocks are then free (`_collect`)."""
        kvreg = self.registrar.kvreg
        if kvreg is None:
            return

        def answered(reply: m.Msg) -> None:
            self._settle_rid = None
            if isinstance(reply, m.ErrorReply):
                self._settle_asked = self._settled_through  # asked again by a later pass
            else:
                self._settled_through = max(self._settled_through, through_rid)

        try:
            self._settle_rid = self.client.submit(m.Settle(rid=0, registration=kvreg.id, through_rid=through_rid),
                                                  on_reply=answered)
        except KVDepotError:
            return
        self._settle_asked = through_rid

    def _failed_op(self, op: Op, exc: KVDepotError | None) -> None:
        p = op.piece
        if exc is not None:
            if exc.code == ErrorCode.UNKNOWN_REGISTRATION:
                log.warning("kvdepot: the daemon lost registration %s (restarted?); registering again",
                            self.registrar.kvreg.id if self.registrar.kvreg else None)
                self.registrar.generation = -1  # the next ready() registers again
            elif exc.code in DOWN:
                self.client.mark_down()
            log.warning("kvdepot: %s of request %s failed: %s", p.kind, p.req_id, exc)
        if p.kind == "store":
            self.side.stats["store_failures"] += 1
            self.book.stopped.add(p.req_id)
        else:
            self.book.loads.piece_ended(p, 0)


def _blocks_free(op: Op, now_s: float) -> bool:
    """Whether the daemon can no longer touch ``op``'s blocks although no answer came: its
    deadline (`Store.deadline_ns`, unstaged CPU transfers) passed with margin."""
    free_at = op.pending.blocks_free_at_s
    return free_at is not None and now_s > free_at


__all__ = ["TransferThread", "Results", "Preemption", "DOWN"]
