"""`KVDepotConnector`: kvdepot as vLLM's KV connector (vLLM >= 0.33, KV connector API v1).

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVDepotConnector",
        "kv_connector_module_path": "kvdepot.client.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"endpoint": "ipc:///run/kvdepot.sock"}}'

vLLM builds one SCHEDULER-role instance in its engine core
(`kvdepot.client.vllm.scheduler.SchedulerConnector`) and one WORKER-role instance per worker
(`kvdepot.client.vllm.worker.WorkerConnector`); the scheduler's plan reaches the workers as
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
    SupportsHMA,
)

from kvdepot.client.vllm.config import EXTRA_CONFIG, ConnectorConfig, check_chunk_size
from kvdepot.client.vllm.layout import layout_name, predict_fingerprint, transfer_groups
from kvdepot.client.vllm.shards import stored_layer_specs, tp_shards
from kvdepot.client.vllm.stats import KVDepotPromMetrics, KVDepotStats, StatsTaker
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

    vLLM constructs this class once per role; what it gets is the role's class, whose methods
    are the calls vLLM makes on that role (nothing forwards them):
    `kvdepot.client.vllm.worker.WorkerConnector` for WORKER, and
    `kvdepot.client.vllm.scheduler.SchedulerConnector` for SCHEDULER. Each names its role in its
    class statement (``class WorkerConnector(KVDepotConnector, role=KVConnectorRole.WORKER)``).
    This class holds what both roles share: the checked configuration, the transfer groups, the
    layout fingerprint, the model identity and the metrics calls. A connector built on kvdepot's
    subclasses a role class; a direct subclass of this one raises TypeError when built.

    Attributes set here (read-only after construction): ``cfg`` (`ConnectorConfig`),
    ``groups`` (`TransferGroup` per daemon gid), ``fingerprint``, ``model_id``
    (`model_identity`), ``disabled_reason`` ("" when kvdepot is used), ``device_type``
    ("cuda", "cpu", ...), ``single_group`` (vLLM has one KV-cache group) and ``tp_shards``
    (`kvdepot.client.vllm.shards.TPShards` of the engine's tensor-parallel ranks). A role class
    sets ``stats`` (its counters) and ``_stats`` (their `StatsTaker`).

    Raises (at construction, so vLLM refuses to start and says why):
        ValueError: an invalid ``kv_connector_extra_config`` (e.g. ``chunk_size`` not a multiple
            of every KV-cache group's tokens per block) or ``kv_load_failure_policy`` not
            ``"recompute"``.
    """

    _role_classes: dict[KVConnectorRole, type[KVDepotConnector]] = {}
    stats: dict[str, float]
    _stats: StatsTaker

    def __init_subclass__(cls, role: KVConnectorRole | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if role is not None:
            KVDepotConnector._role_classes[role] = cls

    def __new__(cls, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        if cls is KVDepotConnector:
            cls = KVDepotConnector._role_classes[role]  # (both are imported with this package)
        elif not issubclass(cls, tuple(KVDepotConnector._role_classes.values())):
            raise TypeError(f"{cls.__name__} subclasses KVDepotConnector, which has no role's calls: subclass "
                            "kvdepot.client.vllm.WorkerConnector or SchedulerConnector instead")
        return super().__new__(cls)

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
        self.cfg = cfg
        self.groups = groups
        self.fingerprint = fingerprint
        self.model_id = model_identity(vllm_config, cfg)
        self.disabled_reason = reason
        self.device_type = _device_type(vllm_config)
        self.single_group = len(kv_cache_config.kv_cache_groups) == 1
        self.tp_shards = tp_shards(stored_layer_specs(kv_cache_config, groups),
                                   vllm_config.parallel_config.tensor_parallel_size)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return None  # every vLLM 0.33 layout is understood; objects are layout-independent

    # ------------------------------------------------------------------ the other role's calls

    def _not_this_role(self, call: str):
        return RuntimeError(f"kvdepot: vLLM called {call} on its {self._role.name}-role connector")

    # the abstract calls of each role (vLLM's and `SupportsHMA`'s): the role classes define
    # their own, and vLLM never makes the other role's
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        raise self._not_this_role("get_num_new_matched_tokens")

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        raise self._not_this_role("update_state_after_alloc")

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        raise self._not_this_role("build_connector_meta")

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        raise self._not_this_role("request_finished_all_groups")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        raise self._not_this_role("start_load_kv")

    def wait_for_save(self) -> None:
        raise self._not_this_role("wait_for_save")

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

    # ------------------------------------------------------------------ metrics (kvdepot.client.vllm.stats)

    def get_kv_connector_stats(self) -> KVDepotStats | None:
        """The increases of this role's counters since the last report, at most once a second
        (`StatsTaker`; the worker's transfers, the scheduler's pins), else None. vLLM adds the
        scheduler's to the workers' (``Scheduler.update_from_output``)."""
        return self._stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVDepotStats:
        return KVDepotStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVDepotPromMetrics:
        """``vllm:kvdepot_*`` counters on vLLM's ``/metrics`` (`kvdepot.client.vllm.stats.COUNTERS`)."""
        return KVDepotPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _device_type(vllm_config) -> str:
    dc = getattr(vllm_config, "device_config", None)
    dev = getattr(dc, "device", None)
    if isinstance(dev, torch.device):
        return dev.type
    return str(getattr(dc, "device_type", "") or "cuda")


__all__ = ["KVDepotConnector", "EXTRA_CONFIG"]
