"""A vLLM worker's registration with the daemon (`WorkerRegistrar`): vLLM's KV caches described
once (`kvdepot.client.vllm.layout.build_registration`), registered, registered again after a
daemon restart, or the connector turned off on this worker with the reason."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from kvdepot.client.client import KVDepotClient
from kvdepot.client.vllm.config import STAGING_MIN_BYTES, ConnectorConfig, auto_staging_bytes, load_ring_bytes
from kvdepot.client.vllm.layout import Registration, TransferGroup, build_registration
from kvdepot.client.vllm.sender import DOWN
from kvdepot.gpu.layout import group_layers
from kvdepot.protocol.errors import KVDepotError

log = logging.getLogger("kvdepot.vllm")


class WorkerRegistrar:
    """One worker's registration (see the module docstring). `register_caches` runs on the
    engine thread before the transfer thread starts; after that only the transfer thread calls
    `ready` and `disable`, and the engine thread reads ``kvreg`` / ``generation`` by one
    reference each (`registration_id`).

    Args:
        client: the worker's client.
        cfg: the connector's configuration (chunk size, staging ring bytes).
        model_id, shard: what the registration is named by (the scheduler's keys use them too).
        fingerprint: the layout fingerprint the scheduler computed: a registration whose
            daemon-side fingerprint differs turns the connector off (keys would name other bytes).
        max_step_tokens: vLLM's ``max_num_batched_tokens`` (0: unknown), for the ring's size.
        sliding: a model whose stores are skipped when the ring is full (sliding-window groups).
        disabled_reason: why the connector is off from the start ("" if it is not).

    Attributes:
        reg: what vLLM's caches look like (None until `register_caches`, or if they cannot be described).
        kvreg: the client's `kvdepot.client.registration.Registration` (None: not registered
            with the live daemon).
        generation: the client's ``generation`` when ``kvreg`` was made (-1: register again).
        disabled_reason: why the connector is off on this worker ("" while it is on).
    """

    def __init__(self, client: KVDepotClient, cfg: ConnectorConfig, model_id: str, shard: str, fingerprint: str,
                 max_step_tokens: int, sliding: bool, disabled_reason: str) -> None:
        self.client = client
        self.cfg = cfg
        self.model_id = model_id
        self.shard = shard
        self.fingerprint = fingerprint
        self.max_step_tokens = max_step_tokens
        self.sliding = sliding
        self.disabled_reason = disabled_reason
        self.reg: Registration | None = None
        self.kvreg = None
        self.generation = -1

    @property
    def registration_id(self) -> str | None:
        """The daemon's id of this worker's registration, while it is current."""
        kvreg = self.kvreg
        return kvreg.id if kvreg is not None and self.generation == self.client.generation else None

    def register_caches(self, kv_caches: Mapping[str, torch.Tensor], kv_cache_config,
                        groups: list[TransferGroup]) -> None:
        """Describe vLLM's caches (vLLM's ``KVCacheConfig`` and this connector's transfer
        groups) and register them; a layout that cannot be described, or a registration the
        daemon refuses, turns the connector off on this worker (logged); a daemon that does not
        answer is registered with later (`ready`)."""
        if self.disabled_reason:
            log.warning("kvdepot: connector disabled: %s", self.disabled_reason)
            return
        try:
            self.reg = build_registration(kv_caches, kv_cache_config, groups)
        except ValueError as exc:
            self.disable(str(exc))
        else:
            self._register()

    def disable(self, why: str) -> None:
        log.error("kvdepot: connector disabled on this worker (vLLM keeps serving without it): %s", why)
        self.disabled_reason = why
        self.kvreg = None

    def ready(self) -> bool:
        """Registered with a live daemon (registers again after a restart); transfer thread only."""
        if self.disabled_reason or self.reg is None:
            return False
        c = self.client
        if not c.available():
            return False
        c.poll()  # reads a close of the connection by a daemon that stopped (connected turns False)
        if self.kvreg is not None and not c.conn.connected:
            # the daemon closed the connection: a restarted one would not know the registration.
            # One round trip on the new connection learns its boot id (then generation says).
            try:
                c.ping()
            except KVDepotError as exc:
                log.warning("kvdepot: the daemon does not answer (%s)", exc)
                c.mark_down()
                return False
        if self.kvreg is None or self.generation != c.generation:
            return self._register()
        return True

    def staging_bytes(self) -> int:
        """The staging ring's bytes: ``staging_bytes`` of the config, or where that is 0
        `auto_staging_bytes` for this worker's chunk bytes (from the registration's layout)."""
        if self.cfg.staging_bytes or self.reg is None:
            return self.cfg.staging_bytes or STAGING_MIN_BYTES
        reg = self.reg
        sizes = [s.size_bytes for s in reg.storages]
        chunk_bytes = group_layers(reg.layers, reg.groups, self.cfg.chunk_size, sizes).object_bytes
        return auto_staging_bytes(chunk_bytes, self.cfg.chunk_size, self.max_step_tokens or self.cfg.chunk_size,
                                  self.sliding)

    def _register(self) -> bool:
        reg, c = self.reg, self.client
        try:
            if self.kvreg is not None:
                new = c.reregister(self.kvreg)
            else:
                new = c.register(self.model_id, self.shard, self.cfg.chunk_size, reg.storages, reg.layers, reg.groups,
                                 device=reg.device, local_storages=reg.local if reg.device == "cuda" else None,
                                 staging_bytes=self.staging_bytes(), storage_fds=reg.storage_fds,
                                 load_staging_bytes=load_ring_bytes(self.cfg))
        except KVDepotError as exc:
            if exc.code in DOWN:
                log.warning("kvdepot: registration failed (%s); retrying while the daemon is reachable", exc)
                c.mark_down()
            else:
                self.disable(f"the daemon refused the KV-cache registration: {exc}")
            return False
        if new.layout_fingerprint != self.fingerprint:
            self.disable(f"layout fingerprint {new.layout_fingerprint} differs from the scheduler's "
                         f"{self.fingerprint}: chunk keys would name other bytes")
            return False
        self.kvreg = new
        self.generation = c.generation
        st = new.staging
        log.info("kvdepot: registered %d layers as %s (%d bytes per chunk%s)", len(reg.layers), new.id, new.object_bytes,
                 f", engine-side staging: {st.ring.size_bytes >> 20} MiB ring"
                 + (f" and {st.load_ring.size_bytes >> 20} MiB for loads" if st.load_ring is not st.ring else "")
                 if st is not None else "")
        return True
