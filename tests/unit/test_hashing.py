"""kvdepot.client.hashing: deterministic, namespaced, prefix-chained chunk keys."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import subprocess
import sys

import pytest

from kvdepot.client.hashing import (
    HASH_ALGORITHM, HASH_VERSION, KEY_BYTES, chunk_keys, namespace_seed, shard_name,
)

MODEL = "meta-llama/Llama-3.1-8B@main"
FINGERPRINT = "0123456789abcdef0123456789abcdef"
CHUNK = 16


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128256) for _ in range(n)]  # Llama-3 vocabulary


def test_keys_are_16_bytes_and_wire_valid(seed):
    keys = chunk_keys(namespace_seed(MODEL, FINGERPRINT, "tp0of1"), _tokens(seed, 5 * CHUNK), CHUNK)
    assert len(keys) == 5 and KEY_BYTES == 16
    assert all(type(k) is bytes and len(k) == 16 for k in keys)
    assert len(set(keys)) == 5


def test_known_answer_follows_the_documented_construction():
    """Re-derive the keys from the module's documented formula; a change here changes every
    stored key and needs a new HASH_VERSION."""

    def lp(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<I", len(b)) + b

    ns = b"kvdepot-chunk-key" + lp("blake2b-128/v1") + lp(MODEL) + lp(FINGERPRINT) + lp("tp1of2") + lp("t")
    seed = hashlib.blake2b(ns, digest_size=16).digest()
    tokens = list(range(0, 3 * 4)) + [2**32 - 1, 0x01020304, 7]
    h0 = hashlib.blake2b(seed + struct.pack("<4I", *tokens[0:4]), digest_size=16).digest()
    h1 = hashlib.blake2b(h0 + struct.pack("<4I", *tokens[4:8]), digest_size=16).digest()
    h2 = hashlib.blake2b(h1 + struct.pack("<4I", *tokens[8:12]), digest_size=16).digest()
    h3 = hashlib.blake2b(h2 + struct.pack("<4I", *tokens[12:15], 9), digest_size=16).digest()
    assert (HASH_ALGORITHM, HASH_VERSION) == ("blake2b-128", 1)
    assert namespace_seed(MODEL, FINGERPRINT, "tp1of2", "t") == seed
    assert chunk_keys(seed, tokens, 4) == [h0, h1, h2]  # tokens 12..14 are a partial chunk
    assert chunk_keys(seed, tokens + [9], 4) == [h0, h1, h2, h3]


_CHILD = """
import sys
from kvdepot.client.hashing import chunk_keys, namespace_seed
seed = namespace_seed({model!r}, {fp!r}, "tp0of2", "tenant")
print(" ".join(k.hex() for k in chunk_keys(seed, {tokens!r}, {chunk})))
"""


@pytest.mark.parametrize("hashseed", ["0", "12345"])
def test_keys_deterministic_across_processes(hashseed, seed):
    tokens = _tokens(seed, 4 * CHUNK + 3)
    here = [k.hex() for k in chunk_keys(namespace_seed(MODEL, FINGERPRINT, "tp0of2", "tenant"), tokens, CHUNK)]
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    code = _CHILD.format(model=MODEL, fp=FINGERPRINT, tokens=tokens, chunk=CHUNK)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == here
    assert len(here) == 4


def test_prefix_chaining(seed):
    ns = namespace_seed(MODEL, FINGERPRINT, "tp0of1")
    base = _tokens(seed, 6 * CHUNK)
    keys = chunk_keys(ns, base, CHUNK)
    # a shared prefix gives identical leading keys, whatever follows
    other_tail = base[: 3 * CHUNK] + _tokens(seed + 1, 3 * CHUNK)
    k2 = chunk_keys(ns, other_tail, CHUNK)
    assert k2[:3] == keys[:3]
    assert all(a != b for a, b in zip(k2[3:], keys[3:]))
    # one token changed in chunk 2 changes key 2 and every later key, even identical chunks
    changed = list(base)
    changed[2 * CHUNK + 5] ^= 1
    k3 = chunk_keys(ns, changed, CHUNK)
    assert k3[:2] == keys[:2]
    assert all(a != b for a, b in zip(k3[2:], keys[2:]))
    # a chunk's key depends on its position in the chain, not only on its tokens
    same = base[:CHUNK] * 3
    k4 = chunk_keys(ns, same, CHUNK)
    assert len(set(k4)) == 3


def test_token_order_and_chunk_boundaries_matter(seed):
    ns = namespace_seed(MODEL, FINGERPRINT, "tp0of1")
    toks = _tokens(seed, 2 * CHUNK)
    swapped = list(toks)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    if swapped != toks:
        assert chunk_keys(ns, swapped, CHUNK)[0] != chunk_keys(ns, toks, CHUNK)[0]
    # 2 chunks of 16 are not 1 chunk of 32 (the chain, not the concatenation, is hashed)
    assert chunk_keys(ns, toks, 2 * CHUNK)[0] not in chunk_keys(ns, toks, CHUNK)
    # token ids are 4 bytes: [1, 0] is not [256] nor [0, 1]
    assert len({chunk_keys(ns, t, 2)[0] for t in ([1, 0], [0, 1], [256, 0], [0, 256])}) == 4


@pytest.mark.parametrize("field", ["model", "fingerprint", "shard", "cache_salt"])
def test_namespace_separation(field, seed):
    base = dict(model=MODEL, layout_fingerprint=FINGERPRINT, shard="tp0of2", cache_salt="")
    variants = {
        "model": ["meta-llama/Llama-3.1-8B@other", "Mistral-7B-v0.3"],
        "fingerprint": ["f" * 32, FINGERPRINT.upper()],
        "shard": ["tp1of2", "tp0of4", "replicated"],
        "cache_salt": ["tenant-a", "tenant-b", " "],
    }[field]
    key = "layout_fingerprint" if field == "fingerprint" else field
    tokens = _tokens(seed, 3 * CHUNK)
    ref = chunk_keys(namespace_seed(**base), tokens, CHUNK)
    seen = set(ref)
    for v in variants:
        keys = chunk_keys(namespace_seed(**{**base, key: v}), tokens, CHUNK)
        assert not seen & set(keys), f"{field}={v!r} shares keys"
        seen |= set(keys)


def test_namespace_fields_do_not_collide_by_concatenation():
    seeds = {
        namespace_seed("ab", "c", "s"),
        namespace_seed("a", "bc", "s"),
        namespace_seed("a", "b", "cs"),
        namespace_seed("a", "b", "c", "s"),
        namespace_seed("a", "b", "c", ""),
        namespace_seed("a", "b", "c"),  # cache_salt defaults to "": same as the previous one
    }
    assert len(seeds) == 5


def test_partial_trailing_chunk_gets_no_key(seed):
    ns = namespace_seed(MODEL, FINGERPRINT, "tp0of1")
    toks = _tokens(seed, 3 * CHUNK)
    full = chunk_keys(ns, toks, CHUNK)
    assert chunk_keys(ns, toks[: 3 * CHUNK - 1], CHUNK) == full[:2]
    assert chunk_keys(ns, toks[: 2 * CHUNK + 1], CHUNK) == full[:2]
    assert chunk_keys(ns, toks[: CHUNK - 1], CHUNK) == []
    assert chunk_keys(ns, [], CHUNK) == []
    assert chunk_keys(ns, toks, CHUNK, max_chunks=2) == full[:2]
    assert chunk_keys(ns, toks, CHUNK, max_chunks=0) == []
    assert chunk_keys(ns, toks, CHUNK, max_chunks=10) == full
    assert chunk_keys(ns, tuple(toks), CHUNK) == full


def test_token_range():
    ns = namespace_seed(MODEL, FINGERPRINT, "tp0of1")
    assert len(chunk_keys(ns, [0, 2**32 - 1], 2)) == 1
    with pytest.raises(OverflowError):
        chunk_keys(ns, [0, 2**32], 2)
    with pytest.raises(OverflowError):
        chunk_keys(ns, [-1, 0], 2)
    for bad in (0, -16):
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_keys(ns, [1, 2], bad)


def test_shard_name():
    assert shard_name(0, 1) == "tp0of1"
    assert shard_name(3, 8) == "tp3of8"
    assert len({shard_name(r, 4) for r in range(4)}) == 4
    for rank, size in [(1, 1), (-1, 2), (0, 0), (4, 4), (0, -1)]:
        with pytest.raises(ValueError, match="tp_rank"):
            shard_name(rank, size)
