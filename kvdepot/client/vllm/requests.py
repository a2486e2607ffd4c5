"""The scheduler side's state of one request (`RequestState`) and how its chunk keys are made
(`RequestKeys`): one shard-independent chain per request (`kvdepot.client.hashing`), each
tensor-parallel shard's keys that chain XOR the shard's mask of the request's namespace seed
(model, layout fingerprint, ``cache_salt``, LoRA adapter, reset epoch, chain source, attention)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvdepot.client.hashing import chain_from_block_hashes, chain_hashes, namespace_seed, shard_keys, shard_mask
from kvdepot.protocol import messages as m

NAMESPACES_KEPT = 4096  # (salt, chain source) -> seed and masks kept at most (`RequestKeys.namespace`)


@dataclasses.dataclass(slots=True)
class RequestState:
    """Scheduler-side state of one request (`kvdepot.client.vllm.scheduler.SchedulerConnector`)."""

    request: Any  # vllm.v1.request.Request
    seed_salt: str  # cache_salt plus LoRA / reset epoch: part of the key namespace
    cache_salt: str  # the request's cache_salt as is (Store.cache_salt, what `kvdepot flush` matches)
    keys: list[list[bytes]]  # per shard: keys of the whole chunks hashed so far
    chain: list[bytes]  # shard-independent chain values of those chunks (`kvdepot.client.hashing`)
    hashed_tokens: int  # tokens covered by ``keys`` (a multiple of chunk_size)
    seed: bytes = b""  # namespace seed of the chain (model, layout fingerprint, seed_salt, chain source)
    from_block_hashes: bool = False  # chain values from vLLM's block hashes (else hashed tokens)
    masks: list[bytes] = dataclasses.field(default_factory=list)  # per shard: `shard_mask` of seed
    lookup_rid: int | None = None  # outstanding Lookup
    lookup_sent_s: float = 0.0  # time.monotonic() it was sent
    hit_chunks: int | None = None  # the answer (None: not known yet)
    lookup_error: Any = None  # the daemon's refusal of it, or its loss (an `m.ErrorReply`), until handled
    pinned: bool = False  # a Lookup with pin_request was sent (EndRequest releases it)
    local_tokens: int = 0  # vLLM's own hit, as last given to get_num_new_matched_tokens
    next_store_chunk: int = 0  # chunks [0, next_store_chunk) are cached or being stored
    store_stopped: bool = False
    load_failed: bool = False  # a load of it failed: vLLM recomputes, the connector offers no more
    stored: bool = False  # a store of this request was sent to the workers (its loads: the scheduler's `_loading`)

    def answer(self, reply: m.Msg) -> None:
        """Its Lookup's reply, booked as the client reads it (`Connection.submit`'s
        ``on_reply``: every reply that came is booked in one pass, so that a later
        ``get_num_new_matched_tokens`` of the request finds its answer here). An error
        (`m.ErrorReply`) is kept for `SchedulerConnector._lookup_answer` to handle; a reply to
        another rid than ``lookup_rid`` is ignored."""
        if reply.rid != self.lookup_rid:
            return  # (a lookup given up since is `forget`-ed and never answered here)
        if reply.__class__ is m.ErrorReply:
            self.lookup_error = reply
            return
        hit = self.hit_chunks = reply.hit_chunks
        self.lookup_rid = None
        self.pinned = hit > 0  # a lookup without a hit pins nothing: no EndRequest
        if hit > self.next_store_chunk:
            self.next_store_chunk = hit  # those are cached already

    @property
    def answered(self) -> bool:
        """Its lookup's answer (or error) is in."""
        return self.hit_chunks is not None or self.lookup_error is not None


class RequestKeys:
    """Chunk keys of requests, for one engine.

    Args:
        chunk_size: tokens per chunk.
        model_id / fingerprint: the engine's model identity and layout fingerprint (`namespace_seed`).
        shards: the engine's shard names, one per tensor-parallel rank (`shard_name`).
        blocks_per_chunk: vLLM block hashes per chunk where the chain values are taken from them
            (`chain_from_block_hashes`), 0 where tokens are hashed here.
        chain_source / attention: `namespace_seed`'s arguments of the same names.
    """

    def __init__(self, chunk_size: int, model_id: str, fingerprint: str, shards: list[str], blocks_per_chunk: int,
                 chain_source: str, attention: str) -> None:
        self.chunk_size = chunk_size
        self.model_id = model_id
        self.fingerprint = fingerprint
        self.shards = shards
        self.blocks_per_chunk = blocks_per_chunk
        self.chain_source = chain_source
        self.attention = attention
        self._namespaces: dict[tuple[str, bool], tuple[bytes, list[bytes]]] = {}  # `namespace`

    @staticmethod
    def seed_salt(request, epoch: int = 0) -> tuple[str, str]:
        """(the salt of ``request``'s namespace, its ``cache_salt`` as is): the ``cache_salt``,
        plus its LoRA adapter and the engine's reset epoch (`SchedulerConnector.reset_cache`) where
        there are any."""
        cache_salt = request.cache_salt or ""
        salt = cache_salt
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            # an adapter changes the KV of the same tokens; engines name their adapters freely,
            # so the name alone could give another engine's adapter the same keys
            salt += f"\x00lora={lora.lora_name}\x00{getattr(lora, 'lora_path', '')}"
        if epoch:
            salt += f"\x00reset={epoch}"
        return salt, cache_salt

    def extend(self, st: RequestState, num_tokens: int) -> None:
        """Extend ``st``'s chain and keys to the whole chunks of its first ``num_tokens`` tokens.

        Raises:
            ValueError: vLLM gave fewer or shorter block hashes than its configuration says
                (`chain_from_block_hashes`). OverflowError: a token id outside [0, 2**32).
        """
        c = self.chunk_size
        end = num_tokens // c * c
        per = self.blocks_per_chunk
        if st.from_block_hashes:  # only chunks whose last block vLLM hashed (speculative lookahead)
            end = min(end, len(st.request.block_hashes) // per * c)
        if end <= st.hashed_tokens:
            return
        if not st.seed:
            st.seed, st.masks = self.namespace(st.seed_salt, st.from_block_hashes)
        if st.from_block_hashes:  # no token read: vLLM hashed them in its input thread
            new = chain_from_block_hashes(st.request.block_hashes, per, st.hashed_tokens // c, end // c)
        else:
            tokens = (st.request.prompt_token_ids if end <= len(st.request.prompt_token_ids)
                      else st.request.all_token_ids)[st.hashed_tokens:end]
            new = chain_hashes(st.chain[-1] if st.chain else st.seed, tokens, c)  # each token hashed once
        st.chain.extend(new)
        for chain, keys in zip(st.keys, shard_keys(new, st.masks)):
            chain.extend(keys)
        st.hashed_tokens = end

    def namespace(self, seed_salt: str, from_block_hashes: bool) -> tuple[bytes, list[bytes]]:
        """The namespace seed of a request's chain and its shards' masks, made once per
        (``seed_salt``, chain source): most requests share a few salts (none, a tenant's)."""
        got = self._namespaces.get((seed_salt, from_block_hashes))
        if got is None:
            if len(self._namespaces) >= NAMESPACES_KEPT:
                self._namespaces.clear()  # many tenants: made again as they come
            seed = namespace_seed(self.model_id, self.fingerprint, seed_salt,
                                  self.chain_source if from_block_hashes else "", self.attention)
            got = self._namespaces[(seed_salt, from_block_hashes)] = seed, [shard_mask(seed, s) for s in self.shards]
        return got
