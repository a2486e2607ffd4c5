"""Chunk events for the engines' connectors (`ChunkEvents`): which chunks entered the depot and
which left it, so that a connector can tell a KV-aware router (vLLM's KV events,
`kvdepot.client.vllm.events`).

A ZMQ XPUB socket at ``ipc://PATH.events`` beside every ``ipc://PATH`` endpoint
(`kvdepot.protocol.transport.events_endpoint`). Each message is two frames: the topic, the
model label followed by a NUL byte (a connector subscribes to its own model's topic and to
`kvdepot.protocol.messages.EVENTS_ALL_MODELS`), and a msgpack body
`kvdepot.protocol.messages.ChunkEventBatch`:

* ``stored``: keys whose chunk became readable in L1 from a store or from L3 (a chunk promoted
  from L2 was in the depot already), and keys a store sent that the depot already held (so that
  whichever connector planned that store learns the depot holds it);
* ``removed``: keys that left the depot: in neither L1 nor L2 any more (evicted from the last
  tier holding them, flushed, dropped as corrupt);
* ``cleared``: every chunk of the topic's model (or of all models) was flushed.

Events are gathered during one pass of the event loop and sent at its end, one message per
model: a key whose chunk left L1 for L2 within the pass is not removed. Sent without blocking:
when a subscriber does not read, ZMQ drops messages beyond its high-water mark (`HWM` messages),
so the daemon's memory stays bounded whoever reads; a connector that misses a ``removed`` only
leaves a router's entry stale (the router's lookup then misses, never loads a wrong byte).
L3 is shared by daemons and expires by TTL: its keys are not tracked.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq

from kvdepot.protocol.messages import EVENTS_ALL_MODELS, ChunkEventBatch, events_topic

log = logging.getLogger("kvdepot.daemon")

HWM = 10_000  # messages queued per subscriber before ZMQ drops more

class ChunkEvents:
    """Gathers and publishes chunk events (see the module docstring). Off (every call returns at
    once) until `open` binds its socket, and for every model no connector subscribed to (an XPUB
    socket hears the subscriptions, so the chunks of a model nobody listens to cost one set
    lookup each); the tiers call `stored`, `left` and `cleared` from the event loop."""

    def __init__(self) -> None:
        self._sock: zmq.Socket | None = None
        self._models: set[str] = set()  # models with a subscriber ("": the all-models topic)
        self._in_depot = None
        self._stored: dict[str, list[bytes]] = {}
        self._left: dict[str, list[bytes]] = {}
        self._cleared: set[str] = set()  # models ("" for all) flushed whole in this pass
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.sent = 0  # messages

    def open(self, ctx: zmq.Context, endpoints: list[str], loop: asyncio.AbstractEventLoop, in_depot) -> None:
        """Bind the XPUB socket at ``endpoints`` (none: events stay off; a bind that fails is
        logged and leaves them off). ``in_depot(key)``: whether L1 or L2 holds the key (read at
        the end of a pass: a key stored and gone again within it is not announced)."""
        self._loop, self._in_depot = loop, in_depot
        if not endpoints:
            return
        sock = ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            for ep in endpoints:
                sock.bind(ep)
        except zmq.ZMQError as exc:
            log.warning("no chunk events (cannot bind %s: %s)", ", ".join(endpoints), exc)
            sock.close(0)
            return
        self._sock = sock
        loop.add_reader(sock.getsockopt(zmq.FD), self._subscriptions)
        self._subscriptions()

    def _subscriptions(self) -> None:
        """Read the (un)subscriptions XPUB hands up: one per topic, the first subscriber's and the
        last one's leaving. Its descriptor signals edges only, so every operation on the socket
        is followed by reading until nothing is left."""
        sock = self._sock
        if sock is None:
            return
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not frame.endswith(b"\0"):
                continue  # no kvdepot topic
            model = "" if frame[1:] == EVENTS_ALL_MODELS else frame[1:-1].decode(errors="replace")
            if frame[0] == 1:
                self._models.add(model)
            elif frame[0] == 0:
                self._models.discard(model)

    @property
    def subscribed(self) -> set[str]:
        """The models a connector listens to ("": the all-models topic)."""
        return set(self._models)

    def stored(self, model: str, key: bytes) -> None:
        """``key``'s chunk (of ``model``) is readable (committed, or present when stored again)."""
        if model in self._models:
            self._stored.setdefault(model, []).append(key)
            self._schedule()

    def left(self, model: str, key: bytes) -> None:
        """``key`` left a tier; published as removed if no tier holds it at the end of the pass."""
        if model in self._models:
            self._left.setdefault(model, []).append(key)
            self._schedule()

    def cleared(self, model: str) -> None:
        """Every chunk of ``model`` ("": of every model) was flushed."""
        if model in self._models:
            self._cleared.add(model)
            self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self.publish)

    def publish(self) -> None:
        """Send what this pass gathered (one message per model)."""
        self._scheduled = False
        stored, left, cleared = self._stored, self._left, self._cleared
        self._stored, self._left, self._cleared = {}, {}, set()
        if self._sock is None:
            return
        in_depot = self._in_depot
        batches: dict[str, ChunkEventBatch] = {}
        for model in cleared:  # a flush of everything ("") or of a model: no key by key
            batches[model] = ChunkEventBatch(cleared=True)
            if model:
                left.pop(model, None)
            else:
                left = {}
        for model, keys in stored.items():
            ready = [k for k in dict.fromkeys(keys) if in_depot(k)]
            if ready:
                batches.setdefault(model, ChunkEventBatch()).stored = ready
        for model, keys in left.items():
            gone = [k for k in dict.fromkeys(keys) if not in_depot(k)]
            if gone:
                batches.setdefault(model, ChunkEventBatch()).removed = gone
        enc = msgspec.msgpack.encode
        for model, batch in batches.items():
            # (never blocks: a subscriber's queue past its high-water mark drops the message)
            self._sock.send_multipart([events_topic(model) if model else EVENTS_ALL_MODELS, enc(batch)], zmq.NOBLOCK)
            self.sent += 1
        self._subscriptions()

    def close(self) -> None:
        if self._sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
            self._sock.close(0)
            self._sock = None
            self._models.clear()
