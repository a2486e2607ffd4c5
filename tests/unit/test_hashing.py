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
    HASH_ALGORITHM, HASH_VERSION, KEY_BYTES, chain_hashes, chunk_keys, namespace_seed, shard_keys, shard_mask,
    shard_name,
)

MODEL = "meta-llama/Llama-3.1-8B@main"
FINGERPRINT = "0123456789abcdef0123456789abcdef"
CHUNK = 16


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128256) for _ in range(n)]  # Llama-3 vocabulary


def test_keys_are_16_bytes_and_wire_valid(seed):
    keys = chunk_keys(namespace_seed(MODEL, FINGERPRINT), _tokens(seed, 5 * CHUNK), CHUNK, "tp0of1")
    assert len(keys) == 5 and KEY_BYTES == 16
    assert all(type(k) is bytes and len(k) == 16 for k in keys)
    assert len(set(keys)) == 5


def test_known_answer_follows_the_documented_construction():
    """Re-derive the keys from the module's documented formula; a change here changes every
    stored key and needs a new HASH_VERSION."""

    def lp(s: str | bytes) -> bytes:
        b = s.encode() if isinstance(s, str) else s
        return struct.pack("<I", len(b)) + b

    ns = b"kvdepot-chunk-key" + lp("blake2b-128/v2") + lp(MODEL) + lp(FINGERPRINT) + lp("t")
    seed = hashlib.blake2b(ns, digest_size=16).digest()
    mask = hashlib.blake2b(b"kvdepot-shard-mask" + lp(seed) + lp("tp1of2"), digest_size=16).digest()
    tokens = list(range(0, 3 * 4)) + [2**32 - 1, 0x01020304, 7]
    h0 = hashlib.blake2b(seed + struct.pack("<4I", *tokens[0:4]), digest_size=16).digest()
    h1 = hashlib.blake2b(h0 + struct.pack("<4I", *tokens[4:8]), digest_size=16).digest()
    h2 = hashlib.blake2b(h1 + struct.pack("<4I", *tokens[8:12]), digest_size=16).digest()
    h3 = hashlib.blake2b(h2 + struct.pack("<4I", *tokens[12:15], 9), digest_size=16).digest()

    def xor(a: bytes, b: bytes) -> bytes:
        return bytes(x ^ y for x, y in zip(a, b))

    assert (HASH_ALGORITHM, HASH_VERSION) == ("blake2b-128", 2)
    assert namespace_seed(MODEL, FINGERPRINT, "t") == seed
    assert shard_mask(seed, "tp1of2") == mask
    assert chain_hashes(seed, tokens, 4) == [h0, h1, h2]  # tokens 12..14 are a partial chunk
    assert chunk_keys(seed, tokens, 4, "tp1of2") == [xor(h, mask) for h in (h0, h1, h2)]
    assert chunk_keys(seed, tokens + [9], 4, "tp1of2") == [xor(h, mask) for h in (h0, h1, h2, h3)]
    # a chain is extended from its last value without hashing it again
    assert chain_hashes(h1, tokens[8:] + [9], 4) == [h2, h3]


_CHILD = """
import sys
from kvdepot.client.hashing import chunk_keys, namespace_seed
seed = namespace_seed({model!r}, {fp!r}, "tenant")
print(" ".join(k.hex() for k in chunk_keys(seed, {tokens!r}, {chunk}, "tp0of2")))
"""


@pytest.mark.parametrize("hashseed", ["0", "12345"])
def test_keys_deterministic_across_processes(hashseed, seed):
    tokens = _tokens(seed, 4 * CHUNK + 3)
    here = [k.hex() for k in chunk_keys(namespace_seed(MODEL, FINGERPRINT, "tenant"), tokens, CHUNK, "tp0of2")]
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    code = _CHILD.format(model=MODEL, fp=FINGERPRINT, tokens=tokens, chunk=CHUNK)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == here
    assert len(here) == 4


def test_prefix_chaining(seed):
    ns = namespace_seed(MODEL, FINGERPRINT)
    base = _tokens(seed, 6 * CHUNK)
    keys = chunk_keys(ns, base, CHUNK, "tp0of1")
    # a shared prefix gives identical leading keys, whatever follows
    other_tail = base[: 3 * CHUNK] + _tokens(seed + 1, 3 * CHUNK)
    k2 = chunk_keys(ns, other_tail, CHUNK, "tp0of1")
    assert k2[:3] == keys[:3]
    assert all(a != b for a, b in zip(k2[3:], keys[3:]))
    # one token changed in chunk 2 changes key 2 and every later key, even identical chunks
    changed = list(base)
    changed[2 * CHUNK + 5] ^= 1
    k3 = chunk_keys(ns, changed, CHUNK, "tp0of1")
    assert k3[:2] == keys[:2]
    assert all(a != b for a, b in zip(k3[2:], keys[2:]))
    # a chunk's key depends on its position in the chain, not only on its tokens
    same = base[:CHUNK] * 3
    k4 = chunk_keys(ns, same, CHUNK, "tp0of1")
    assert len(set(k4)) == 3


def test_token_order_and_chunk_boundaries_matter(seed):
    ns = namespace_seed(MODEL, FINGERPRINT)
    toks = _tokens(seed, 2 * CHUNK)
    swapped = list(toks)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    if swapped != toks:
        assert chunk_keys(ns, swapped, CHUNK, "tp0of1")[0] != chunk_keys(ns, toks, CHUNK, "tp0of1")[0]
    # 2 chunks of 16 are not 1 chunk of 32 (the chain, not the concatenation, is hashed)
    assert chunk_keys(ns, toks, 2 * CHUNK, "tp0of1")[0] not in chunk_keys(ns, toks, CHUNK, "tp0of1")
    # token ids are 4 bytes: [1, 0] is not [256] nor [0, 1]
    assert len({chunk_keys(ns, t, 2, "tp0of1")[0] for t in ([1, 0], [0, 1], [256, 0], [0, 256])}) == 4


@pytest.mark.parametrize("field", ["model", "fingerprint", "shard", "cache_salt"])
def test_namespace_separation(field, seed):
    base = dict(model=MODEL, layout_fingerprint=FINGERPRINT, cache_salt="")
    variants = {
        "model": ["meta-llama/Llama-3.1-8B@other", "Mistral-7B-v0.3"],
        "fingerprint": ["f" * 32, FINGERPRINT.upper()],
        "shard": ["tp1of2", "tp0of4", "replicated"],
        "cache_salt": ["tenant-a", "tenant-b", " "],
    }[field]
    key = "layout_fingerprint" if field == "fingerprint" else field
    tokens = _tokens(seed, 3 * CHUNK)
    ref = chunk_keys(namespace_seed(**base), tokens, CHUNK, "tp0of2")
    seen = set(ref)
    for v in variants:
        if field == "shard":
            keys = chunk_keys(namespace_seed(**base), tokens, CHUNK, v)
        else:
            keys = chunk_keys(namespace_seed(**{**base, key: v}), tokens, CHUNK, "tp0of2")
        assert not seen & set(keys), f"{field}={v!r} shares keys"
        seen |= set(keys)


def test_shard_keys_of_one_chain_match_per_shard_keys(seed):
    """The scheduler hashes a prompt once and masks it per shard: the same keys as hashing it
    for each shard alone, whatever the number of shards."""
    ns = namespace_seed(MODEL, FINGERPRINT, "tenant")
    tokens = _tokens(seed, 7 * CHUNK + 5)
    shards = [shard_name(r, 8) for r in range(8)]
    chain = chain_hashes(ns, tokens, CHUNK)
    got = shard_keys(chain, [shard_mask(ns, s) for s in shards])
    assert got == [chunk_keys(ns, tokens, CHUNK, s) for s in shards]
    assert all(type(k) is bytes and len(k) == 16 for row in got for k in row)
    assert len({k for row in got for k in row}) == 8 * 7
    assert shard_keys([], [shard_mask(ns, s) for s in shards]) == [[]] * 8
    # masks with zero bytes at the end are kept whole (numpy's fixed-width bytes would strip them)
    assert shard_keys([bytes(16)], [bytes(15) + b"\x01", bytes(16)]) == [[bytes(15) + b"\x01"], [bytes(16)]]


def test_namespace_fields_do_not_collide_by_concatenation():
    seeds = {
        namespace_seed("ab", "c", "s"),
        namespace_seed("a", "bc", "s"),
        namespace_seed("a", "b", "cs"),
        namespace_seed("a", "b", ""),
        namespace_seed("a", "b"),  # cache_salt defaults to "": same as the previous one
    }
    assert len(seeds) == 4
    ns = namespace_seed("a", "b")
    assert shard_mask(ns, "tp0of2") != shard_mask(ns, "tp1of2") != shard_mask(namespace_seed("a", "c"), "tp1of2")


def test_partial_trailing_chunk_gets_no_key(seed):
    ns = namespace_seed(MODEL, FINGERPRINT)
    toks = _tokens(seed, 3 * CHUNK)
    full = chunk_keys(ns, toks, CHUNK, "tp0of1")
    assert chunk_keys(ns, toks[: 3 * CHUNK - 1], CHUNK, "tp0of1") == full[:2]
    assert chunk_keys(ns, toks[: 2 * CHUNK + 1], CHUNK, "tp0of1") == full[:2]
    assert chunk_keys(ns, toks[: CHUNK - 1], CHUNK, "tp0of1") == []
    assert chunk_keys(ns, [], CHUNK, "tp0of1") == []
    assert chunk_keys(ns, toks, CHUNK, "tp0of1", max_chunks=2) == full[:2]
    assert chunk_keys(ns, toks, CHUNK, "tp0of1", max_chunks=0) == []
    assert chunk_keys(ns, toks, CHUNK, "tp0of1", max_chunks=10) == full
    assert chunk_keys(ns, tuple(toks), CHUNK, "tp0of1") == full


def test_token_range():
    ns = namespace_seed(MODEL, FINGERPRINT)
    assert len(chunk_keys(ns, [0, 2**32 - 1], 2, "tp0of1")) == 1
    with pytest.raises(OverflowError):
        chunk_keys(ns, [0, 2**32], 2, "tp0of1")
    with pytest.raises(OverflowError):
        chunk_keys(ns, [-1, 0], 2, "tp0of1")
    for bad in (0, -16):
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_keys(ns, [1, 2], bad, "tp0of1")


def test_shard_name():
    assert shard_name(0, 1) == "tp0of1"
    assert shard_name(3, 8) == "tp3of8"
    assert len({shard_name(r, 4) for r in range(4)}) == 4
    for rank, size in [(1, 1), (-1, 2), (0, 0), (4, 4), (0, -1)]:
        with pytest.raises(ValueError, match="tp_rank"):
            shard_name(rank, size)


@pytest.mark.parametrize("chunks,shards", [(1, 1), (16, 1), (32, 1), (33, 1), (16, 8), (300, 2)])
def test_shard_keys_small_and_large_paths_agree(chunks, shards, monkeypatch):
    """Few keys are XORed as ints, many with numpy: the same bytes either way."""
    import os

    import kvdepot.client.hashing as hashing

    chain = [os.urandom(KEY_BYTES) for _ in range(chunks)]
    masks = [os.urandom(KEY_BYTES) for _ in range(shards)]
    got = shard_keys(chain, masks)
    monkeypatch.setattr(hashing, "_SMALL_KEYS", 0)
    assert shard_keys(chain, masks) == got
    monkeypatch.setattr(hashing, "_SMALL_KEYS", 10**9)
    assert shard_keys(chain, masks) == got
    assert got[0][0] == bytes(a ^ b for a, b in zip(chain[0], masks[0]))
