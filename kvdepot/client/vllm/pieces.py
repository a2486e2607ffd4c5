"""What the worker's transfer thread (`kvdepot.client.vllm.mover`) keeps per transfer, and
what it hands the engine thread: pieces of store / load jobs, load jobs in flight, requests
sent, preemptions and results."""

from __future__ import annotations

import dataclasses
import threading

from kvdepot.client.client import PendingRetrieve, PendingStore
from kvdepot.client.vllm.plan import LoadJob


@dataclasses.dataclass(slots=True)
class Piece:
    """Up to a quarter of the staging ring of one store or load job."""

    req_id: str
    kind: str  # "store" / "load"
    keys: list[bytes]  # this shard's keys
    block_ids: list[list[int]]  # per daemon gid, registered (kernel) block ids
    parent: bytes = b""  # store: key of the chunk before
    cache_salt: str = ""
    skip_tokens: int = 0  # load
    load: Load | None = None  # load: the job it belongs to
    index: int = 0  # load: piece number within the job
    queued_at: float = 0.0
    waited: bool = False  # found the staging ring full at least once (counted in pieces_queued)
    after: object = None  # CUDA: the engine-stream event the gather / scatter must follow


@dataclasses.dataclass(slots=True)
class Load:
    """A load job in flight: reported once every piece ended."""

    job: LoadJob
    retrieved: list[int | None]  # per piece: chunks written (None: not ended yet)
    chunks: list[int]  # per piece: chunks asked for


@dataclasses.dataclass(slots=True)
class Op:
    piece: Piece
    pending: PendingStore | PendingRetrieve
    generation: int  # the client's boot generation when sent
    sent_at: float
    late: bool = False  # rpc_timeout_s passed (logged, daemon marked down)


class Preemption:
    """A `TransferThread.preempt` in progress: ``done`` is set once the thread dropped the
    requests' queued stores; ``event`` (CUDA) follows every gather the thread queued before."""

    __slots__ = ("req_ids", "done", "event")

    def __init__(self, req_ids: set[str]) -> None:
        self.req_ids = req_ids
        self.done = threading.Event()
        self.event = None


@dataclasses.dataclass(slots=True)
class Results:
    """What the transfer thread reports to the engine thread (taken by `TransferThread.take`)."""

    sending: set[str] = dataclasses.field(default_factory=set)  # finished requests whose transfers ended
    recving: set[str] = dataclasses.field(default_factory=set)  # loads that ended (ok or not)
    failed_recving: set[str] = dataclasses.field(default_factory=set)
    invalid_blocks: set[int] = dataclasses.field(default_factory=set)
    scatter_event: object = None  # CUDA: recorded after the scatters of every load in ``recving``


__all__ = ["Piece", "Load", "Op", "Preemption", "Results"]
