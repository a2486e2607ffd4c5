"""A registration as the client holds it (`Registration`), the engine side of staged CUDA
transfers it may carry (`engine_staging`), and `KVDepotClient`'s calls that make and end one
(`Registrations`)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

import msgspec.structs

from kvdepot.client.hashing import chunk_keys, namespace_seed
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError
from kvdepot.protocol.fdpass import fds_path, pass_fds
from kvdepot.protocol.transport import ipc_path

log = logging.getLogger("kvdepot.client")


@dataclasses.dataclass
class Registration:
    """A registration as the client holds it.

    Attributes:
        id: registration id to put in Store / Retrieve.
        layout_fingerprint: what the daemon says the chunk bytes mean.
        object_bytes: bytes of one chunk object.
        boot_id: daemon boot the registration belongs to.
        request: the `Register` message (kept to re-register after a daemon restart).
        chains: the daemon takes several prompts' runs in one Store / Retrieve
            (`RegisterReply.chains`; `KVDepotClient.submit_store_many`).
    """

    id: str
    layout_fingerprint: str
    object_bytes: int
    boot_id: str
    request: m.Register
    # CUDA engines: the engine-side staging (`kvdepot.client.staging.EngineStaging`) when the
    # daemon serves it, else None (the daemon gathers and scatters the blocks itself)
    staging: object = dataclasses.field(default=None, repr=False, compare=False)
    # CPU engines with sealed memfds: the descriptor of each "memfd" storage (None for others),
    # passed to the daemon again at every (re)registration
    storage_fds: list | None = dataclasses.field(default=None, repr=False, compare=False)
    chains: bool = False

    @property
    def model(self) -> str:
        return self.request.model

    @property
    def chunk_size(self) -> int:
        return self.request.chunk_size

    def seed(self, cache_salt: str = "") -> bytes:
        """Namespace seed of this registration's chunk chains for one tenant."""
        return namespace_seed(self.request.model, self.layout_fingerprint, cache_salt)

    def keys(self, token_ids: Sequence[int], cache_salt: str = "") -> list[bytes]:
        """This shard's chunk keys of the whole chunks of ``token_ids``."""
        return chunk_keys(self.seed(cache_salt), token_ids, self.request.chunk_size, self.request.shard)


def engine_staging(req: m.Register, local_storages: Sequence, staging_bytes: int | None, load_staging_bytes: int = 0):
    """The engine side of staged transfers (`EngineStaging`: a ring of ``staging_bytes``, default
    256 MiB, and one of ``load_staging_bytes`` for retrieves alone where not 0), or None (logged)
    where this process cannot run the kernels. Where the GPU has no room for the second ring,
    retrieves share the first (logged) rather than staging going off altogether."""
    import torch

    from kvdepot.client.staging import DEFAULT_STAGING_BYTES, EngineStaging
    from kvdepot.gpu.kernels import KernelError, load_kernels
    from kvdepot.gpu.layout import group_layers

    try:
        kernels = load_kernels()
        if kernels is None:
            raise KernelError("the kernel library is unavailable here")
        layout = group_layers(req.layers, req.groups, req.chunk_size, [s.size_bytes for s in req.storages])
        ring_bytes = staging_bytes or DEFAULT_STAGING_BYTES
        if load_staging_bytes:
            try:
                return EngineStaging(kernels, local_storages[0].device, layout, local_storages, ring_bytes,
                                     load_staging_bytes)
            except (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError)) as exc:
                log.warning("no GPU memory for a %d-byte ring for retrieves (%s): retrieves share the staging ring",
                            load_staging_bytes, exc)
        return EngineStaging(kernels, local_storages[0].device, layout, local_storages, ring_bytes)
    except Exception as exc:  # noqa: BLE001 - the daemon-side path still works
        log.warning("engine-side staging off (the daemon gathers): %s", exc)
        return None


class Registrations:
    """`KVDepotClient`'s registration calls (a mixin: it uses the client's ``call``,
    ``endpoint``, ``timeout_s`` and ``boot_id``)."""

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
            path = ipc_path(self.endpoint)
            if path is None:
                raise KVDepotError(ErrorCode.FORBIDDEN, "memfd storages need the daemon's ipc:// endpoint")
            req.storages = [msgspec.structs.replace(st, name=pass_fds(fds_path(path), [fd], self.timeout_s))
                            if fd is not None else st for st, fd in zip(req.storages, storage_fds)]
        req.fence, req.fence_words = "", 0
        if staging is not None and staging.fence is not None:
            path = ipc_path(self.endpoint)
            if path is not None:  # else (tcp://) stores wait for their gathers here
                try:
                    req.fence = pass_fds(fds_path(path), [staging.fence.fd], self.timeout_s)
                    req.fence_words = staging.fence.words
                except (OSError, KVDepotError) as exc:
                    log.warning("cannot pass the fence words (%s): staged stores wait for their gathers", exc)
        r = self.call(req)
        self.boot_id = r.boot_id
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
            self.call(m.Unregister(rid=0, registration=reg.id))
        finally:
            if reg.staging is not None:
                reg.staging.open_gates()
