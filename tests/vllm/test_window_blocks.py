"""A sliding-window group's store holds only the blocks a load can be given: vLLM hands a hit
non-null blocks of the group only for the window before the hit's end (a chunk boundary), so
each chunk's earlier blocks are left to vLLM's null block (`TransferGroup.window_blocks`,
`kept_from`): they are neither pinned nor gathered from the request's blocks. A vLLM that
keeps more of the window than that gets no load (it recomputes) rather than those bytes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm_harness as H  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kvdepot.client.vllm.layout import attention_tag, transfer_groups  # noqa: E402
from kvdepot.client.vllm.scheduler import SchedulerConnector  # noqa: E402

CHUNK = 64


def _sw(window: int, block_size: int = 16, **kw) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.bfloat16,
                             sliding_window=window, **kw)


def _config(*specs) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])


def test_the_blocks_a_store_keeps_per_chunk():
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    local = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16,
                                      attention_chunk_size=64)
    groups, reason = transfer_groups(_config(full, _sw(32), _sw(33), _sw(32, extra_retained_tokens=16),
                                             _sw(128, 32), _sw(1000), local))
    assert not reason
    # full attention; window 32 in 16-token blocks: the last 2 of a chunk's 4 (a full hit's last
    # token, computed again, attends 32 back: still 2); 33: 3; 16 tokens retained: 3;
    # window 128 in 32-token blocks: 4 of 2 per chunk, so all; 1000: all; local attention: all
    assert [g.window_blocks for g in groups] == [0, 2, 3, 3, 4, 63, 0]
    assert [g.kept_from(CHUNK) for g in groups] == [0, 2, 1, 1, 0, 0, 0]
    assert [g.kept_from(256) for g in groups][:4] == [0, 14, 13, 13]
    # the retained tokens decide which blocks a store holds, so they part namespaces
    one, _ = transfer_groups(_config(_sw(32)))
    more, _ = transfer_groups(_config(_sw(32, extra_retained_tokens=16)))
    assert attention_tag(_config(_sw(32)), one) != attention_tag(_config(_sw(32, extra_retained_tokens=16)), more)
    assert ":extra" not in attention_tag(_config(_sw(32)), one)  # keys of other engines stay as they were


def _specs(window: int) -> dict:
    return {f"model.layers.{i}.attn": _sw(window) for i in range(4)}


def _engine(daemon, tmp_path, name: str, step_tokens: int = 2048):
    cfg = H.make_vllm_config(H.model_dir(tmp_path), daemon.endpoint, chunk_size=CHUNK, max_num_batched_tokens=step_tokens,
                             max_model_len=512, extra={"model_id": name})
    return H.Engine(cfg, _specs(32), num_blocks=80)


def test_a_store_pins_and_reads_only_the_window_a_load_can_use(daemon, tmp_path, monkeypatch):
    jobs = []
    store_job = SchedulerConnector._store_job

    def spy(self, *a, **kw):
        job = store_job(self, *a, **kw)
        if job is not None:
            jobs.append(job)
        return job
    monkeypatch.setattr(SchedulerConnector, "_store_job", spy)
    prompt = H.tokens(91, 300)  # 4 whole chunks, all in one step: no block let go before the store
    a = _engine(daemon, tmp_path, "window-blocks")
    try:
        ra = a.add(prompt, max_tokens=3)
        a.run(timeout_s=60)
        assert a.worker_conn.stats["stored_chunks"] == 4
        null = a.sched_conn._null_block_id
        ids = [b for job in jobs for b in job.block_ids[0]]
        assert len(ids) == 16
        assert [b == null for b in ids] == [True, True, False, False] * 4
        assert a.sched_conn.stats["blocks_pinned"] == 8  # 2 per chunk, not 4
        assert a.sched_conn.pinned_blocks == 0
        ref = a.runs[ra].outputs
    finally:
        a.close()
    for _ in range(2):  # a whole hit, then the same prompt again: both bit-exact
        b = _engine(daemon, tmp_path, "window-blocks", step_tokens=48)
        try:
            rb = b.add(prompt, max_tokens=3)
            b.run(timeout_s=60)
            # the harness's forward checks every KV byte each token attends to
            assert b.worker_conn.stats["loaded_chunks"] == 4
            assert b.worker_conn.stats["null_blocks_left_alone"] >= 1
            assert b.runs[rb].outputs == ref
        finally:
            b.close()


def test_a_vllm_that_keeps_more_of_the_window_recomputes_instead_of_loading(daemon, tmp_path, monkeypatch, caplog):
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    prompt = H.tokens(92, 300)
    a = _engine(daemon, tmp_path, "window-blocks-more")
    try:
        ra = a.add(prompt, max_tokens=3)
        a.run(timeout_s=60)
        ref = a.runs[ra].outputs
    finally:
        a.close()
    skipped = SlidingWindowManager.get_num_skipped_tokens
    # a later vLLM keeping one more block of every window than vLLM 0.33
    monkeypatch.setattr(SlidingWindowManager, "get_num_skipped_tokens",
                        lambda self, n: max(0, skipped(self, n) - 16))
    b = _engine(daemon, tmp_path, "window-blocks-more")
    try:
        rb = b.add(prompt, max_tokens=3)
        b.run(timeout_s=60)
        stats = b.worker_conn.stats
        assert stats["loaded_chunks"] == 0 and stats["load_failures"] == 1
        assert b.runs[rb].outputs == ref  # recomputed
        assert "more than 2 blocks before a chunk's end" in caplog.text
    finally:
        b.close()
