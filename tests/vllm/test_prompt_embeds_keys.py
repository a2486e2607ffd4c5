"""Prompts given as embeddings (vLLM's ``prompt_embeds``) are cached where vLLM's block hashes
key them: each block's hash holds the SHA-256 of its embeddings (``("prompt_embeds", digest)``,
vLLM's `generate_block_hash_extra_keys`) and chains the blocks before, so two prompts share
exactly the chunks before their embeddings first differ. With keys hashed from tokens (an
embeddings prompt has none) such requests are not cached."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm_harness as H  # noqa: E402

CHUNK = 64
CHANGED_AT = 140  # inside chunk 2 of 4: chunks 0 and 1 have the same embeddings


def _embeds(tokens: list[int]) -> torch.Tensor:
    """Embeddings that differ where the tokens do (the toy forward makes KV from the tokens)."""
    t = torch.tensor(tokens, dtype=torch.float32)
    return torch.stack([t, t * 0.5, -t, t + 1], dim=1)


def _engine(daemon, tmp_path, key_source: str = "auto"):
    cfg = H.make_vllm_config(H.model_dir(tmp_path), daemon.endpoint, chunk_size=CHUNK,
                             extra={"model_id": f"embeds-{key_source}", "key_source": key_source})
    return H.Engine(cfg, H.dense_specs(), num_blocks=160)


def _run(engine, prompt):
    rid = engine.add(prompt, max_tokens=2, prompt_embeds=_embeds(prompt))
    engine.run(timeout_s=60)
    return engine.runs[rid]


def test_an_embeddings_prompt_hits_only_the_chunks_before_its_embeddings_differ(daemon, tmp_path):
    prompt = H.tokens(21, 4 * CHUNK + 9)
    other = prompt[:CHANGED_AT] + [(t + 1) % 1000 for t in prompt[CHANGED_AT:]]
    a = _engine(daemon, tmp_path)
    try:
        ref = _run(a, prompt)
        assert a.worker_conn.stats["stored_chunks"] == 4
    finally:
        a.close()
    for p, hits in ((other, 2), (prompt, 4)):
        b = _engine(daemon, tmp_path)
        try:
            run = _run(b, p)
            assert b.worker_conn.stats["loaded_chunks"] == hits
            assert run.computed == len(p) - hits * CHUNK + 1
            if p is prompt:
                assert run.outputs == ref.outputs  # the loaded KV is the stored one, byte for byte
        finally:
            b.close()


def test_with_keys_from_tokens_an_embeddings_prompt_is_not_cached(daemon, tmp_path):
    prompt = H.tokens(22, 4 * CHUNK + 9)
    e = _engine(daemon, tmp_path, key_source="tokens")
    try:
        rid = e.add(prompt, max_tokens=2, prompt_embeds=_embeds(prompt))
        e.run(timeout_s=60)
        assert rid not in e.sched_conn._reqs
        assert e.worker_conn.stats["stores"] == 0
    finally:
        e.close()
