"""The model `benchmarks/vllm_connector.py` drives: the KV specs of the shapes measured, and a
"forward" that writes each scheduled token's blocks on the current stream (optionally spinning
the GPU as long as a model's forward takes), with the waits for the GPU that vLLM's model runner
makes between steps. Runs on `tests/vllm/vllm_harness.py` (vLLM 0.33's real scheduler and
connector lifecycle)."""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

from connector_bench import harness
from connector_bench.timers import LayerProbe
from kvdepot import trace

H = harness()


def shapes(smoke: bool = False) -> dict[str, dict]:
    """Per-layer vLLM KV specs of the models measured (bf16, 16 tokens per block). ``smoke``:
    also `SMOKE_SHAPE` and `SMOKE_HYBRID_SHAPE`, two-layer models (dense; gpt-oss-20b's
    full-attention and 128-token sliding-window groups) whose caches fit a small CPU machine
    (the connector's per-step calls depend on the groups, not on the layers in them: for local
    A/Bs with ``--device cpu``; never in the GPU table)."""
    bf16 = torch.bfloat16

    def dense(layers, heads, head):
        return {f"model.layers.{i}.attn": FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head,
                                                            dtype=bf16) for i in range(layers)}

    oss = {}
    for i in range(24):  # gpt-oss-20b: full and 128-token sliding-window attention, alternating
        cls = FullAttentionSpec if i % 2 else SlidingWindowSpec
        kw = {} if i % 2 else {"sliding_window": 128}
        oss[f"model.layers.{i}.attn"] = cls(block_size=16, num_kv_heads=8, head_size=64, dtype=bf16, **kw)
    # DeepSeek-V3: 61 MLA layers of one 576-wide latent row per token, whole on every TP rank
    mla = {f"model.layers.{i}.attn": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=bf16,
                                                      max_tp_shards=1) for i in range(61)}
    out = {"Llama-3.1-8B TP1": dense(32, 8, 128), "Llama-3.1-70B TP4 shard": dense(80, 2, 128),
           "gpt-oss-20b": oss, "DeepSeek-V3 MLA": mla}
    if smoke:
        out[SMOKE_SHAPE] = dense(2, 2, 64)
        out[SMOKE_HYBRID_SHAPE] = {  # gpt-oss-20b's two groups, one layer each
            "model.layers.0.attn": SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=bf16,
                                                     sliding_window=128),
            "model.layers.1.attn": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=bf16)}
    return out


SMOKE_SHAPE = "dense-2L (smoke)"
SMOKE_HYBRID_SHAPE = "hybrid-2L (smoke)"


CHUNKS_PER_STEP = 16  # chunks a measured step stores: the token budget of a step is 16 chunks' tokens

_SLOTS, _SLOT_IDS = 8, 1 << 16  # `FillForward._device_ids`: pinned host slots, block ids per slot


class FillForward(H.RankWorker):
    """The model: each scheduled token's blocks get one byte value, on the current stream, with
    the connector's ``wait_for_layer_load`` and ``save_kv_layer`` around each layer, as vLLM's
    attention layers call them; then, ``forward_us`` > 0, the GPU spins that long on the
    stream (``torch.cuda._sleep``), as a model's attention and MLP take milliseconds."""

    forward_us = 0.0
    _cycles_per_us = 0.0
    evict_bytes = 0  # each forward also writes this many bytes of host memory (`_evict`)
    _evict_buf = None

    def _evict(self) -> None:
        """Write ``evict_bytes`` of a host buffer on the engine thread: a real model runner's
        host work (its Python, the kernel launches, vLLM's input preparation) leaves the CPU
        caches holding little of the connector's code and objects by the next step, where the
        toy forward leaves most of them; this stands in for it."""
        if self.evict_bytes <= 0:
            return
        buf = FillForward._evict_buf
        if buf is None or buf.numel() != self.evict_bytes:
            buf = FillForward._evict_buf = torch.zeros(self.evict_bytes, dtype=torch.uint8)
        buf.add_(1)

    def _spin(self) -> None:
        if self.forward_us <= 0 or self.device.type != "cuda":
            return
        if not FillForward._cycles_per_us:  # once: the GPU's spin rate, measured
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)
            a.record()
            torch.cuda._sleep(20_000_000)
            b.record()
            b.synchronize()
            FillForward._cycles_per_us = 20_000_000 / (1000.0 * a.elapsed_time(b))
        torch.cuda._sleep(int(self.forward_us * FillForward._cycles_per_us))

    def _device_ids(self, lists: list[list[int]]) -> list[torch.Tensor]:
        """Int64 tensors of ``lists`` on the device, copied from a ring of pinned host slots
        without waiting for the GPU, as vLLM prepares a step's inputs: a copy from pageable
        memory, or a new pinned allocation while the earlier copies are still queued, waits
        for the GPU's earlier work with the GIL held (a whole forward, with --forward-us)."""
        n = sum(len(x) for x in lists)
        if self.device.type != "cuda" or n > _SLOT_IDS:
            return [torch.tensor(x, device=self.device) for x in lists]
        ring = getattr(self, "_ids_ring", None)
        if ring is None:
            ring = self._ids_ring = [torch.empty(_SLOTS * _SLOT_IDS, dtype=torch.int64, pin_memory=True),
                                     [None] * _SLOTS, 0]
        host, events, k = ring[0], ring[1], (ring[2] + 1) % _SLOTS
        ring[2] = k
        if events[k] is not None:
            events[k].synchronize()  # this slot's last copy ran (lets go of the GIL)
        src = host[k * _SLOT_IDS:k * _SLOT_IDS + n]
        src.copy_(torch.tensor([b for x in lists for b in x], dtype=torch.int64))
        dev = src.to(self.device, non_blocking=True)
        events[k] = torch.cuda.Event()
        events[k].record()
        out, o = [], 0
        for x in lists:
            out.append(dev[o:o + len(x)])
            o += len(x)
        return out

    def _forward(self, so) -> None:
        gid = {name: g for g, group in enumerate(self.groups) for name in group.layer_names}
        keys, lists = [], []  # (request, gid, value) and the block ids the scheduled tokens write
        for req_id, n in so.num_scheduled_tokens.items():
            run = self.runs[req_id]
            start = run.sched_computed
            for g, group in enumerate(self.groups):
                bs = group.kv_cache_spec.block_size
                keys.append((req_id, g, (start // bs) % 127))
                lists.append(sorted({run.table[g][p // bs] for p in range(start, start + n)}))
        ids = {(r, g): (idx, value) for (r, g, value), idx in zip(keys, self._device_ids(lists))}
        probe = LayerProbe.get()
        for i, name in enumerate(self.kv_caches):  # layer by layer, as a model runs
            # the timer's own cost per call, here (see LayerProbe): before the connector's first
            # call of a layer on odd layers, after it on even ones (the first call after the
            # layer's tensor work runs with colder caches)
            if i % 2:
                probe.noop()
            per_layer = self.conn.has_connector_metadata()  # as vLLM's attention layers ask, then call:
            if not i % 2:
                probe.noop()
            if per_layer:
                self.conn.wait_for_layer_load(name)
            for (_, g), (idx, value) in ids.items():
                if g == gid[name]:
                    self.kv_caches[name].view(torch.int8)[idx] = value
            if per_layer:
                self.conn.save_kv_layer(name, self.kv_caches[name], None)
        self._spin()
        self._evict()


class FillEngine(H.Engine):
    rank_worker_class = FillForward


class WaitingFillForward(FillForward):
    """`FillForward` whose step ends, after the connector's calls, with a wait for the GPU (an
    event recorded on the current stream, then synchronized, which lets go of the GIL), as
    vLLM's model runner waits for its sampled tokens (``AsyncGPUModelRunnerOutput.get_output``:
    ``async_copy_ready_event.synchronize()``): ``lag`` 0, for this step's; 1, for the step
    before's (vLLM's async scheduling, its default: the next step is scheduled and enqueued
    before the engine waits for the last one's tokens). The toy forward takes microseconds of
    GPU time unless ``forward_us`` is set."""

    lag = 0
    _last = None

    def execute(self, so, update_states: bool):
        out = super().execute(so, update_states)
        if self.device.type == "cuda" and so.total_num_scheduled_tokens:
            ev = torch.cuda.Event()
            ev.record()
            wait, self._last = (ev, None) if not self.lag else (self._last, ev)
            if wait is not None:
                trace.point(trace.ENGINE_THREAD, "e_gpu_wait")
                wait.synchronize()
                trace.point(trace.ENGINE_THREAD, "e_gpu_done")
        return out


class WaitingFillEngine(H.Engine):
    rank_worker_class = WaitingFillForward
