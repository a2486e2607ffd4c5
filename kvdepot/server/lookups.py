"""LOOKUP and END_REQUEST (`Lookups`): how many leading chunks of a prompt the tiers hold, the
pins that keep a lookup's hits until its retrieve (vLLM's scheduler asks, its worker retrieves
a step later), and the lookup counters of `describe` and /metrics.

A lookup walks each chain from chunk 0 through the tiers (`kvdepot.server.tiering.Tiers`): a
chunk counts when L1 or L2 holds it READY, or L3 has it (one round trip for every chunk past
the L1/L2 run, at most ``l3_timeout_s``). A pinned lookup starts reading its L2 and L3 hits
into L1 at once, so the retrieve that follows finds them there.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from kvdepot.protocol import messages as m
from kvdepot.server.disk import DiskEntry
from kvdepot.server.index import ChunkIndex, Entry


@dataclasses.dataclass(eq=False)
class Pin:
    entries: list  # acquired L1 `Entry` and L2 `DiskEntry` objects
    deadline: float  # time.monotonic() after which the sweeper drops it
    pid: int  # the client's watched pid (0: none): its exit drops the pin


class Lookups:
    """Lookups, their pins and counters.

    Args:
        tiers: the `kvdepot.server.tiering.Tiers` the chains are walked through.
        index: L1's chunk index (its chains are touched on a hit).
        front: the `kvdepot.server.front.Front` that answers a lookup waiting for L3.
        metrics: the daemon's `kvdepot.server.metrics.Metrics`.
        model_label: a request's model name -> its metric label (registered models, else "other").
        pin_ttl_s: a pin expires this long after its lookup.

    Attributes:
        pins: ``(client identity, request) -> Pin``.
        client_pids: watched pids of ZMQ ``ipc://`` clients by identity (`kvdepot.server.liveness`).
        requested_tokens, hit_tokens: totals over every lookup (`describe`).
    """

    def __init__(self, tiers, index: ChunkIndex, front, metrics, model_label: Callable[[str], str],
                 pin_ttl_s: float) -> None:
        self.tiers = tiers
        self.index = index
        self.front = front
        self.metrics = metrics
        self.model_label = model_label
        self.pin_ttl_s = pin_ttl_s
        self.pins: dict[tuple[bytes, str], Pin] = {}
        self.client_pids: dict[bytes, int] = {}
        self.requested_tokens = 0
        self.hit_tokens = 0

    def on_lookup(self, identity: bytes, req: m.Lookup) -> m.Msg | None:
        tiers = self.tiers
        found = [tiers.walk(chain) for chain in req.keys]
        l3 = tiers.l3
        if l3 is not None and l3.available():
            # one round trip for every chunk past each chain's L1/L2 run (the reply waits for
            # it, at most l3_timeout_s; L3 down: answered from L1/L2 at once)
            ask = [k for chain, f in zip(req.keys, found) for k in chain[len(f):] if tiers.find(k) is None]
            if ask:
                def done(sizes: list[int] | None) -> None:
                    try:
                        reply = self._lookup_done(identity, req, None if sizes is None else dict(zip(ask, sizes)))
                    except Exception as exc:  # noqa: BLE001 - every failure becomes a typed reply
                        self.front.reply_error(identity, req.rid, exc)
                        return
                    self.front.reply(identity, reply)

                l3.sizes(ask, done)
                return None
        return self._lookup_done(identity, req, None, found)

    def _lookup_done(self, identity: bytes, req: m.Lookup, l3_sizes: dict[bytes, int] | None,
                     found: list[list] | None = None) -> m.Msg:
        """Count the hit (the shortest chain's run), pin its L1/L2 chunks for ``pin_request``,
        start reading its L2 (pinned lookups) and L3 chunks into L1, and count the metrics."""
        tiers = self.tiers
        if found is None:  # after the L3 round trip: walk again (entries may have left meanwhile)
            found = [tiers.walk(chain, l3_sizes) for chain in req.keys]
        hit = min((len(f) for f in found), default=0)
        if req.pin_request:
            self.unpin(identity, req.pin_request)
            if hit:
                entries = [e for f in found for e in f[:hit] if not isinstance(e, tuple)]
                for e in entries:
                    tiers.acquire(e)
                self.pins[(identity, req.pin_request)] = Pin(entries, time.monotonic() + self.pin_ttl_s,
                                                             self.client_pids.get(identity, 0))
        hits = tiers.hits
        for chain, f in zip(req.keys, found):
            self.index.touch_chain(chain[:hit])
            if tiers.l2 is not None:
                tiers.l2.touch_chain(chain[:hit])
            for j, e in enumerate(f[:hit]):
                if isinstance(e, Entry):
                    hits["l1"] += 1
                elif isinstance(e, DiskEntry):
                    hits["l2"] += 1
                    if req.pin_request:  # vLLM's scheduler: the retrieve follows
                        tiers.promote(e)
                else:  # only L3 has it: fetch it now (a retrieve finds it in L1, or waits for it)
                    hits["l3"] += 1
                    tiers.promote_l3(e[0], chain[j - 1] if j else b"", e[1], req.model)
        # without num_tokens the prompt is taken to be the whole chunks asked about, so that
        # hit tokens never exceed requested tokens (hit rate <= 1)
        requested = req.num_tokens or max((len(c) for c in req.keys), default=0) * req.chunk_size
        hit_tokens = min(hit * req.chunk_size, requested)
        model = self.model_label(req.model)
        self.metrics.lookups.labels(model).inc()
        self.metrics.lookup_requested_tokens.labels(model).inc(requested)
        self.metrics.lookup_hit_tokens.labels(model).inc(hit_tokens)
        self.requested_tokens += requested
        self.hit_tokens += hit_tokens
        return m.LookupReply(rid=req.rid, hit_chunks=hit)

    def unpin(self, identity: bytes, request: str) -> None:
        """Release the pin of ``identity``'s ``request`` (if any)."""
        pin = self.pins.pop((identity, request), None)
        if pin is not None:
            for e in pin.entries:
                self.tiers.release(e)

    def on_end(self, identity: bytes, req: m.EndRequest) -> m.Msg:
        self.unpin(identity, req.request)
        return m.OkReply(rid=req.rid)
