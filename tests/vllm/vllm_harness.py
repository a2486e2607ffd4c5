"""A CPU "vLLM instance" for the connector tests: vLLM 0.33's real scheduler, KV-cache planning
and allocation, connector factory and worker-side connector lifecycle, around a toy model.

What is vLLM's own code and what is this harness:

* vLLM code: ``VllmConfig`` (which loads the connector class by ``kv_connector_module_path``),
  ``get_kv_cache_configs`` (KV-cache groups and tensors of a hybrid model), ``Scheduler``
  (prefix cache, block allocation, ``get_num_new_matched_tokens`` / ``update_state_after_alloc``
  / ``build_connector_meta`` / ``request_finished_all_groups`` / ``update_connector_output``,
  async-load states, invalid-block and failed-load recovery), ``KVConnectorFactory``,
  ``create_kv_cache_views`` (the per-layer ``[B, H, N, C]`` views; the allocation, as in
  ``allocate_kv_cache``, runs under the connector's ``get_mem_pool_context``), and the worker call sequence of
  ``KVConnectorModelRunnerMixin`` (``bind_connector_metadata``, ``start_load_kv``,
  ``wait_for_save``, ``get_transfer_results``, ``get_block_ids_with_load_errors``,
  ``clear_connector_metadata``, ``kv_connector_no_forward``).
  With tensor parallelism (``Engine(..., tp=2)``): one worker connector and KV cache per rank,
  their outputs merged by vLLM's ``KVOutputAggregator`` as its executor does.
* Harness: the model runner's bookkeeping (block tables from ``SchedulerOutput``) and the toy
  forward pass, which checks every KV byte it attends to against the KV the toy model defines
  for that token prefix (so a wrong load fails the test, and the sampled token depends on the
  cached bytes), then writes the KV of the scheduled tokens. Each TP rank's KV differs (as
  each rank holds other heads), so a rank that loads another rank's shard fails; MLA layers
  (`mla_specs`) are the same on every rank, as vLLM's latent KV is. The worker's
  rank comes from vLLM's parallel state, which needs torch.distributed; the harness sets it
  while creating each rank's connector.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import time
import warnings
from pathlib import Path

import torch
import vllm_stubs  # noqa: F401 - before vLLM: compiled modules absent here become empty modules

from rank_process import RankProcess  # noqa: E402 - imports this module back lazily

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.script(_method)?` is deprecated",
                            category=DeprecationWarning)
    from vllm import ModelRegistry, SamplingParams
    from vllm.config import (CacheConfig, DeviceConfig, KVEventsConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                             VllmConfig)
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.forward_context import set_forward_context
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
        create_kv_cache_views,
    )
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
    import vllm.v1.executor  # noqa: F401 - imported by VllmConfig; pulls torch.compile (import warnings)

TOY_ARCH = "KVDepotToyForCausalLM"
EOS = 2


class _ToyModel(torch.nn.Module):
    """Registered so that ``ModelConfig`` accepts the toy architecture (never run)."""

    def __init__(self, vllm_config=None, prefix: str = "") -> None:
        super().__init__()

    def embed_input_ids(self, input_ids):
        return input_ids

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return input_ids

    def compute_logits(self, hidden_states):
        return hidden_states


ModelRegistry.register_model(TOY_ARCH, _ToyModel)
init_none_hash(sha256)


def model_dir(root: Path) -> str:
    """A local model directory with just a config.json (nothing is downloaded)."""
    d = root / "toy-model"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": [TOY_ARCH], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 1000,
        "max_position_embeddings": 32768, "torch_dtype": "bfloat16", "eos_token_id": EOS}))
    return str(d)


def make_vllm_config(model: str, endpoint: str, *, block_size: int = 16, chunk_size: int = 64,
                     extra: dict | None = None, max_num_batched_tokens: int = 2048, layout: str = "LBNHC",
                     policy: str = "recompute", connector: str = "KVDepotConnector",
                     module: str = "kvdepot.client.vllm", device: str = "cpu", max_model_len: int = 2048,
                     max_num_seqs: int = 16, model_kw: dict | None = None,
                     kv_events_endpoint: str = "") -> VllmConfig:
    """A VllmConfig for the toy model with the kvdepot connector (vLLM imports ``module`` and
    takes its ``connector`` class, as ``--kv-transfer-config`` makes it do); ``model_kw``: more
    `ModelConfig` arguments (e.g. ``hf_overrides``); ``kv_events_endpoint``: vLLM's KV events
    on, published by its ``ZmqEventPublisher`` there (``--kv-events-config``)."""
    kv = KVTransferConfig(kv_connector=connector, kv_connector_module_path=module,
                          kv_role="kv_both", kv_load_failure_policy=policy,
                          kv_connector_extra_config={"endpoint": endpoint, "chunk_size": chunk_size,
                                                     "lookup_timeout_s": 0.5, "rpc_timeout_s": 1.0,
                                                     "retry_interval_s": 0.2, "hold_max_s": 2.0,
                                                     "model_id": "toy-model", **(extra or {})})
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache.kv_cache_layout = layout
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script(_method)?` is deprecated",
                                category=DeprecationWarning)
        cfg = VllmConfig(
            model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16",
                                     max_model_len=max_model_len, **(model_kw or {})),
            cache_config=cache,
            scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                             max_model_len=max_model_len, enable_chunked_prefill=True,
                                             is_encoder_decoder=False),
            kv_transfer_config=kv, device_config=DeviceConfig(device),
            **({"kv_events_config": KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=kv_events_endpoint)} if kv_events_endpoint else {}))
    # vLLM keeps its hybrid KV-cache manager on for connectors that support it (SupportsHMA), but
    # turns it off on platforms without hybrid support (a CPU machine has no vLLM platform): turn
    # it back on, as on a CUDA machine, so hybrid models get one KV-cache group per layer type
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    return cfg


def dense_specs(num_layers: int = 4, block_size: int = 16, heads: int = 2, head_size: int = 16) -> dict:
    return {f"model.layers.{i}.attn": FullAttentionSpec(block_size=block_size, num_kv_heads=heads,
                                                        head_size=head_size, dtype=torch.bfloat16)
            for i in range(num_layers)}


def hybrid_specs(sliding_window: int = 48) -> dict:
    """Two full-attention layers (16 tokens per block, 4 heads) and two sliding-window layers
    (32 tokens per block, 2 heads): equal bytes per block, different block sizes, as vLLM's
    hybrid allocator requires."""
    specs = {}
    for i in range(4):
        if i % 2 == 0:
            specs[f"model.layers.{i}.attn"] = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=16,
                                                                dtype=torch.bfloat16)
        else:
            specs[f"model.layers.{i}.attn"] = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=16,
                                                                dtype=torch.bfloat16, sliding_window=sliding_window)
    return specs


def mla_specs(num_layers: int = 4, block_size: int = 16, latent: int = 72) -> dict:
    """An MLA model's layers as vLLM's DeepSeek attention declares them: one latent row per token
    (``latent`` bf16 values, e.g. 576 for DeepSeek-V3), the same on every rank (``max_tp_shards=1``)."""
    return {f"model.layers.{i}.attn": MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=latent,
                                                       dtype=torch.bfloat16, max_tp_shards=1)
            for i in range(num_layers)}


def plan_kv_cache(vllm_config: VllmConfig, layer_specs: dict, num_blocks: int):
    """vLLM's own KV-cache planning for ``layer_specs`` with ``num_blocks`` blocks, as
    ``EngineCore._initialize_kv_caches`` does it: (worker config, scheduler config, scheduler
    block size, hash block size)."""
    register_all_kvcache_specs(vllm_config)
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    groups = get_global_kv_cache_groups(vllm_config, [layer_specs])
    worker_cfg = get_kv_cache_configs(vllm_config, [layer_specs], [1 << 34], groups)[0]
    worker_cfg.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    sched_cfg = generate_scheduler_kv_cache_config([worker_cfg])
    vllm_config.cache_config.num_gpu_blocks = sched_cfg.num_blocks
    vllm_config.cache_config.block_size = min(g.kv_cache_spec.block_size for g in sched_cfg.kv_cache_groups)
    sbs, hbs = resolve_kv_cache_block_sizes(sched_cfg, vllm_config)
    align = resolve_cache_hit_alignment_tokens(sched_cfg, vllm_config, sbs, hbs)
    for cfg in (worker_cfg, sched_cfg):
        cfg.hash_block_size = hbs
        cfg.cache_hit_alignment_tokens = align
    return worker_cfg, sched_cfg, sbs, hbs


def allocate_kv_cache(kv_cache_config, layout, device: torch.device) -> dict[str, torch.Tensor]:
    """``vllm.v1.worker.utils.allocate_kv_cache`` (that module imports einops, which a --no-deps
    vLLM lacks): one int8 ``torch.zeros`` allocation on ``device``, viewed per layer by vLLM's
    own ``create_kv_cache_views``."""
    sizes = {t.size for t in kv_cache_config.kv_cache_tensors}
    assert len(sizes) == 1
    buf = torch.zeros(sizes.pop(), dtype=torch.int8, device=device)
    caches = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        spec = next(g.kv_cache_spec for g in kv_cache_config.kv_cache_groups if tensor.layers[0] in g.layer_names)
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[tensor.layers[0]]
        views = create_kv_cache_views(buf, spec, kv_cache_config.num_blocks_of(tensor), layout, tensor)
        caches.update(zip(tensor.layers, views))
    return caches


# ---------------------------------------------------------------------- the toy model's KV


def prefix_hashes(tokens: list[int]) -> list[int]:
    """Per position p, a hash of tokens[0..p] (what the KV of position p depends on)."""
    out, h = [], 1469598103934665603
    for t in tokens:
        h = ((h ^ (t + 1)) * 1099511628211) & ((1 << 61) - 1)
        out.append(h)
    return out


def expected_kv(hashes: list[int], layer: int, heads: int, row: int) -> torch.Tensor:
    """The toy model's KV bytes ``[P, H, C]`` (int8) for positions with these prefix hashes."""
    hs = torch.tensor([h % 1000003 for h in hashes], dtype=torch.int64)
    ar_h = torch.arange(heads, dtype=torch.int64).view(1, -1, 1)
    ar_c = torch.arange(row, dtype=torch.int64).view(1, 1, -1)
    v = (hs.view(-1, 1, 1) * (layer + 1) * 7 + ar_h * 131 + ar_c * 17 + (hs.view(-1, 1, 1) >> 7) % 97) % 256
    return (v - 128).to(torch.int8)


@dataclasses.dataclass
class _ReqRun:
    tokens: list[int]  # prompt + generated so far
    num_prompt: int
    table: list[list[int]]  # per vLLM gid, the worker-side block table
    computed: int = 0  # tokens whose KV was computed by the toy forward (not loaded)
    sched_computed: int = 0  # num_computed_tokens of the current step
    loaded_bytes: dict | None = None  # KV the request found in its blocks at its first forward (rank 0)
    checksum: int = 0  # rank 0's checksum of what the last scheduled token attended to
    outputs: list[int] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def _as_tp_rank(rank: int):
    """The worker connector created inside reads ``rank`` as its tensor-parallel rank."""
    import kvdepot.client.vllm.worker as worker_mod

    saved = worker_mod._tp_rank
    worker_mod._tp_rank = lambda tp_size: rank
    try:
        yield
    finally:
        worker_mod._tp_rank = saved


class RankWorker:
    """One tensor-parallel rank's worker: vLLM's worker-side connector, the rank's KV cache
    (``allocate_kv_cache`` under the connector's ``get_mem_pool_context``) and the toy forward on
    it. ``runs`` is the engine's request table (a rank in its own process keeps its own)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config, groups, rank: int, runs: dict) -> None:
        self.vllm_config = vllm_config
        self.groups = groups
        self.rank = rank
        self.runs = runs
        self.device = torch.device(vllm_config.device_config.device)
        with _as_tp_rank(rank):
            self.conn = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        ctx = self.conn.get_mem_pool_context()
        if self.device.type == "cpu":
            assert ctx is not None, "a CPU worker's KV cache must go to shared memory"
        else:
            assert ctx is None, "a CUDA worker's KV cache is vLLM's own allocation"
        with ctx or contextlib.nullcontext():
            self.kv_caches = allocate_kv_cache(kv_cache_config, vllm_config.cache_config.get_resolved_kv_cache_layout(),
                                               self.device)
        self.conn.register_kv_caches(self.kv_caches)
        self._replicated = {name for g in groups for name in g.layer_names
                            if getattr(g.kv_cache_spec, "max_tp_shards", None) == 1}

    def execute(self, so, update_states: bool) -> ModelRunnerOutput:
        """``GPUModelRunner.execute_model`` of this rank, for the connector's purposes (tokens are
        sampled by the engine once every rank ran). ``update_states``: this rank keeps the block
        tables (one rank per request table)."""
        saved = kv_transfer_state._KV_CONNECTOR_AGENT
        kv_transfer_state._KV_CONNECTOR_AGENT = self.conn
        try:
            self.conn.handle_preemptions(so.kv_connector_metadata)
            if update_states:
                self._update_states(so)
            if not so.total_num_scheduled_tokens:
                return KVConnectorModelRunnerMixin.kv_connector_no_forward(so, self.vllm_config)
            with set_forward_context(None, self.vllm_config), \
                    KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(so) as kv_out:
                self._forward(so)
            ids = list(so.num_scheduled_tokens)
            return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                     sampled_token_ids=[[] for _ in ids], kv_connector_output=kv_out)
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = saved

    def _update_states(self, so) -> None:
        for new in so.scheduled_new_reqs:
            run = self.runs[new.req_id]
            run.table = [list(ids) for ids in new.block_ids]
            run.sched_computed = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, r in enumerate(cached.req_ids):
            run = self.runs[r]
            new_ids = cached.new_block_ids[i]
            if r in cached.resumed_req_ids:
                run.table = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for g, ids in enumerate(new_ids):
                    run.table[g].extend(ids)
            run.sched_computed = cached.num_computed_tokens[i]

    def _layer_id(self, name: str) -> int:
        """Layer index in the toy KV formula; other per rank (each rank holds other heads), except
        for layers every rank holds whole (MLA: ``max_tp_shards == 1``)."""
        layer = int(name.split(".")[2])
        return layer if name in self._replicated else layer + 1000 * self.rank

    def _layer_geometry(self, name: str):
        v = self.kv_caches[name].view(torch.int8)
        return v, v.shape[1], v.shape[3]

    def _forward(self, so) -> None:
        """The toy forward on this rank's cache, layer by layer as a model runs (each layer
        calls the connector's ``wait_for_layer_load``, writes every scheduled token's KV, then
        calls ``save_kv_layer``, as vLLM's attention layers do: only while the connector's
        ``has_connector_metadata()`` says so); rank 0 keeps each request's checksum. On CUDA it reads
        and writes on the current stream, as a model's attention would."""
        batch = []
        for req_id, n in so.num_scheduled_tokens.items():
            run = self.runs[req_id]
            start = run.sched_computed
            hashes = prefix_hashes(run.tokens[:start + n])
            self._attend(run, req_id, start, hashes, record=self.rank == 0)  # the cached KV the new tokens read
            batch.append((req_id, run, start, start + n, hashes))
        gid = {name: g for g, group in enumerate(self.groups) for name in group.layer_names}
        for name in self.kv_caches:  # vLLM's attention: wait_for_layer_load, the layer, save_kv_layer
            per_layer = self.conn.has_connector_metadata()  # vLLM's wrapper asks before each layer
            if per_layer:
                self.conn.wait_for_layer_load(name)
            for _, run, start, end, hashes in batch:
                self._write(run, gid[name], name, start, end, hashes)
            if per_layer:
                self.conn.save_kv_layer(name, self.kv_caches[name], None)
        for req_id, run, _, end, hashes in batch:
            checksum = self._attend(run, req_id, end, hashes)  # what the last token attends to
            if self.rank == 0:
                run.checksum = checksum

    def _visible(self, g: int, start: int) -> range:
        spec = self.groups[g].kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        lo = 0 if window is None else max(0, start - (window - 1))
        return range(lo, start)

    def _attend(self, run: _ReqRun, req_id: str, start: int, hashes: list[int], record: bool = False) -> int:
        """Check every KV byte the token at position ``start`` attends to (positions before it);
        a checksum of them. ``record``: keep the bytes found at a request's first forward."""
        checksum = 0
        first = record and run.loaded_bytes is None and start > 0
        if first:
            run.loaded_bytes = {}
        for g, group in enumerate(self.groups):
            pos = self._visible(g, start)
            if not pos:
                continue
            bs = group.kv_cache_spec.block_size
            blocks = torch.tensor([run.table[g][p // bs] for p in pos], device=self.device)
            offs = torch.tensor([p % bs for p in pos], device=self.device)
            for name in group.layer_names:
                v, heads, row = self._layer_geometry(name)
                got = v[blocks, :, offs, :].cpu()
                want = expected_kv([hashes[p] for p in pos], self._layer_id(name), heads, row)
                if not torch.equal(got, want):
                    bad = (got != want).flatten(1).any(1).nonzero().flatten()
                    raise AssertionError(f"{req_id}: wrong KV in layer {name} of rank {self.rank} at positions "
                                         f"{[pos[i] for i in bad[:8].tolist()]} (of {len(pos)} visible)")
                checksum = (checksum + int(got.to(torch.int64).sum())) & 0xFFFFFFFF
                if first:
                    run.loaded_bytes[(name, pos.start, pos.stop)] = got.clone()
        return checksum

    def _write(self, run: _ReqRun, g: int, name: str, start: int, end: int, hashes: list[int]) -> None:
        """Layer ``name`` (of vLLM gid ``g``): the KV of positions ``[start, end)``."""
        bs = self.groups[g].kv_cache_spec.block_size
        pos = range(start, end)
        ids = [run.table[g][p // bs] for p in pos]
        assert 0 not in ids, "the toy forward would write vLLM's null block"
        blocks = torch.tensor(ids, device=self.device)
        offs = torch.tensor([p % bs for p in pos], device=self.device)
        v, heads, row = self._layer_geometry(name)
        v[blocks, :, offs, :] = expected_kv(hashes[start:end], self._layer_id(name), heads, row).to(self.device)


_ENGINE_NUMBERS = itertools.count(1)


class Engine:
    """One vLLM instance (scheduler + ``tp`` workers) with real kvdepot connectors; its KV caches
    on ``vllm_config.device_config.device`` (CPU or CUDA). ``rank_processes``: ranks 1.. run in
    processes of their own (`RankProcess`), as vLLM's multiprocess executor runs them.
    ``rank_worker_class``: the in-process ranks' class (a benchmark's faster forward)."""

    rank_worker_class = RankWorker

    def __init__(self, vllm_config: VllmConfig, layer_specs: dict, num_blocks: int = 256, tp: int = 1,
                 rank_processes: bool = False) -> None:
        if tp > 1:
            vllm_config.parallel_config.tensor_parallel_size = tp  # before the scheduler's connector
        self.vllm_config = vllm_config
        self.tp = tp
        self.kv_cache_config, sched_cfg, sbs, hbs = plan_kv_cache(vllm_config, layer_specs, num_blocks)
        self.hash_block_size = hbs
        self.scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=sched_cfg,
                                   structured_output_manager=StructuredOutputManager(vllm_config), block_size=sbs,
                                   hash_block_size=hbs, log_stats=True)
        self.sched_conn = self.scheduler.connector
        self.groups = sched_cfg.kv_cache_groups  # per-group specs (the worker's may wrap them per layer)
        self.runs: dict[str, _ReqRun] = {}
        # the worker side of each rank, as ensure_kv_transfer_initialized +
        # GPUModelRunner.initialize_kv_cache do it
        self.ranks: list[RankWorker | RankProcess] = []
        for rank in range(tp):
            if rank and rank_processes:
                self.ranks.append(RankProcess(vllm_config, self.kv_cache_config, self.groups, rank))
            else:
                self.ranks.append(self.rank_worker_class(vllm_config, self.kv_cache_config, self.groups, rank,
                                                         self.runs))
        self.workers = [r.conn for r in self.ranks if isinstance(r, RankWorker)]  # the in-process connectors
        self.worker_conn = self.workers[0]
        self.kv_caches = self.ranks[0].kv_caches  # rank 0's
        self.aggregator = KVOutputAggregator(tp) if tp > 1 else None
        self.steps = 0
        self._ids = 0
        self.number = next(_ENGINE_NUMBERS)  # request ids are unique across engines, as vLLM's are

    # ------------------------------------------------------------------ requests

    def add(self, prompt: list[int], max_tokens: int = 2, cache_salt: str | None = None, req_id: str = "",
            mm_features: list | None = None, prompt_embeds=None, lora_request=None) -> str:
        """``mm_features``: vLLM ``MultiModalFeatureSpec``s of the prompt (the toy model has no
        encoder: a test patches vLLM's scheduling of encoder inputs away). ``prompt_embeds``: a
        (len(prompt), hidden) tensor vLLM gets instead of the token ids (the toy forward still
        makes KV from ``prompt``, so give embeddings that differ where the tokens do).
        ``lora_request``: vLLM's ``LoRARequest`` of the request (the toy forward ignores it)."""
        self._ids += 1
        req_id = req_id or f"req-e{self.number}-{self._ids}"
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, EOS)
        req = Request(req_id, None if prompt_embeds is not None else list(prompt), sp, None, cache_salt=cache_salt,
                      mm_features=mm_features, prompt_embeds=prompt_embeds, lora_request=lora_request,
                      block_hasher=get_request_block_hasher(self.hash_block_size, sha256))
        self.scheduler.add_request(req)
        self.runs[req_id] = _ReqRun(list(prompt), len(prompt), [[] for _ in self.groups])
        return req_id

    def run(self, *req_ids: str, timeout_s: float = 20.0) -> None:
        """Step until the given requests (default: all) finished and vLLM freed their blocks.
        A step with nothing to compute sleeps 2 ms, as a real engine step takes time."""
        deadline = time.monotonic() + timeout_s
        while True:
            so = self.step()
            if not so.total_num_scheduled_tokens:
                time.sleep(0.002)
            pending = [r for r in (req_ids or self.runs) if r in self.scheduler.requests]
            if not pending and not self.scheduler.has_requests():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"requests not finished within {timeout_s} s: {pending}")

    # ------------------------------------------------------------------ one engine step

    def step(self):
        self.steps += 1
        so = self.scheduler.schedule()
        remote = [r for r in self.ranks if isinstance(r, RankProcess)]
        if remote:
            tokens = {r: self.runs[r].tokens for r in so.num_scheduled_tokens}
            for r in remote:
                r.pipe.send(("step", so, tokens))
        outs = [r.execute(so, update_states=r.rank == 0) if isinstance(r, RankWorker) else r.reply()
                for r in self.ranks]
        for rank, o in enumerate(outs):
            kv = o.kv_connector_output
            strays = set(kv.finished_recving or ()) | set(kv.finished_sending or ()) if kv else set()
            strays -= set(self.scheduler.requests)
            if strays:  # vLLM's scheduler would assert; say which worker and why
                raise AssertionError(f"engine {self.number} rank {rank} reported transfers of requests the "
                                     f"scheduler does not have: {sorted(strays)}; recving={kv.finished_recving} "
                                     f"sending={kv.finished_sending} stats={self.worker_stats(rank)}")
        if self.aggregator is None:
            out = copy.copy(outs[0])
        else:
            # vLLM's multiprocess executor receives each worker's output as a deserialized copy;
            # in one process, a step without work returns vLLM's module-level
            # EMPTY_MODEL_RUNNER_OUTPUT, into which `aggregate` would write this engine's
            # finished requests for every later engine to find
            out = self.aggregator.aggregate([copy.copy(o) for o in outs], output_rank=0)
        self._sample(so, out)
        self.scheduler.update_from_output(so, out)
        return so

    def _sample(self, so, out) -> None:
        """Bookkeeping after every rank's forward; puts the sampled tokens into ``out``."""
        if not so.total_num_scheduled_tokens:
            return
        sampled = {}
        for req_id, n in so.num_scheduled_tokens.items():
            run = self.runs[req_id]
            start = run.sched_computed
            run.computed += n
            if start + n >= len(run.tokens):
                hashes = prefix_hashes(run.tokens[:start + n])
                tok = 3 + (hashes[-1] + run.checksum) % 991
                run.tokens.append(tok)
                run.outputs.append(tok)
                sampled[req_id] = [tok]
            else:
                sampled[req_id] = []  # a partial prefill chunk samples nothing
        out.sampled_token_ids = [sampled[r] for r in out.req_ids]

    # ------------------------------------------------------------------ inspection

    def worker_stats(self, rank: int) -> dict:
        """The connector's counters of TP rank ``rank`` (asked over the pipe for a rank process)."""
        r = self.ranks[rank]
        return dict(r.conn.stats) if isinstance(r, RankWorker) else r.call("stats")

    def registration_id(self, rank: int) -> str | None:
        r = self.ranks[rank]
        return r.conn.registration_id if isinstance(r, RankWorker) else r.registration_id

    def kv_of(self, req_id: str, name: str, positions: range) -> torch.Tensor:
        """Bytes ``[P, H, C]`` of rank 0's layer ``name`` at ``positions`` of a running request."""
        run = self.runs[req_id]
        g = next(i for i, grp in enumerate(self.groups) if name in grp.layer_names)
        bs = self.groups[g].kv_cache_spec.block_size
        v = self.kv_caches[name].view(torch.int8)
        dev = v.device
        return v[torch.tensor([run.table[g][p // bs] for p in positions], device=dev), :,
                 torch.tensor([p % bs for p in positions], device=dev), :].cpu()

    def null_block_bytes(self) -> dict[str, torch.Tensor]:
        return {name: t.view(torch.int8)[0].cpu().clone() for name, t in self.kv_caches.items()}

    def close(self) -> None:
        self.sched_conn.shutdown()
        for r in self.ranks:
            r.conn.shutdown() if isinstance(r, RankWorker) else r.close()


def tokens(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids in [10, 1000)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(10, 1000, (n,), generator=g)).tolist()
