"""Key scope through vLLM's real classes: engines of one model whose KV differs for the same
tokens never hit each other's chunks, and an engine that differs in nothing does; the harness
checks every KV byte a request attends to, so a hit is also a right one. Covered here: the
KV-cache dtype (bf16 / fp8), the block size, LoRA adapters, and a speculative step's draft
tokens (never keyed nor stored). A tenant's ``cache_salt`` through engines:
test_vllm_connector.py::test_cache_salt_isolates_tenants; an adapter's path in its keys and
``--hf-overrides``: test_model_identity.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

CHUNK = 64
PROMPT_CHUNKS = 3


def _run(endpoint, tmp_path, model_id: str, *, block_size: int = 16, kv_dtype=torch.bfloat16, cache_dtype="auto",
         extra: dict | None = None) -> int:
    """One engine runs the prompt; returns the chunks it loaded (every byte it attended to is
    checked by the harness: a wrong one raises)."""
    cfg = H.make_vllm_config(H.model_dir(tmp_path), endpoint, block_size=block_size, chunk_size=CHUNK,
                             extra={"model_id": model_id, **(extra or {})})
    cfg.cache_config.cache_dtype = cache_dtype
    specs = {f"model.layers.{i}.attn": FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16,
                                                         dtype=kv_dtype) for i in range(4)}
    e = H.Engine(cfg, specs, num_blocks=160)
    try:
        e.add(H.tokens(61, PROMPT_CHUNKS * CHUNK + 10), max_tokens=1)
        e.run(timeout_s=60)
        return e.worker_conn.stats["loaded_chunks"]
    finally:
        e.close()


def test_a_bf16_and_an_fp8_kv_cache_never_share_a_chunk(shared_daemon, tmp_path):
    assert _run(shared_daemon.endpoint, tmp_path, "scope-dtype") == 0
    assert _run(shared_daemon.endpoint, tmp_path, "scope-dtype", kv_dtype=torch.float8_e4m3fn, cache_dtype="fp8") == 0
    assert _run(shared_daemon.endpoint, tmp_path, "scope-dtype", kv_dtype=torch.float8_e4m3fn, cache_dtype="fp8") \
        == PROMPT_CHUNKS
    assert _run(shared_daemon.endpoint, tmp_path, "scope-dtype") == PROMPT_CHUNKS


@pytest.mark.parametrize("key_source", ["vllm", "tokens"])
def test_another_block_size_never_loads_a_wrong_byte(shared_daemon, tmp_path, key_source):
    """Keys from vLLM's block hashes (``key_source`` vllm, or auto where vLLM's hashes are
    reproducible) differ with the block size: no hit. Keys hashed from the tokens do not: the
    chunk's object format is the same for every block size (as for NHD and HND), and an engine
    of 32-token blocks loads an engine of 16-token blocks' chunks, every byte of which the
    harness checks."""
    extra = {"key_source": key_source}
    assert _run(shared_daemon.endpoint, tmp_path, f"scope-bs-{key_source}", extra=extra) == 0
    got = _run(shared_daemon.endpoint, tmp_path, f"scope-bs-{key_source}", block_size=32, extra=extra)
    assert got == (0 if key_source == "vllm" else PROMPT_CHUNKS)


@pytest.mark.parametrize("key_source", ["vllm", "tokens"])
def test_requests_of_other_lora_adapters_never_share_a_chunk(shared_daemon, tmp_path, key_source):
    """An adapter (by name and path), no adapter, another adapter: no hit across them; the same
    adapter under another engine's id for it hits."""
    from vllm.lora.request import LoRARequest

    cfg = H.make_vllm_config(H.model_dir(tmp_path), shared_daemon.endpoint, chunk_size=CHUNK,
                             extra={"model_id": f"scope-lora-{key_source}", "key_source": key_source})
    got = []
    for lora in (LoRARequest("sql", 1, "/adapters/sql"), None, LoRARequest("chat", 2, "/adapters/chat"),
                 LoRARequest("sql", 3, "/adapters/sql")):
        e = H.Engine(cfg, H.dense_specs(), num_blocks=160)
        try:
            e.add(H.tokens(62, PROMPT_CHUNKS * CHUNK + 10), max_tokens=1, lora_request=lora)
            e.run(timeout_s=60)
            got.append(e.worker_conn.stats["loaded_chunks"])
        finally:
            e.close()
    assert got == [0, 0, 0, PROMPT_CHUNKS]


@pytest.mark.parametrize("key_source", ["vllm", "tokens"])
def test_a_speculative_steps_draft_tokens_are_never_stored(shared_daemon, tmp_path, key_source):
    """With ``store_generated``, a decode step that verifies draft tokens schedules them too
    (one sampled token plus the drafts): the chunk their positions complete is neither keyed
    nor stored in that step, as their KV is unverified; it is stored once its tokens are the
    request's own, under the keys of those tokens (a chain keyed past the verified tokens would
    leave every later chunk unstored, or stored under another prefix's keys)."""
    cfg = H.make_vllm_config(H.model_dir(tmp_path), shared_daemon.endpoint, chunk_size=CHUNK,
                             extra={"model_id": f"scope-spec-{key_source}", "store_generated": True,
                                    "key_source": key_source})
    e = H.Engine(cfg, H.dense_specs(), num_blocks=160)
    try:
        rid = e.add(H.tokens(63, CHUNK + 10), max_tokens=2 * CHUNK)
        run = e.runs[rid]
        req = e.scheduler.requests[rid]
        while req.num_tokens < 2 * CHUNK - 2:
            e.step()
        side = e.sched_conn
        st = side._reqs[rid]
        assert st.next_store_chunk == 1 and req.num_computed_tokens == req.num_tokens - 1
        req.spec_token_ids = [5, 6, 7, 8]  # positions 2*CHUNK-2 .. 2*CHUNK+1: two past the chunk's end
        assert side._store_job(rid, 1 + len(req.spec_token_ids), None, st=st) is None
        assert st.next_store_chunk == 1 and len(st.chain) == 1
        req.spec_token_ids = []
        e.run(timeout_s=60)
        tokens = list(run.tokens)
        assert e.worker_conn.stats["stored_chunks"] == (CHUNK + 10 + 2 * CHUNK) // CHUNK
    finally:
        e.close()
    # another engine loads every stored chunk of the whole conversation, each byte checked
    f = H.Engine(cfg, H.dense_specs(), num_blocks=160)
    try:
        f.add(tokens, max_tokens=1)
        f.run(timeout_s=60)
        assert f.worker_conn.stats["loaded_chunks"] == 3
    finally:
        f.close()
