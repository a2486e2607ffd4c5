"""The model identity in the chunk keys (`kvdepot.client.vllm.connector.model_identity`) holds
everything of the engine's configuration that changes the KV of the same weights and tokens
(and is not already in the layout fingerprint): ``--hf-overrides`` (e.g. ``rope_theta``), the
model dtype under a quantized KV cache, a LoRA adapter's path, not only its name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402

from kvdepot.client.vllm.config import ConnectorConfig  # noqa: E402
from kvdepot.client.vllm.connector import model_identity  # noqa: E402


def _cfg(model="org/m", revision=None, quantization=None, dtype="torch.bfloat16", cache_dtype="auto",
         hf_overrides=None):
    mc = SimpleNamespace(model=model, revision=revision, quantization=quantization, dtype=dtype,
                         hf_overrides=hf_overrides if hf_overrides is not None else {})
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype=cache_dtype))


def test_the_identity_of_a_plain_engine_is_what_it_was():
    """Keys of engines without overrides or a quantized cache do not move."""
    assert model_identity(_cfg(), ConnectorConfig.from_extra({})) == "org/m|rev=|q=|kv=auto"
    assert model_identity(_cfg(revision="abc", quantization="awq"), ConnectorConfig.from_extra({})) == "org/m|rev=abc|q=awq|kv=auto"


def test_overrides_and_the_dtype_under_a_quantized_cache_enter_the_identity():
    plain = ConnectorConfig.from_extra({})
    rope = model_identity(_cfg(hf_overrides={"rope_theta": 1e6, "max_window_layers": 4}), plain)
    assert rope.startswith("org/m|rev=|q=|kv=auto|hf=") and len(rope.rsplit("=", 1)[1]) == 16
    # the order of the keys is not an identity
    assert model_identity(_cfg(hf_overrides={"max_window_layers": 4, "rope_theta": 1e6}), plain) == rope
    assert model_identity(_cfg(hf_overrides={"rope_theta": 5e5, "max_window_layers": 4}), plain) != rope
    assert model_identity(_cfg(hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}), plain) \
        != model_identity(_cfg(hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}), plain)

    def patch(config):
        return config
    assert "|hf=" in model_identity(_cfg(hf_overrides=patch), plain)

    fp8_bf16 = model_identity(_cfg(cache_dtype="fp8"), plain)
    fp8_f16 = model_identity(_cfg(cache_dtype="fp8", dtype="torch.float16"), plain)
    assert fp8_bf16 == "org/m|rev=|q=|kv=fp8|dtype=bfloat16" and fp8_f16.endswith("|dtype=float16")


def test_model_id_names_the_weights_and_nothing_else():
    named = ConnectorConfig.from_extra({"model_id": "llama-8b"})
    assert model_identity(_cfg(model="/mnt/a", revision="r1"), named) == model_identity(_cfg(model="/b"), named)
    assert model_identity(_cfg(), named) == "llama-8b|rev=|q=|kv=auto"
    for other in (_cfg(quantization="awq"), _cfg(cache_dtype="fp8"), _cfg(hf_overrides={"rope_theta": 1e6})):
        assert model_identity(other, named) != model_identity(_cfg(), named)


def test_an_engine_with_a_rope_override_never_loads_the_chunks_of_one_without(daemon, tmp_path):
    """Through vLLM's real `ModelConfig` (it resolves the overrides) and scheduler."""
    model = H.model_dir(tmp_path)

    def engine(**model_kw):
        cfg = H.make_vllm_config(model, daemon.endpoint, chunk_size=64, extra={"model_id": "identity-hf"},
                                 model_kw=model_kw)
        return H.Engine(cfg, H.dense_specs(), num_blocks=160)

    prompt = H.tokens(5, 300)  # 4 whole chunks
    for kw, hits in (({}, 0), ({"hf_overrides": {"rope_theta": 1e6}}, 0), ({}, 4),
                     ({"hf_overrides": {"rope_theta": 1e6}}, 4)):
        e = engine(**kw)
        try:
            e.add(prompt, max_tokens=2)
            e.run(timeout_s=60)
            assert e.worker_conn.stats["loaded_chunks"] == hits, kw
        finally:
            e.close()


def test_two_adapters_of_one_name_at_other_paths_get_other_keys(daemon, tmp_path):
    from vllm.lora.request import LoRARequest

    cfg = H.make_vllm_config(H.model_dir(tmp_path), daemon.endpoint, extra={"model_id": "identity-lora"})
    e = H.Engine(cfg, H.dense_specs(), num_blocks=160)
    try:
        keys = e.sched_conn._keys

        def salt(lora):
            return keys.seed_salt(SimpleNamespace(cache_salt="tenant", lora_request=lora))[0]
        a, b = LoRARequest("sql", 1, "/adapters/sql-v1"), LoRARequest("sql", 1, "/adapters/sql-v2")
        assert len({salt(None), salt(a), salt(b)}) == 3
        assert salt(a) == salt(LoRARequest("sql", 7, "/adapters/sql-v1"))  # the id is the engine's own
    finally:
        e.close()
