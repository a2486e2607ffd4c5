"""Chunk keys: deterministic, namespaced, prefix-chained hashes of token chunks.

::

    seed   = H("kvdepot-chunk-key" | "blake2b-128/v2" | model | layout_fingerprint | cache_salt)
    h_0    = H(seed    || tokens[0 : C])
    h_i    = H(h_{i-1} || tokens[i*C : (i+1)*C])          C = chunk_size
    mask_s = H("kvdepot-shard-mask" | seed | shard)
    key    = h_i XOR mask_s                                 the key of chunk i of shard s

H is BLAKE2b with a 16-byte digest (stdlib hashlib: identical on every process, host and
restart; never Python's ``hash()``, and not vLLM's own block hashes, whose chain starts from
a random value per process unless PYTHONHASHSEED is set). Tokens are hashed as little-endian
uint32. Namespace fields are length-prefixed so no two namespaces collide by concatenation.

The token chain is shard-independent: a tensor-parallel engine hashes each chunk's tokens
once, and each shard's keys are the chain XOR one 16-byte mask (one vectorized pass over all
shards). Two shards' keys of the same chunk differ by ``mask_s ^ mask_t``; two keys collide
only if two chain values differ by exactly that, which is as hard as a BLAKE2b collision.
Two tenants (different ``cache_salt``) or two shards never share a key, and a key fixes the
meaning of the object's bytes (the layout fingerprint), never the engine's physical layout.

The vLLM connector takes its chain values from vLLM's own prefix-cache block hashes where
vLLM makes them reproducible (`chain_from_block_hashes`: SHA-256, chained from a fixed seed
since vLLM 0.33), so it reads no token at all; `chain_hashes` is for every other client and
for vLLM engines configured otherwise. The two never share a key (`namespace_seed`'s
``chain_source``).

Cost (2-core dev VM, `benchmarks/keys.py`): a 131072-token prompt, 256-token chunks, keys for
8 shards: 1.9-2.4 ms (packing the tokens ~0.75, BLAKE2b ~0.65, per-chunk overhead, masks 0.1),
against 13-35 ms when every shard hashed the tokens itself.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

import numpy as np

HASH_ALGORITHM = "blake2b-128"
HASH_VERSION = 2
KEY_BYTES = 16
_BATCH_TOKENS = 4096  # tokens packed at a time: 16 KiB, well below malloc's mmap threshold


def _lp(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<I", len(b)) + b


def shard_name(tp_rank: int, tp_size: int) -> str:
    """Shard label for dense attention: ``"tp{rank}of{size}"``. MLA uses ``"replicated"``."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} not in [0, {tp_size})")
    return f"tp{tp_rank}of{tp_size}"


def namespace_seed(model: str, layout_fingerprint: str, cache_salt: str = "", chain_source: str = "",
                   attention: str = "") -> bytes:
    """The 16-byte seed of every chunk chain of one (model, object format, tenant); the shard
    enters through `shard_mask`. ``chain_source``: empty for chains of `chain_hashes` (this
    module's token hashing), else what made the chain values (`VLLM_BLOCK_HASH_SOURCE`), so
    the two kinds of chains never share a key. ``attention``: empty for full attention, else
    which blocks of a chunk the engine may leave out (sliding windows, local-attention chunks:
    `kvdepot.client.vllm.layout.attention_tag`): such an engine's stores hold whatever its null
    block held where it had let a block go, so engines that keep other blocks must not share
    its keys. Empty arguments leave the seed as it was without them."""
    msg = b"kvdepot-chunk-key" + _lp(f"{HASH_ALGORITHM}/v{HASH_VERSION}") + _lp(model) + _lp(layout_fingerprint) \
        + _lp(cache_salt)
    if chain_source or attention:
        msg += _lp(chain_source)
    if attention:
        msg += _lp("attention=" + attention)
    return hashlib.blake2b(msg, digest_size=KEY_BYTES).digest()


def shard_mask(seed: bytes, shard: str) -> bytes:
    """The 16 bytes XORed into the chain of ``seed`` to give ``shard``'s keys."""
    return hashlib.blake2b(b"kvdepot-shard-mask" + _lp(seed) + _lp(shard), digest_size=KEY_BYTES).digest()


def _token_words(tokens: Sequence[int]) -> memoryview:
    """``tokens`` as little-endian uint32 bytes (a view of one array: no copy of the bytes)."""
    a = array("I", tokens)  # raises OverflowError for ids outside [0, 2**32)
    if a.itemsize != 4:
        a = array("L", tokens)
    if sys.byteorder != "little":
        a.byteswap()
    return memoryview(a).cast("B")


def chain_hashes(prev: bytes, token_ids: Sequence[int], chunk_size: int, max_chunks: int | None = None
                 ) -> list[bytes]:
    """The shard-independent chain values ``h_i`` of the whole chunks of ``token_ids`` (a
    trailing partial chunk gets none).

    Args:
        prev: the chain value before the first chunk: `namespace_seed` for chunk 0, else the
            last ``h`` of the chunks before (so a chain is extended without hashing it again).
        token_ids: ints in [0, 2**32).
        chunk_size: tokens per chunk.
        max_chunks: stop after this many.

    Raises:
        ValueError: ``chunk_size <= 0``. OverflowError: a token id outside [0, 2**32).
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be > 0")
    n = len(token_ids) // chunk_size
    if max_chunks is not None:
        n = min(n, max_chunks)
    if n <= 0:
        return []
    # tokens are packed in batches of whole chunks of at most _BATCH_TOKENS: one array of a
    # long prompt is a fresh mmap per call, whose page faults cost more than the hashing
    step = chunk_size * 4
    per_batch = max(1, _BATCH_TOKENS // chunk_size)
    out = []
    blake2b = hashlib.blake2b
    for b0 in range(0, n, per_batch):
        b1 = min(n, b0 + per_batch)
        data = _token_words(token_ids[b0 * chunk_size : b1 * chunk_size])
        for i in range(b1 - b0):
            h = blake2b(prev, digest_size=KEY_BYTES)
            h.update(data[i * step : (i + 1) * step])
            prev = h.digest()
            out.append(prev)
    return out


VLLM_BLOCK_HASH_SOURCE = "vllm-block-hash/{algo}"  # `namespace_seed` chain_source of `chain_from_block_hashes`


def chain_from_block_hashes(block_hashes: Sequence[bytes], blocks_per_chunk: int, first_chunk: int,
                            end_chunk: int) -> list[bytes]:
    """Chain values of chunks ``[first_chunk, end_chunk)`` taken from vLLM's own prefix-cache
    block hashes (``vllm.v1.request.Request.block_hashes``: one per ``hash_block_size`` tokens,
    each chained over the whole prefix before it and over the request's extra keys: LoRA,
    ``cache_salt``, multimodal inputs): chunk ``i``'s value is the first 16 bytes of the hash
    of its last block. No token is read: vLLM hashed them already (in its input thread).

    Used only with a collision-resistant vLLM hash (sha256, sha256_cbor: 32 bytes), whose chain
    vLLM starts from a fixed seed (``vllm-none-hash``, or ``PYTHONHASHSEED`` where set), so the
    values are the same on every process and host. The namespace (model, layout fingerprint,
    tenant, shard) enters through the key's mask, as the shard does (`shard_keys`): two
    namespaces' keys of two chunks are equal only if the chunks' truncated SHA-256 values differ
    by exactly the XOR of the two masks.

    Raises:
        ValueError: fewer hashes than ``end_chunk`` chunks need, or a hash shorter than 16 bytes.
    """
    if end_chunk <= first_chunk:
        return []
    if end_chunk * blocks_per_chunk > len(block_hashes):
        raise ValueError(f"chunk {end_chunk - 1} needs {end_chunk * blocks_per_chunk} block hashes; "
                         f"the request has {len(block_hashes)}")
    out = [h[:KEY_BYTES] for h in block_hashes[(first_chunk + 1) * blocks_per_chunk - 1:
                                              end_chunk * blocks_per_chunk:blocks_per_chunk]]
    if any(len(h) != KEY_BYTES for h in out):
        raise ValueError(f"a block hash shorter than {KEY_BYTES} bytes")
    return out


_SMALL_KEYS = 32  # up to this many keys (chunks x shards) `shard_keys` XORs ints; beyond, numpy is faster


def shard_keys(chain: Sequence[bytes], masks: Sequence[bytes]) -> list[list[bytes]]:
    """Per mask (shard), the keys of ``chain``: ``[[h ^ mask for h in chain] for mask in masks]``."""
    if not chain:
        return [[] for _ in masks]
    if len(chain) * len(masks) <= _SMALL_KEYS:
        # a step's few chunks: plain ints (numpy's per-call cost, cold after a forward, was
        # measured at ~100 us per call on the vLLM worker's transfer thread)
        frm = int.from_bytes
        out = []
        for mask in masks:
            mi = frm(mask, "little")
            out.append([(frm(h, "little") ^ mi).to_bytes(KEY_BYTES, "little") for h in chain])
        return out
    h = np.frombuffer(b"".join(chain), dtype=np.uint8).reshape(1, -1, KEY_BYTES)
    m = np.frombuffer(b"".join(masks), dtype=np.uint8).reshape(-1, 1, KEY_BYTES)
    keys = np.bitwise_xor(h, m)  # [shards, chunks, 16]
    return [row.view(f"V{KEY_BYTES}").ravel().tolist() for row in keys]


def chunk_keys(seed: bytes, token_ids: Sequence[int], chunk_size: int, shard: str,
               max_chunks: int | None = None) -> list[bytes]:
    """One shard's keys of the whole chunks of ``token_ids`` (see `chain_hashes`)."""
    return shard_keys(chain_hashes(seed, token_ids, chunk_size, max_chunks), [shard_mask(seed, shard)])[0]
