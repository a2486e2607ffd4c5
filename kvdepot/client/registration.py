"""A registration as the client holds it (`Registration`), the engine side of staged CUDA
transfers it may carry (`engine_staging`). `kvdepot.client.registrar.Registrar` makes and ends one."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from kvdepot.client.hashing import chunk_keys, namespace_seed
from kvdepot.protocol import messages as m

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
