"""`Registrar`: the calls that make and end a registration (`kvdepot.client.registration`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import msgspec.structs

from kvdepot.client.connection import Connection
from kvdepot.client.registration import Registration, engine_staging
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError
from kvdepot.protocol.fdpass import fds_path, pass_fds
from kvdepot.protocol.transport import ipc_path

log = logging.getLogger("kvdepot.client")


class Registrar:
    """Registers engines' KV caches on ``conn`` (a `kvdepot.client.connection.Connection`:
    its ``call``, ``endpoint`` and ``timeout_s``; a registration's reply sets its ``boot_id``)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def register(self, model: str, shard: str, chunk_size: int, storages: list[m.StorageSpec],
                 layers: list[m.LayerSpec], groups: list[m.KVGroupSpec], device: str = "cpu",
                 local_storages: Sequence | None = None, staging_bytes: int | None = None,
                 storage_fds: Sequence[int | None] | None = None, load_staging_bytes: int = 0) -> Registration:
        """Register an engine's KV caches.

        storage_fds: CPU engines with sealed memfds (`kvdepot.client.kvcache.ShmKVCache` with
            ``sealed=True``): per storage, its descriptor for a ``"memfd"`` storage, else None.
            They are passed to the daemon over its descriptor socket (`kvdepot.protocol.fdpass`)
            before the `Register` message, which names them by token.

        local_storages: CUDA engines: this process's tensors of ``storages`` (same order; layer
            offsets are relative to their ``data_ptr()``). With them, and the kernel library
            loadable here, this process gathers and scatters the blocks on the engine's streams
            through a device staging ring of ``staging_bytes`` (default 256 MiB) shared with
            the daemon, which then only copies over PCIe (see `kvdepot.client.staging` for why).
            Without them, or ``staging_bytes=0``, the daemon gathers and scatters itself.
            ``load_staging_bytes`` (staged only): 0, or a second ring of that many bytes for
            retrieves alone, so that a retrieve never waits for ring room behind stores the
            daemon is still copying out (`kvdepot.client.staging.EngineStaging`).

        Raises:
            KVDepotError: LAYOUT (layers the daemon cannot describe, chunk size not a multiple
                of a group's tokens per block), ENGINE_MEMORY (shared memory not found), ...
        """
        if any(st.kind == "memfd" for st in storages) and (
                storage_fds is None or len(storage_fds) != len(storages)
                or any((fd is None) != (st.kind != "memfd") for st, fd in zip(storages, storage_fds))):
            raise ValueError("every memfd storage needs its descriptor in storage_fds (and only those)")
        req = m.Register(rid=0, model=model, shard=shard, chunk_size=chunk_size, storages=storages, layers=layers,
                         groups=groups, pid=os.getpid(), device=device)
        staging = None
        if device != "cpu" and local_storages is not None and staging_bytes != 0:
            staging = engine_staging(req, local_storages, staging_bytes, load_staging_bytes)
            if staging is not None:
                req.staging = staging.spec
        return self._register(req, staging, list(storage_fds) if storage_fds is not None else None)

    def _register(self, req: m.Register, staging=None, storage_fds: list | None = None) -> Registration:
        if storage_fds:  # a fresh token per registration: the daemon takes each passed set once
            path = ipc_path(self.conn.endpoint)
            if path is None:
                raise KVDepotError(ErrorCode.FORBIDDEN, "memfd storages need the daemon's ipc:// endpoint")
            req.storages = [msgspec.structs.replace(st, name=pass_fds(fds_path(path), [fd], self.conn.timeout_s))
                            if fd is not None else st for st, fd in zip(req.storages, storage_fds)]
        req.fence, req.fence_words = "", 0
        if staging is not None and staging.fence is not None:
            path = ipc_path(self.conn.endpoint)
            if path is not None:  # else (tcp://) stores wait for their gathers here
                try:
                    req.fence = pass_fds(fds_path(path), [staging.fence.fd], self.conn.timeout_s)
                    req.fence_words = staging.fence.words
                except (OSError, KVDepotError) as exc:
                    log.warning("cannot pass the fence words (%s): staged stores wait for their gathers", exc)
        r = self.conn.call(req)
        self.conn.boot_id = r.boot_id
        if staging is not None:
            staging.fence_active = bool(r.fence and req.fence)
            staging.landed_active = bool(staging.fence_active and r.landed)
        if staging is not None and (not r.staging or r.layout_fingerprint != staging.layout.fingerprint
                                    or r.object_bytes != staging.object_bytes):
            staging.close()  # the daemon does not serve it (no kernel library there), or another layout
            staging = None
            req.staging = None
        return Registration(r.registration, r.layout_fingerprint, r.object_bytes, r.boot_id, req, staging,
                            storage_fds, r.chains)

    def reregister(self, reg: Registration) -> Registration:
        """Register ``reg``'s caches again (after a daemon restart). The staging ring starts
        empty: the old daemon, gone, copies nothing more, and the regions of requests lost with
        it would otherwise stay taken."""
        new = self._register(reg.request, reg.staging, reg.storage_fds)
        if new.staging is not None and new.boot_id != reg.boot_id:
            for ring in new.staging.rings:
                ring.reset(new.staging.fence)
        return new

    def unregister(self, reg: Registration) -> None:
        """Unregister ``reg``'s caches. Gated scatters of retrieves nobody took the result of
        (`submit_retrieve`'s ``scatter_on``) are let run, writing only what landed."""
        try:
            self.conn.call(m.Unregister(rid=0, registration=reg.id))
        finally:
            if reg.staging is not None:
                reg.staging.open_gates()
