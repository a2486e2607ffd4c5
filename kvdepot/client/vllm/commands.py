"""What the worker's engine thread tells its transfer thread (`TransferThread.post`), and what a
gather of a step's stores on the engine's stream produced (`StagedSaves`).

Commands travel through the transfer thread's inbox (a ``queue.SimpleQueue``) in the order the
engine thread posted them; each is handled once, on the transfer thread. A `Load` ends the
thread's wait for replies at once; the others wait for the next reply or the end of that wait.

Four kinds of `Save`, by what the step's stores must follow on the GPU (CUDA; on CPU the
engine's blocks are written by the time ``wait_for_save`` runs, and every kind carries None):

* `SaveOnStream`: the blocks stay the request's until its stores ended (full-attention models,
  or sliding-window blocks the scheduler pinned): the thread records an event on ``stream``
  when it takes the command and gathers after it whenever it gets to the stores.
* `SaveAfterEvent`: gathered by the thread after ``event`` (the engine thread recorded it).
* `SavePosted`: a sliding-window model whose blocks vLLM may give away in the next step: whoever
  claims ``posted`` first (the thread when it takes the command, or the engine thread's ``bind_connector_metadata``
  before a forward that may write one of its blocks) gathers on the engine's stream.
* `SaveStaged`: already gathered into the staging ring by the engine thread (``staged``).

Every `Save` may carry ``release``: the step's finished requests, released after the save as a
`Release` would (reported in ``finished_sending`` once their transfers ended).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvdepot.client.registration import Registration
    from kvdepot.client.staging import StagingRegion
    from kvdepot.client.vllm.pieces import PostedSave, Preemption
    from kvdepot.client.vllm.plan import LoadJob, StoreJob


@dataclasses.dataclass(slots=True)
class Load:
    """Load ``jobs`` into their blocks; ``event``: the engine's stream state their scatters
    follow (a ``torch.cuda.Event``; None on CPU). ``null_block_id``: vLLM's null block (skipped)."""

    jobs: Sequence[LoadJob]
    null_block_id: int
    event: Any = None


@dataclasses.dataclass(slots=True)
class Save:
    """A step's stores (`StoreJob` per request); see the module for the four kinds."""

    jobs: Sequence[StoreJob]
    release: Collection[str] | None


@dataclasses.dataclass(slots=True)
class SaveOnStream(Save):
    """``stream``: the engine's ``torch.cuda.Stream`` (None on CPU). ``pin_seq``: the scheduler
    pinned the save's sliding-window blocks until this worker reports it ended (0: none)."""

    stream: Any = None
    pin_seq: int = 0


@dataclasses.dataclass(slots=True)
class SaveAfterEvent(Save):
    """``event``: a ``torch.cuda.Event`` on the engine's stream (None on CPU)."""

    event: Any = None


@dataclasses.dataclass(slots=True)
class SavePosted(Save):
    posted: PostedSave | None = None


@dataclasses.dataclass(slots=True)
class SaveStaged(Save):
    staged: StagedSaves | None = None


@dataclasses.dataclass(slots=True)
class Release:
    """Finished requests (no save this step): reported once their transfers ended."""

    req_ids: Collection[str]


@dataclasses.dataclass(slots=True)
class Preempt:
    """Drop the queued stores of ``preemption.req_ids``; the thread sets ``preemption.done``."""

    preemption: Preemption


@dataclasses.dataclass(slots=True)
class Stop:
    """Wait for the copies in flight, unregister, close the client, end the thread."""


Command = Load | Save | Release | Preempt | Stop


@dataclasses.dataclass(slots=True)
class StagedPiece:
    """Chunks ``[first, end)`` of a store job, gathered into ``region`` of the staging ring
    (None: no room; the rest of the job is skipped). ``block_ids``: registered ids per daemon gid."""

    first: int
    end: int
    block_ids: list[list[int]]
    region: StagingRegion | None


@dataclasses.dataclass(slots=True)
class SharedRegion:
    """One-piece jobs gathered together into one region by one call: ``jobs`` maps each request
    id to (its job, its registered block ids per daemon gid), in the region's order."""

    region: StagingRegion
    jobs: dict[str, tuple[StoreJob, list[list[int]]]]


@dataclasses.dataclass(slots=True)
class StagedSaves:
    """What `Sender.stage_saves` gathered for a step's jobs, for `Sender.send_staged`.

    ``generation`` / ``registration``: the client generation and registration it was gathered
    for (sent only if both still hold). ``per_job``: per job, in order, its pieces, an empty
    list for a job in ``shared``, or None (skipped: stopped, or nothing to store)."""

    generation: int
    registration: Registration
    per_job: list[list[StagedPiece] | None]
    shared: SharedRegion | None
