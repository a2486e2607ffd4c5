"""Requests a client gave up (`Settlements`): a `m.Drain` settles the staging regions of staged
requests lost with a connection (refused from then on, answered once the accepted ones finished
their copies), a `m.Settle` the same for a client's requests by number. The state lives on each
`kvdepot.server.registration.Registration` (``refuse_through``, ``staged_busy``, ``drains``,
``settled``, ``busy_rids``, ``settles``); the transfer handlers call `staged_accept`,
`staged_begin`, `staged_end` and `settle_end` around every request's copies."""

from __future__ import annotations

from collections.abc import Callable

from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.server.registration import Registration


class Settlements:
    """Drains and Settles (see the module docstring).

    Args:
        registration: the daemon's lookup of a registration by id (raises UNKNOWN_REGISTRATION).
        front: the `kvdepot.server.front.Front` that answers a held Drain / Settle.
    """

    def __init__(self, registration: Callable[[str], Registration], front) -> None:
        self.registration = registration
        self.front = front

    def staged_accept(self, reg: Registration, seq: int) -> int:
        """A staged request arrived: refused if a `Drain` settled its staging region already
        (it was lost on a connection its client gave up; the region may hold other bytes now).

        Raises:
            RequestError(INVALID_ARGUMENT): ``seq`` <= the registration's drained sequence.
        """
        if seq and seq <= reg.refuse_through:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"staging region {seq} was drained (its request was given up): nothing copied")
        return seq

    def staged_begin(self, reg: Registration, seq: int) -> None:
        if seq:
            reg.staged_busy[seq] = reg.staged_busy.get(seq, 0) + 1

    def staged_end(self, reg: Registration, seq: int) -> None:
        """A staged request's copies ended (or it will copy nothing): answer the Drains it held."""
        if not seq:
            return
        busy = reg.staged_busy
        left = busy.get(seq, 0) - 1
        if left > 0:
            busy[seq] = left
        else:
            busy.pop(seq, None)
        if reg.drains:
            low = min(busy) if busy else None
            still = []
            for through, identity, rid in reg.drains:
                if low is not None and low <= through:
                    still.append((through, identity, rid))
                else:
                    self.front.reply(identity, m.OkReply(rid=rid))
            reg.drains = still

    def on_drain(self, identity: bytes, req: m.Drain) -> m.Msg | None:
        """`m.Drain`: refuse staged requests up to ``through_seq`` from now on; reply once the
        accepted ones finished."""
        reg = self.registration(req.registration)
        reg.refuse_through = max(reg.refuse_through, req.through_seq)
        if any(seq <= req.through_seq for seq in reg.staged_busy):
            reg.drains.append((req.through_seq, identity, req.rid))
            return None
        return m.OkReply(rid=req.rid)

    # ------------------------------------------------------------------ Settle (lost requests)

    def settle_end(self, reg: Registration, identity: bytes, rid: int) -> None:
        """A Store / Retrieve's copies ended: answer the Settles it held."""
        busy, key = reg.busy_rids, (identity, rid)
        left = busy[key] - 1
        if left > 0:
            busy[key] = left
        else:
            del busy[key]
        if reg.settles:
            still = []
            for through, who, settle_rid in reg.settles:
                if any(i == who and r <= through for i, r in busy):
                    still.append((through, who, settle_rid))
                else:
                    self.front.reply(who, m.OkReply(rid=settle_rid))
            reg.settles = still

    def on_settle(self, identity: bytes, req: m.Settle) -> m.Msg | None:
        """`m.Settle`: refuse this client's requests up to ``through_rid`` from now on; reply
        once the accepted ones finished their copies."""
        reg = self.registration(req.registration)
        if req.through_rid > reg.settled.get(identity, 0):
            reg.settled[identity] = req.through_rid
        if any(i == identity and r <= req.through_rid for i, r in reg.busy_rids):
            reg.settles.append((req.through_rid, identity, req.rid))
            return None
        return m.OkReply(rid=req.rid)
