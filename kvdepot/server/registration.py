"""An engine's registration as the daemon holds it: its layout, mapped memory (shared memory
for CPU engines; IPC-opened storages, staging buffer and fence words for CUDA engines), and the
bookkeeping of its transfers (in flight, staged requests a `Drain` waits for)."""

from __future__ import annotations

import collections
import dataclasses
import os

import torch

from kvdepot.gpu.cpu_engine import CpuTransferEngine
from kvdepot.gpu.layout import EngineLayout
from kvdepot.protocol.errors import ErrorCode, RequestError


@dataclasses.dataclass(eq=False)
class Registration:
    """One engine's registered KV caches (daemon side)."""

    id: str
    model: str
    shard: str
    pid: int
    device: str
    layout: EngineLayout
    storages: list[torch.Tensor] | None  # mapped engine memory; None once unmapped
    engine: CpuTransferEngine | None
    active: int = 0  # transfers in flight using the mappings
    closed: bool = False  # unregistered; unmap when active reaches 0
    stored_chunks: int = 0
    retrieved_chunks: int = 0
    # (fd, registered size) per storage: the mapped files, fstat-ed before every transfer because
    # touching a mapping beyond a file the engine shrank kills the daemon with SIGBUS
    files: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # CUDA engines: device ordinal, IPC-opened storages
    cuda_device: int | None = None
    cuda_storages: list = dataclasses.field(default_factory=list)
    # the engine's fence words (`kvdepot.gpu.cuda_path.FenceWords`, `Register.fence`), or None
    fence: object = None
    # staged requests accepted and not finished, by staging_seq; staged requests with a seq up
    # to refuse_through are refused; Drains waiting: (through_seq, identity, rid) (`m.Drain`)
    staged_busy: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    refuse_through: int = 0
    drains: list = dataclasses.field(default_factory=list)
    # Stores / Retrieves accepted and not finished, by (client identity, rid); a client's
    # requests with a rid up to settled[identity] are refused; Settles waiting:
    # (through_rid, identity, rid) (`m.Settle`)
    busy_rids: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    settled: dict = dataclasses.field(default_factory=dict)
    settles: list = dataclasses.field(default_factory=list)
    # the engine's staging buffer (`Register.staging`), IPC-opened: device pointer and bytes (0: none)
    staging_ptr: int = 0
    staging_bytes: int = 0
    on_release: object = None  # callable closing the CUDA mappings
    identity: bytes = b""  # the client connection that registered it (kvdepot.server.liveness)
    watch_pid: int = 0  # the pid whose exit reclaims it (0: none; see kvdepot.server.liveness)
    metric_children: dict = dataclasses.field(default_factory=dict)  # op -> bound metric children

    def release_memory(self) -> None:
        self.engine = None
        self.storages = None  # last reference: torch unmaps
        for fd, _ in self.files:
            os.close(fd)
        self.files = []
        if self.on_release is not None:
            self.on_release(self.cuda_storages)
            self.on_release = None
            self.cuda_storages = []
        if self.fence is not None:
            self.fence.close()
            self.fence = None

    def check_memory(self) -> None:
        """Raises RequestError(ENGINE_MEMORY) if a storage file shrank below its registered size."""
        for sid, (fd, size) in enumerate(self.files):
            actual = os.fstat(fd).st_size
            if actual < size:
                raise RequestError(ErrorCode.ENGINE_MEMORY,
                                   f"shared memory of storage {sid} shrank to {actual} bytes (registered {size}); "
                                   "the engine must keep its KV-cache segment intact while registered")
