"""A sliding-window engine's stores hold vLLM's null block where it had let a block go before
the store (chunked prefill past the window), which only an engine that lets the same blocks go
never loads. The layout fingerprint says nothing of windows (the bytes' shapes are the same),
so the window enters the keys' namespace (`kvdepot.client.vllm.layout.attention_tag`): a
full-attention engine of the same model, or one with another window, never loads them."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm_harness as H  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

CHUNK = 64


def _specs(window: int | None, block_size: int = 16) -> dict:
    """Four layers of one KV-cache group: all sliding-window (``window``) or all full attention."""
    def spec():
        if window is None:
            return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
        return SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.bfloat16,
                                 sliding_window=window)
    return {f"model.layers.{i}.attn": spec() for i in range(4)}


@pytest.mark.parametrize("key_source", ["auto", "tokens"])
def test_only_engines_with_the_same_window_share_a_sliding_window_engines_chunks(daemon, tmp_path, key_source):
    """(With keys from vLLM's block hashes, another block size already gives other keys: vLLM
    hashes per block; with keys hashed from the tokens only the namespace tells them apart.)"""
    model = H.model_dir(tmp_path)

    def engine(window, block_size=16):
        cfg = H.make_vllm_config(model, daemon.endpoint, chunk_size=CHUNK, max_num_batched_tokens=48,
                                 max_model_len=512, extra={"model_id": f"window-namespace-{key_source}", "key_source": key_source})
        return H.Engine(cfg, _specs(window, block_size), num_blocks=80 * 16 // block_size)

    prompt = H.tokens(77, 300)  # 4 whole chunks, prefilled 48 tokens a step: blocks leave the window first
    a = engine(32)
    try:
        ra = a.add(prompt, max_tokens=3)
        a.run(timeout_s=60)
        ref = a.runs[ra]
        assert a.worker_conn.stats["stored_chunks"] == 4
    finally:
        a.close()
    # full attention, another window, the same window in larger blocks (whole blocks are let go:
    # it keeps tokens further back), the same
    for window, block_size, hits in ((None, 16, 0), (64, 16, 0), (32, 32, 0), (32, 16, 4)):
        b = engine(window, block_size)
        try:
            assert (b.sched_conn._attention == "") == (window is None)  # dense: keys as before
            rb = b.add(prompt, max_tokens=3)
            b.run(timeout_s=60)
            # the harness's forward checks every KV byte each token attends to against the KV
            # of a full computation, the loaded ones included
            assert b.worker_conn.stats["loaded_chunks"] == hits, window
            if hits:  # (other attention gives other tokens)
                assert b.runs[rb].outputs == ref.outputs
        finally:
            b.close()


def test_the_window_changes_the_seed_and_full_attention_keeps_the_seed_it_had():
    from kvdepot.client.hashing import namespace_seed

    base = namespace_seed("m", "fp", "salt")
    assert namespace_seed("m", "fp", "salt", "", "") == base  # full attention: keys as before
    tags = ["", "g0=sw=32:acs=None", "g0=sw=64:acs=None"]
    seeds = {namespace_seed("m", "fp", "salt", src, tag) for src in ("", "vllm-block-hash/sha256") for tag in tags}
    assert len(seeds) == 6  # every (source, windows) its own namespace
    # an attention tag never reproduces a chain source's seed, nor the other way round
    assert namespace_seed("m", "fp", "salt", "x", "") != namespace_seed("m", "fp", "salt", "", "x")
