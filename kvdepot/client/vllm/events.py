"""KV events for routers (`DepotEvents`): what the depot holds of this engine's prompts, as vLLM's
own KV events (``--kv-events-config``; vLLM's scheduler publishes what the connector's
``take_events`` yields, e.g. through its ``ZmqEventPublisher``):

* ``BlockStored`` once the daemon committed a chunk this engine stored: the chunk's vLLM block
  hashes (vLLM's ``hash_block_size`` blocks, ``parent_block_hash`` the block before the chunk),
  its tokens, the request's LoRA name, ``medium="CPU"`` (the depot's pinned host memory; a
  chunk that moves on to the depot's disk stays held and is not announced again);
* ``BlockRemoved`` (same hashes, ``medium="CPU"``) once it left the depot: evicted from its last
  tier, flushed, dropped as corrupt;
* ``AllBlocksCleared`` after a flush of every chunk of the model (or of every model).

The daemon publishes chunk keys per model (`kvdepot.server.events`); this side subscribes to its
own model's topic, so events of other models never reach it, and reports only chunks it planned
to store itself (it maps their keys back to vLLM's block hashes), so those of another tenant
(``cache_salt``) or engine never appear as its own. With tensor parallelism rank 0's keys speak
for the engine. Memory is bounded: at most `PENDING_CHUNKS` chunks wait for their commit and
`HELD_CHUNKS` are remembered for their removal (the oldest beyond are forgotten: their removal
is then not reported, which leaves a router's entry stale, never wrong KV).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import msgspec
import zmq

from kvdepot.protocol.messages import EVENTS_ALL_MODELS, ChunkEventBatch, events_topic
from kvdepot.protocol.transport import events_endpoint

log = logging.getLogger("kvdepot.vllm")

PENDING_CHUNKS = 1 << 14
HELD_CHUNKS = 1 << 16
MEDIUM = "CPU"
_MAX_MESSAGES_PER_STEP = 256  # a step reads at most this many of the daemon's messages


class _Chunk(msgspec.Struct, gc=False):
    block_hashes: list  # vLLM's (external) block hashes of the chunk's hash blocks
    parent: object  # the hash of the block before the chunk, or None
    token_ids: list[int]
    lora_name: str | None
    lora_id: int | None


class DepotEvents:
    """The scheduler side's KV events (see the module docstring).

    Args:
        endpoint: the daemon's endpoint (events come from `events_endpoint` of it: ``ipc://`` only).
        model_id: the model label the workers register with (the daemon's topic).
        hash_block_size: tokens per vLLM block hash.
        chunk_size: tokens per chunk.
    """

    def __init__(self, endpoint: str, model_id: str, hash_block_size: int, chunk_size: int) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._stored_cls, self._removed_cls, self._cleared_cls = BlockStored, BlockRemoved, AllBlocksCleared
        self._convert = maybe_convert_block_hash
        self.hash_block_size = hash_block_size
        self.per_chunk = chunk_size // hash_block_size
        self.chunk_size = chunk_size
        self._pending: OrderedDict[bytes, _Chunk] = OrderedDict()  # planned, not committed yet
        self._held: OrderedDict[bytes, list] = OrderedDict()  # committed: key -> its block hashes
        self._decode = msgspec.msgpack.Decoder(ChunkEventBatch).decode
        self._sock: zmq.Socket | None = None
        ep = events_endpoint(endpoint)
        if ep is None:
            log.warning("kvdepot: no KV events: the daemon publishes them on ipc:// endpoints only (%s)", endpoint)
            return
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        for t in (events_topic(model_id), EVENTS_ALL_MODELS):
            sock.setsockopt(zmq.SUBSCRIBE, t)
        sock.connect(ep)  # (ZMQ connects when the daemon binds, and again after its restart)
        self._sock = sock

    def planned(self, key: bytes, chunk: int, request) -> None:
        """Chunk ``chunk`` of ``request`` (a vLLM ``Request``) is to be stored under ``key``
        (rank 0's); skipped where vLLM has not hashed its blocks."""
        n = self.per_chunk
        hashes = request.block_hashes
        lo, hi = chunk * n, (chunk + 1) * n
        if len(hashes) < hi:
            return
        conv = self._convert
        lora = request.lora_request
        c = self.chunk_size
        self._pending[key] = _Chunk([conv(h) for h in hashes[lo:hi]], conv(hashes[lo - 1]) if lo else None,
                                    list(request.all_token_ids[chunk * c:(chunk + 1) * c]),
                                    lora.name if lora is not None else None,
                                    lora.adapter_id if lora is not None else None)
        if len(self._pending) > PENDING_CHUNKS:
            self._pending.popitem(last=False)

    def take(self) -> list:
        """vLLM ``KVCacheEvent``s of the daemon's messages received since the last call (never
        waits)."""
        sock = self._sock
        if sock is None:
            return []
        out = []
        for _ in range(_MAX_MESSAGES_PER_STEP):
            try:
                _, body = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                batch = self._decode(body)
            except msgspec.DecodeError:
                log.warning("kvdepot: an undecodable chunk event from the daemon was dropped")
                continue
            if batch.cleared:
                self._held.clear()
                out.append(self._cleared_cls())
            for key in batch.stored:
                ch = self._pending.pop(key, None)
                if ch is None:
                    continue  # not this engine's (or announced already)
                self._held[key] = ch.block_hashes
                if len(self._held) > HELD_CHUNKS:
                    self._held.popitem(last=False)
                out.append(self._stored_cls(block_hashes=ch.block_hashes, parent_block_hash=ch.parent,
                                            token_ids=ch.token_ids, block_size=self.hash_block_size,
                                            lora_id=ch.lora_id, medium=MEDIUM, lora_name=ch.lora_name))
            removed = []
            for key in batch.removed:
                hashes = self._held.pop(key, None)
                if hashes is not None:
                    removed.extend(hashes)
            if removed:
                out.append(self._removed_cls(block_hashes=removed, medium=MEDIUM))
        return out

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
