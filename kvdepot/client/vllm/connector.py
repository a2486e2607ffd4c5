"""`KVDepotConnector`: kvdepot as vLLM's KV connector (vLLM >= 0.33, KV connector API v1).

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVDepotConnector",
        "kv_connector_module_path": "kvdepot.client.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"endpoint": "ipc:///run/kvdepot.sock"}}'

vLLM builds one SCHEDULER-role instance in its engine core (`SchedulerSide`) and one
WORKER-role instance per worker (`WorkerSide`); the scheduler's plan reaches the workers as
`KVDepotMetadata`. The connector is a best-effort cache: whatever the daemon does (down, slow,
restarted), vLLM recomputes what could not be loaded and skips what could not be stored.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvdepot.client.vllm.config import EXTRA_CONFIG, ConnectorConfig, check_chunk_size
from kvdepot.client.vllm.layout import ShmSegments, layout_name, predict_fingerprint, transfer_groups
from kvdepot.client.vllm.scheduler import SchedulerSide
from kvdepot.client.vllm.stats import KVDepotPromMetrics, KVDepotStats, StatsTaker
from kvdepot.client.vllm.worker import WorkerSide
from kvdepot.protocol.errors import RequestError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("kvdepot.vllm")


def model_identity(vllm_config, cfg: ConnectorConfig) -> str:
    """What the chunk keys say the KV belongs to, also the daemon's ``model`` label.

    ``"{model}|rev={revision}|q={quantization}|kv={cache_dtype}"``, where ``model`` and
    ``rev`` are vLLM's model name or path and revision, or ``model_id`` with an empty revision
    where configured (it says which weights these are, nothing else). Appended only where they
    apply, so that other engines' keys stay as they were: ``|dtype={model dtype}`` when the
    KV-cache dtype is not ``auto`` (with ``auto`` the KV dtype is the model's and is already in
    the layout fingerprint; an fp8 cache of a bfloat16 and of a float16 run hold other bytes),
    and ``|hf={16 hex digits}``, a hash of ``--hf-overrides`` when set (a ``rope_theta`` or
    ``rope_scaling`` override gives other KV for the same weights and tokens; a callable
    override is known by its module and qualified name only)."""
    mc = vllm_config.model_config
    name, rev = (cfg.model_id, "") if cfg.model_id else (str(mc.model), mc.revision or "")
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    parts = [name, f"rev={rev}", f"q={mc.quantization or ''}", f"kv={cache_dtype}"]
    if cache_dtype != "auto":
        parts.append(f"dtype={str(mc.dtype).removeprefix('torch.')}")
    overrides = getattr(mc, "hf_overrides", None)
    if callable(overrides):
        overrides = f"callable:{overrides.__module__}.{overrides.__qualname__}"
    if overrides:
        text = json.dumps(overrides, sort_keys=True, default=repr, separators=(",", ":"))
        parts.append("hf=" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest())
    return "|".join(parts)


def _unsupported_parallelism(vllm_config) -> str:
    pc = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(pc, name, 1) > 1:
            return f"{name}={getattr(pc, name)} is not supported by kvdepot yet (tensor parallelism is)"
    return ""


class KVDepotConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by the kvdepot daemon (see the module docstring).

    Raises (at construction, so vLLM refuses to start and says why):
        ValueError: an invalid ``kv_connector_extra_config`` (e.g. ``chunk_size`` not a multiple
            of every KV-cache group's tokens per block) or ``kv_load_failure_policy`` not
            ``"recompute"``.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        policy = getattr(ktc, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            raise ValueError(
                f"kvdepot needs \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config (got {policy!r}): "
                "a cache miss or an unreachable daemon must make vLLM recompute, not fail the request")
        groups, reason = transfer_groups(kv_cache_config)
        reason = reason or _unsupported_parallelism(vllm_config)
        if groups:
            check_chunk_size(cfg.chunk_size, [g.block_size for g in groups])
        fingerprint = ""
        if not reason:
            try:
                fingerprint = predict_fingerprint(kv_cache_config, groups, cfg.chunk_size,
                                                  layout_name(kv_cache_config, vllm_config.cache_config))
            except RequestError as exc:
                reason = f"the daemon could not describe this KV-cache layout: {exc.message}"
        if reason:
            log.warning("kvdepot: vLLM runs without kvdepot: %s", reason)
        self.config = cfg
        self.model_id = model_identity(vllm_config, cfg)
        self.disabled_reason = reason
        self._device_type = _device_type(vllm_config)
        self._shm: ShmSegments | None = None
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        args = (cfg, vllm_config, kv_cache_config, groups, fingerprint, self.model_id, reason)
        self._stats: StatsTaker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(*args)
            self._stats = StatsTaker(self.scheduler.stats, balanced=("blocks_pinned", "blocks_unpinned"))
        else:
            self.worker = WorkerSide(*args)
            self._stats = StatsTaker(self.worker.stats)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return None  # every vLLM 0.33 layout is understood; objects are layout-independent

    # ------------------------------------------------------------------ worker side

    def get_mem_pool_context(self):
        """CPU workers: allocate the KV cache in shared memory, where the daemon can map it."""
        if self.worker is None or self._device_type != "cpu" or self.disabled_reason:
            return None
        if self._shm is None:
            self._shm = ShmSegments()
        return self._shm.allocation_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward: the step's plan (`WorkerSide.bind`). The base class's
        ``_connector_metadata`` is not kept: nothing reads it, as ``has_connector_metadata`` is
        always False."""
        if self.worker is not None:
            self.worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if self.worker is not None:
            self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Nothing left to start, most steps: the loads went out in `bind_connector_metadata`."""
        self.worker.start_load_kv()

    def has_connector_metadata(self) -> bool:
        # vLLM's attention layers call wait_for_layer_load and save_kv_layer around each layer
        # only while this is True (vllm.model_executor.layers.attention.kv_transfer_utils).
        # Loads never wait per layer and whole chunks are stored after the forward, by the
        # worker's transfer thread: the per-layer calls would do nothing.
        return False

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only after get_finished reported its load

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # whole chunks are gathered after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """This step's ended transfers (`WorkerSide.get_transfer_results`)."""
        return self.worker.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self):
        """Worker: the pinned saves that ended since the last step (`KVDepotWorkerMeta`), or None."""
        return self.worker.worker_meta() if self.worker is not None else None

    # ------------------------------------------------------------------ metrics (kvdepot.client.vllm.stats)

    def get_kv_connector_stats(self) -> KVDepotStats | None:
        """The increases of this side's counters since the last report, at most once a second
        (`StatsTaker`; the worker's transfers, the scheduler's pins), else None. vLLM adds the
        scheduler's to the workers' (``Scheduler.update_from_output``)."""
        return self._stats.take() if self._stats is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVDepotStats:
        return KVDepotStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVDepotPromMetrics:
        """``vllm:kvdepot_*`` counters on vLLM's ``/metrics`` (`kvdepot.client.vllm.stats.COUNTERS`)."""
        return KVDepotPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self._shm is not None:
            self._shm.close()

    # ------------------------------------------------------------------ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        if self.scheduler is not None:
            self.scheduler.bind_block_pool(gpu_block_pool)
            if not self.scheduler.pins_stores:  # nothing is ever pinned: no pair to keep balanced
                self._stats.balanced = None

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return tuple(g.vllm_gid for g in self.scheduler.groups) if self.scheduler is not None else ()

    def on_new_request(self, request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def take_events(self):
        """vLLM's KV events of what the depot holds of this engine's prompts
        (`kvdepot.client.vllm.events`; with ``--kv-events-config``)."""
        return self.scheduler.take_events() if self.scheduler is not None else ()

    def reset_cache(self) -> bool | None:
        if self.scheduler is None:
            return None
        return self.scheduler.reset_cache()


def _device_type(vllm_config) -> str:
    dc = getattr(vllm_config, "device_config", None)
    dev = getattr(dc, "device", None)
    if isinstance(dev, torch.device):
        return dev.type
    return str(getattr(dc, "device_type", "") or "cuda")


__all__ = ["KVDepotConnector", "EXTRA_CONFIG"]
