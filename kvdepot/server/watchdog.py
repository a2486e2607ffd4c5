"""The copy watchdog: every STORE / RETRIEVE copy in flight is recorded with a deadline derived
from its bytes (``watchdog_s`` + bytes at `WATCHDOG_MIN_BYTES_PER_S`, far below any real path:
CPU copies run at GB/s, PCIe at tens of GB/s). A copy past its deadline (a hung GPU, a stuck
copy thread, requests queued behind one) is declared stuck by the sweeper: a client still
waiting for its reply gets ``TIMEOUT`` at once (the same code as its own timeout, with the same
meaning: the copy may still run, so the engine keeps the blocks), `describe` lists it, and
``kvdepot_stuck_transfers`` counts it. When a stuck copy ends after all, nothing more is
replied and a stuck store's chunks are dropped (the engine, told it failed, may have reused its
blocks before the copy read them), so a late copy can never publish a wrong byte.

`CopyWatchdog` owns the copies in flight; the daemon's transfer handlers `watch` and
`unwatch` each copy, its sweeper calls `check_stuck`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, RequestError

log = logging.getLogger("kvdepot.daemon")

WATCHDOG_MIN_BYTES_PER_S = 100e6  # a copy slower than this (beyond the floor) is stuck
_NEVER = float("inf")


class Inflight(NamedTuple):
    """One copy in flight (a tuple: one is made per request)."""

    op: str  # "store" / "retrieve"
    registration: str
    rid: int
    identity: bytes  # the client connection to answer
    size_bytes: int  # bytes the copy moves
    started_s: float  # time.monotonic() when it was enqueued
    deadline_s: float  # time.monotonic() after which it is stuck
    reply_pending: bool  # the client waits for this request's reply (answered TIMEOUT once stuck)


class CopyWatchdog:
    """Deadlines of copies in flight (see the module docstring).

    Args:
        watchdog_s: the deadline's floor in seconds (0: never stuck; ``--watchdog-s``).
        metrics: the daemon's `kvdepot.server.metrics.Metrics` (``stuck_transfers``,
            ``transfers_stuck``).
        reply_error: ``(identity, rid, exc)``: answers a stuck copy's waiting client.
    """

    def __init__(self, watchdog_s: float, metrics, reply_error: Callable[[bytes, int, BaseException], None]) -> None:
        self.watchdog_s = watchdog_s
        self.metrics = metrics
        self._reply_error = reply_error
        self.inflight: dict[int, Inflight] = {}
        self.stuck: dict[int, float] = {}  # token -> time.monotonic() it was declared stuck
        self._inflight_ids = itertools.count(1)
        metrics.stuck_transfers.labels().set_function(lambda: len(self.stuck))

    def watch(self, op: str, registration: str, identity: bytes, rid: int, size_bytes: int,
              reply_pending: bool, now: float | None = None) -> int:
        """Record a copy just enqueued (``now``: time.monotonic(), if the caller has it);
        returns the token to give `unwatch` when it ends."""
        if now is None:
            now = time.monotonic()
        token = next(self._inflight_ids)
        floor_s = self.watchdog_s
        deadline = now + floor_s + size_bytes / WATCHDOG_MIN_BYTES_PER_S if floor_s > 0 else _NEVER
        self.inflight[token] = Inflight(op, registration, rid, identity, size_bytes, now, deadline, reply_pending)
        return token

    def unwatch(self, token: int) -> bool:
        """The copy of ``token`` ended; True if the watchdog had declared it stuck (its request
        was answered then: no reply now, and a store's chunks must not be published)."""
        rec = self.inflight.pop(token, None)
        if not self.stuck or rec is None or self.stuck.pop(token, None) is None:
            return False
        log.warning("the stuck %s copy of request %d (%s, %d bytes) ended after %.1f s", rec.op, rec.rid,
                    rec.registration, rec.size_bytes, time.monotonic() - rec.started_s)
        return True

    def check_stuck(self, now: float) -> None:
        """Declare the copies past their deadline stuck (from the sweeper)."""
        for token, rec in self.inflight.items():
            if now < rec.deadline_s or token in self.stuck:
                continue
            self.stuck[token] = now
            self.metrics.transfers_stuck.labels(rec.op).inc()
            age_s = now - rec.started_s
            log.error("%s copy of request %d (%s, %d bytes) has not completed after %.1f s: declared stuck",
                      rec.op, rec.rid, rec.registration, rec.size_bytes, age_s)
            if rec.reply_pending:
                self._reply_error(rec.identity, rec.rid, RequestError(
                    ErrorCode.TIMEOUT, f"the {rec.op} copy ({rec.size_bytes} bytes) has not completed after "
                                       f"{age_s:.1f} s (watchdog); it may still run: keep the blocks"))

    def stuck_infos(self) -> list[m.TransferInfo]:
        """The stuck copies (for `describe`), oldest first."""
        now = time.monotonic()
        recs = [self.inflight[t] for t in self.stuck if t in self.inflight]
        return [m.TransferInfo(op=r.op, registration=r.registration, rid=r.rid, size_bytes=r.size_bytes,
                               age_s=round(now - r.started_s, 3))
                for r in sorted(recs, key=lambda r: r.started_s)]
