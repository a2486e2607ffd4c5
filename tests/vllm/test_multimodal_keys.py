"""Multimodal prompts are cached where vLLM's block hashes key them: each block's hash holds
the multimodal items in it (``("mm", identifier, offset)``, vLLM's `generate_block_hash_extra_keys`)
and chains the blocks before, so two prompts of the same placeholder tokens and other images
share only the chunks before the first image. With keys hashed from tokens, the placeholders
would say nothing of the image: such requests are not cached."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

CHUNK = 64
IMAGE_AT = 140  # inside chunk 2 of 4: chunks 0 and 1 hold no image


def _image(identifier: str) -> list:
    return [MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                  mm_position=PlaceholderRange(offset=IMAGE_AT, length=50), mm_hash=identifier)]


@pytest.fixture
def no_encoder(monkeypatch):
    """The toy model has no vision encoder: vLLM schedules the placeholder tokens as if their
    encoder outputs were cached (the harness's forward makes KV from the tokens alone)."""
    monkeypatch.setattr(Scheduler, "_try_schedule_encoder_inputs",
                        lambda self, request, computed, new, budget, shift_computed_tokens=0: ([], new, budget, [], []))


def _engine(daemon, tmp_path, key_source: str = "auto"):
    cfg = H.make_vllm_config(H.model_dir(tmp_path), daemon.endpoint, chunk_size=CHUNK,
                             extra={"model_id": f"mm-{key_source}", "key_source": key_source})
    return H.Engine(cfg, H.dense_specs(), num_blocks=160)


def _run(engine, prompt, image: str):
    rid = engine.add(prompt, max_tokens=2, mm_features=_image(image))
    engine.run(timeout_s=60)
    return engine.runs[rid]


def test_an_image_prompt_hits_only_where_its_images_are_the_same(daemon, tmp_path, no_encoder):
    prompt = H.tokens(17, 4 * CHUNK + 9)
    a = _engine(daemon, tmp_path)
    try:
        ref = _run(a, prompt, "image-A")
        assert a.worker_conn.stats["stored_chunks"] == 4
    finally:
        a.close()
    for image, hits in (("image-B", 2), ("image-A", 4)):
        b = _engine(daemon, tmp_path)
        try:
            run = _run(b, prompt, image)
            assert b.worker_conn.stats["loaded_chunks"] == hits, image
            assert run.computed == len(prompt) - hits * CHUNK + 1
            assert run.outputs == ref.outputs
        finally:
            b.close()


def test_with_keys_from_tokens_an_image_prompt_is_not_cached(daemon, tmp_path, no_encoder):
    prompt = H.tokens(18, 4 * CHUNK + 9)
    e = _engine(daemon, tmp_path, key_source="tokens")
    try:
        rid = e.add(prompt, max_tokens=2, mm_features=_image("image-A"))
        e.run(timeout_s=60)
        assert rid not in e.sched_conn._reqs
        assert e.worker_conn.stats["stores"] == 0
        e.add(prompt, max_tokens=2)  # the same tokens without the image: cached as text
        e.run(timeout_s=60)
        assert e.worker_conn.stats["stored_chunks"] == 4
    finally:
        e.close()
