"""Chunk keys: deterministic, namespaced, prefix-chained hashes of token chunks.

::

    seed = H("kvdepot-chunk-key" | HASH_VERSION | model | layout_fingerprint | shard | cache_salt)
    h_0  = H(seed    || tokens[0 : C])
    h_i  = H(h_{i-1} || tokens[i*C : (i+1)*C])          C = chunk_size

H is BLAKE2b with a 16-byte digest (stdlib hashlib: identical on every process, host and
restart; never Python's ``hash()``). Tokens are hashed as little-endian uint32. Namespace
fields are length-prefixed so no two namespaces collide by concatenation. Two tenants
(different ``cache_salt``) or two shards never share a key, and a key fixes the meaning of the
object's bytes (the layout fingerprint), never the engine's physical layout.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

HASH_ALGORITHM = "blake2b-128"
HASH_VERSION = 1
KEY_BYTES = 16


def _lp(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<I", len(b)) + b


def shard_name(tp_rank: int, tp_size: int) -> str:
    """Shard label for dense attention: ``"tp{rank}of{size}"``. MLA uses ``"replicated"``."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} not in [0, {tp_size})")
    return f"tp{tp_rank}of{tp_size}"


def namespace_seed(model: str, layout_fingerprint: str, shard: str, cache_salt: str = "") -> bytes:
    """The 16-byte seed of every chunk chain of one (model, object format, shard, tenant)."""
    msg = b"kvdepot-chunk-key" + _lp(f"{HASH_ALGORITHM}/v{HASH_VERSION}") + _lp(model) + _lp(layout_fingerprint) \
        + _lp(shard) + _lp(cache_salt)
    return hashlib.blake2b(msg, digest_size=KEY_BYTES).digest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    a = array("I", tokens)  # raises OverflowError for ids outside [0, 2**32)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def chunk_keys(seed: bytes, token_ids: Sequence[int], chunk_size: int, max_chunks: int | None = None) -> list[bytes]:
    """Keys of the whole chunks of ``token_ids`` (a trailing partial chunk gets no key).

    Args:
        seed: from `namespace_seed`.
        token_ids: the prompt's token ids (ints in [0, 2**32)).
        chunk_size: tokens per chunk.
        max_chunks: stop after this many keys.
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be > 0")
    n = len(token_ids) // chunk_size
    if max_chunks is not None:
        n = min(n, max_chunks)
    data = _token_bytes(token_ids[: n * chunk_size])
    step = chunk_size * 4
    keys = []
    prev = seed
    for i in range(n):
        prev = hashlib.blake2b(prev + data[i * step : (i + 1) * step], digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys
