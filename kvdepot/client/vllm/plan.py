"""Chunk / block arithmetic and the scheduler -> worker metadata of the vLLM connector.

Tokens, chunks and blocks (C = chunk_size, a multiple of every group's block size b_g)::

    tokens   0         C         2C        3C
             |---------|---------|---------|------ ...
    chunk    [   0     ][   1    ][   2    ]         chunk i = tokens [i*C, (i+1)*C)
    gid 0    [b][b][b][b][b][b]...                   b_0 = C/4: blocks 4i .. 4i+3 hold chunk i
    gid 1    [ B  ][ B  ][ B  ]...                   b_1 = C/2: blocks 2i .. 2i+1 hold chunk i

A load of a request whose own prefix cache already holds ``local`` tokens and to which the
connector promised tokens up to ``end``::

    local = 1.5C, end = 3C
    tokens   0         C    local    2C        3C
             |---------|----|====|---------|
    chunks                [   1    ][   2    ]       first_chunk = local // C = 1, 2 chunks
    skip_tokens = local - first_chunk * C = 0.5C     (the daemon writes none of those blocks)

vLLM hands the connector block ids per vLLM gid for the whole request; `chunk_block_ids`
slices the ones of a chunk range for one group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

try:  # vLLM >= 0.33: the workers' per-step answer to the scheduler-side connector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM: no store pins (`SchedulerConnector.bind_gpu_block_pool`)
    KVConnectorWorkerMetadata = None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_block_ids(block_ids: Sequence[int], block_size: int, chunk_size: int, first_chunk: int,
                    end_chunk: int) -> list[int] | None:
    """Block ids holding chunks ``[first_chunk, end_chunk)`` of one group, in token order;
    None if ``block_ids`` (the request's table) does not reach that far."""
    assert chunk_size % block_size == 0, f"chunk_size {chunk_size} not a multiple of block size {block_size}"
    per = chunk_size // block_size
    lo, hi = first_chunk * per, end_chunk * per
    if hi > len(block_ids):
        return None
    got = block_ids[lo:hi]
    return got if type(got) is list else list(got)


def holds_block(block_ids: list[int], block_id: int) -> bool:
    """Whether ``block_ids`` holds ``block_id`` (vLLM's null block, block 0: ``all()`` finds a
    0 faster than ``in`` compares)."""
    return not all(block_ids) if block_id == 0 else block_id in block_ids


def blocks_covering(block_ids: Sequence[int], block_size: int, start_token: int, end_token: int) -> list[int]:
    """Block ids (of one group) holding any token of ``[start_token, end_token)``."""
    if end_token <= start_token:
        return []
    return list(block_ids[start_token // block_size : cdiv(end_token, block_size)])


@dataclasses.dataclass(frozen=True, slots=True)
class LoadPlan:
    """Which chunks to retrieve for ``[local, end)``.

    first_chunk / num_chunks: whole chunks retrieved (``num_chunks`` may be 0).
    skip_tokens: leading tokens of ``first_chunk`` vLLM already holds (never written).
    loadable_end: ``(first_chunk + num_chunks) * C``; tokens in ``[loadable_end, end)`` cannot be
        loaded (no whole chunk covers them) and are reported as failed.
    """

    first_chunk: int
    num_chunks: int
    skip_tokens: int
    loadable_end: int


def plan_load(local: int, end: int, chunk_size: int) -> LoadPlan:
    """Chunks to retrieve so that tokens ``[local, end)`` are written and ``[0, local)`` not."""
    assert 0 <= local < end, (local, end)
    first = local // chunk_size
    last = end // chunk_size
    n = max(last - first, 0)
    return LoadPlan(first, n, local - first * chunk_size, (first + n) * chunk_size if n else local)


# ---------------------------------------------------------------------- metadata


@dataclasses.dataclass(slots=True)
class LoadJob:
    """Retrieve cached chunks into a request's newly allocated blocks (asynchronous load: the
    request waits in WAITING_FOR_REMOTE_KVS until the worker reports it in finished_recving).

    chain: the shard-independent chain values of chunks ``[first_chunk, first_chunk + n)``
        (`kvdepot.client.hashing`); each worker masks them with its own shard's mask of ``seed``.
    seed: the request's namespace seed (model, layout fingerprint, cache_salt).
    block_ids: per daemon gid, the manager block ids of those chunks (may contain vLLM's null
        block for groups that no longer need a block; the worker leaves it unwritten).
    skip_tokens: see `LoadPlan`.
    local_tokens / end_tokens: vLLM's own hit and the end of the promised range.
    fail_block_ids: single-group models: per daemon gid, the block ids covering tokens
        ``[local_tokens, end_tokens)`` (reported as invalid from the first chunk not retrieved on).
    """

    req_id: str
    chain: list[bytes]
    seed: bytes
    first_chunk: int
    skip_tokens: int
    block_ids: list[list[int]]
    local_tokens: int
    end_tokens: int
    fail_block_ids: list[list[int]]


@dataclasses.dataclass(slots=True)
class StoreJob:
    """Store whole chunks ``[first_chunk, first_chunk + n)`` of a request (its blocks were
    written by this step's forward or earlier ones).

    chain / seed: as in `LoadJob`; ``parent`` is the chain value of the chunk before (b"" for
    chunk 0).
    block_ids: per daemon gid, manager block ids of those chunks (null blocks of
        sliding-window groups are read, never written: their bytes are never loaded back); None
        until `slice_block_ids` where ``lazy`` is set.
    lazy: models without sliding-window groups, a request new in the step: per daemon gid
        (the request's block id list as vLLM gave it, ``NewRequestData.block_ids``; first block;
        end block), and vLLM's null block id. The worker's transfer thread slices ``block_ids``
        from it, so the engine thread touches none of the ids (a slice of a 4096-token
        prompt's 256 ids and its null-block check cost 10-20 us with cold caches on the dev VM:
        each id above 256 is an object of its own). vLLM builds those lists per step and only
        ever appends to them, so the positions sliced stay as they were.
    """

    req_id: str
    chain: list[bytes]
    parent: bytes
    seed: bytes
    first_chunk: int
    block_ids: list[list[int]] | None
    cache_salt: str
    lazy: tuple | None = None

    def slice_block_ids(self) -> bool:
        """Fill ``block_ids`` from ``lazy`` (once; True if already filled). False if a range
        holds vLLM's null block, which a group without sliding windows never holds: the job
        must not be stored (its ``block_ids`` stay None)."""
        if self.block_ids is not None:
            return True
        ranges, null = self.lazy
        ids = [table[lo:hi] for table, lo, hi in ranges]
        if any(holds_block(x, null) for x in ids):
            return False
        self.block_ids, self.lazy = ids, None
        return True


@dataclasses.dataclass(slots=True)
class KVDepotMetadata(KVConnectorMetadata):
    """What the scheduler-side connector tells every worker for one step. A step with nothing
    for the workers (most decode steps) gets one shared instance whose lists are empty tuples:
    read it, never change it.

    release: finished requests whose blocks vLLM keeps until every worker reported them in
        finished_sending (a worker does once no store or retrieve of the request is in flight).
    preempted: requests preempted this step (their blocks go to other requests in this step's
        forward): a store that still reads their blocks must end before it, or not start.
    fingerprint: the layout fingerprint the scheduler seeded the keys with; a worker whose
        registration disagrees neither loads nor stores.
    null_block_id: vLLM's null block (``BlockPool.null_block``).
    stores_pinned: models with a sliding-window group, where the scheduler holds a reference
        on the sliding-window blocks of every store it sends (vLLM's ``BlockPool.touch``), so
        vLLM gives none of them to another request before the workers said the save ended
        (`KVDepotWorkerMeta`): their gathers may then run after later forwards, as a full-
        attention model's do, and ``written_block_ids`` is not sent.
    pin_seq: the number of this step's pinned save (0: none); each worker reports it in
        `KVDepotWorkerMeta` once no gather of it can read its blocks any more.
    written_block_ids: models with a sliding-window group only (else None): every block this
        step's forward or vLLM's own block preparation may write that its request did not
        hold before the step (newly allocated, zeroed, copy-on-write destinations); a flat
        list that may repeat ids and hold the null block
        (`kvdepot.client.vllm.scheduler.written_blocks`). vLLM frees
        blocks leaving the window while their request runs; a store gathered later than a
        forward that writes one of its blocks would read the new owner's KV, so a worker makes
        the forward wait for the gathers of the stores that read one of these
        (`WorkerConnector.bind_connector_metadata`), and for no others.
    """

    loads: list[LoadJob] = dataclasses.field(default_factory=list)
    stores: list[StoreJob] = dataclasses.field(default_factory=list)
    release: list[str] = dataclasses.field(default_factory=list)
    preempted: list[str] = dataclasses.field(default_factory=list)
    fingerprint: str = ""
    null_block_id: int = 0
    written_block_ids: list[int] | None = None
    stores_pinned: bool = False
    pin_seq: int = 0


@dataclasses.dataclass
class KVDepotWorkerMeta(KVConnectorWorkerMetadata or object):
    """What a worker tells the scheduler-side connector after a step (vLLM's
    ``KVConnectorOutput.kv_connector_worker_meta``; vLLM's ``KVOutputAggregator`` merges the
    workers' with `aggregate`).

    saves_ended: pinned save number (`KVDepotMetadata.pin_seq`) -> workers that report it
        ended: every store of it was answered, skipped or given up and the worker's gathers
        queued before then have run, so no gather reads its blocks any more. The scheduler
        drops its pins on the blocks once every worker of the engine reported the save.
    """

    saves_ended: dict[int, int] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: KVDepotWorkerMeta) -> KVDepotWorkerMeta:
        out = dict(self.saves_ended)
        for seq, n in other.saves_ended.items():
            out[seq] = out.get(seq, 0) + n
        return KVDepotWorkerMeta(out)
