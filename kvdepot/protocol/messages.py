"""Wire messages of the kvdepot protocol (msgspec Structs, msgpack-encoded).

Every message is one ZMQ frame holding a msgpack array ``[tag, rid, field...]``: a tagged
``msgspec.Struct`` with ``array_like=True`` (field order is the wire order). ``omit_defaults``
is set but msgspec does not apply it to array-like structs (jcrist/msgspec#720): every field is
encoded. Decoders fill missing trailing fields from their defaults and ignore extra trailing
fields, which is what lets old and new versions talk. ``rid`` is the caller's request
id; the daemon echoes it in the reply, so a client may keep several requests outstanding.

Schema evolution is append-only: new fields go last and get defaults, fields are never
reordered, tags are never reused. ``tests/golden/`` keeps encoded messages of every released
protocol version and the tests check that they still decode.

Chunk keys are 16-byte prefix-chained hashes (see ``kvdepot.client.hashing``). Block ids are
per KV-cache group (gid): ``block_ids[gid]`` lists the engine's block ids, in token order, that
hold the tokens of the chunks named by ``keys`` (``len(keys) * chunk_size // tokens_per_block[gid]``
ids per gid).
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
from msgspec import Meta

PROTOCOL_VERSION = 1

NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(gt=0)]
# a lookup's sizes, bounded so that the daemon's token counters (uint64 in `DaemonInfo`) cannot
# be overflowed by a few absurd requests: chunk_size as `kvdepot.gpu.layout.MAX_CHUNK_TOKENS`
LookupChunkSize = Annotated[int, Meta(gt=0, le=1 << 20)]
PromptTokens = Annotated[int, Meta(ge=0, le=1 << 32)]
ChunkKey = Annotated[bytes, Meta(min_length=8, max_length=64)]
BlockIds = list[NonNegInt]
# a RETRIEVE's block ids may be -1: that block is left unwritten (vLLM's null block, which a
# sliding-window group's table holds for tokens outside the window)
TargetBlockIds = list[Annotated[int, Meta(ge=-1)]]
Name = Annotated[str, Meta(max_length=4096)]


class Msg(msgspec.Struct, tag_field="t", array_like=True, omit_defaults=True):
    """Base of every wire message. ``rid``: request id chosen by the client (echoed in replies)."""

    rid: NonNegInt


# --------------------------------------------------------------------------- descriptors


class StorageSpec(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One engine memory allocation that layer views point into.

    kind: ``"shm"`` (POSIX shared memory, ``name`` is the /dev/shm name), ``"memfd"`` (a sealed
    memfd passed beforehand over the daemon's descriptor socket, ``name`` is the token it was
    passed under: `kvdepot.protocol.fdpass`) or ``"cuda_ipc"``
    (``handle`` is a ``cudaIpcMemHandle_t`` of the allocation holding the storage, which starts
    ``handle_offset_bytes`` into it; ``device_uuid`` is the GPU's UUID, matched by the daemon
    against its visible GPUs, never by ordinal).
    size_bytes: bytes of the allocation; every layer view must lie inside it.
    """

    kind: Annotated[str, Meta(pattern="^(shm|memfd|cuda_ipc)$")]
    size_bytes: PosInt
    name: Name = ""
    handle: bytes = b""
    device_uuid: str = ""
    handle_offset_bytes: NonNegInt = 0  # cuda_ipc: where the storage starts in the handle's allocation


class LayerSpec(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One attention layer's KV-cache tensor as the engine holds it.

    layout: one of ``kvdepot.gpu.layout.LayerLayout`` values (``vllm``, ``flash_attn``,
        ``flashinfer``, ``mla``) naming what the dims of ``shape`` mean.
    shape / strides: of the engine's tensor view, strides in elements of ``dtype``.
    dtype: the view's dtype (``int8`` for vLLM >= 0.33 views, which pack K|V bytes in C).
    kv_dtype: dtype of the K/V values themselves (``bfloat16``, ``float8_e4m3fn``,
        ``uint8`` for byte-packed rows); part of what the stored bytes mean.
    offset_bytes: byte offset of element [0, ...] of the view inside ``storages[storage]``.
    gid: the KV-cache group this layer belongs to.
    """

    name: Name
    storage: NonNegInt
    offset_bytes: NonNegInt
    shape: list[NonNegInt]
    strides: list[NonNegInt]
    dtype: str
    kv_dtype: str
    gid: NonNegInt
    layout: str


class KVGroupSpec(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """A KV-cache group (gid): all its layers share ``tokens_per_block`` and block ids."""

    gid: NonNegInt
    tokens_per_block: PosInt


class LayerGroupInfo(msgspec.Struct, omit_defaults=True):
    """How the daemon grouped layers: one entry per (gid, layout, shape, strides, dtype)."""

    gid: int
    layout: str
    dtype: str
    kv_dtype: str
    num_layers: int
    num_blocks: int
    tokens_per_block: int
    num_heads: int
    num_kv: int
    row_bytes: int
    bytes_per_token: int  # over all layers of the group


class EngineInfo(msgspec.Struct, omit_defaults=True):
    registration: str
    model: str
    shard: str
    pid: int
    device: str
    chunk_size: int
    object_bytes: int
    layout_fingerprint: str
    groups: list[LayerGroupInfo]
    stored_chunks: int = 0
    retrieved_chunks: int = 0
    # CUDA engines: bytes of the engine's staging ring the daemon copies to and from (engine-side
    # staging, `Register.staging`); 0: the daemon gathers and scatters the blocks itself
    staging_bytes: int = 0


class TierInfo(msgspec.Struct, omit_defaults=True):
    """One tier in `DaemonInfo` (l1: pinned host memory; l2: local disk). Counters since start."""

    name: str
    capacity_bytes: int
    used_bytes: int
    num_objects: int
    hit_chunks: int = 0  # chunks lookups found with this as the fastest tier holding them
    evictions: int = 0
    read_bytes: int = 0  # lower tiers: bytes read (promotions to L1)
    written_bytes: int = 0  # lower tiers: bytes written
    queue_depth: int = 0  # lower tiers: writes queued or in progress
    dropped_writes: int = 0  # lower tiers: writes not made (queue full, no room)
    errors: int = 0  # lower tiers: I/O errors
    corrupt_objects: int = 0  # lower tiers: objects that failed verification (dropped)
    detail: str = ""  # e.g. the directory and I/O mode of L2


class TenantInfo(msgspec.Struct, omit_defaults=True):
    """One tenant's use of one tier in `DaemonInfo` (`kvdepot.server.quotas`): tenant is a salt
    named in the daemon's quotas, ``(none)`` for requests without a salt, or ``other`` (every
    salt not named, summed)."""

    tier: str
    tenant: str
    used_bytes: int
    quota_bytes: int = 0  # 0: none; other: each unnamed salt's quota
    quota_evictions: int = 0  # objects evicted to keep the tenant within its quota


class TransferInfo(msgspec.Struct, omit_defaults=True):
    """A copy in flight in `DaemonInfo` (the watchdog's stuck ones, `kvdepot.server.watchdog`)."""

    op: str  # store / retrieve
    registration: str
    rid: int
    size_bytes: int
    age_s: float  # since it was enqueued


class DaemonInfo(msgspec.Struct, omit_defaults=True):
    boot_id: str
    version: str
    protocol_version: int
    endpoints: list[str]
    metrics_port: int
    uptime_s: float
    tiers: list[TierInfo]
    engines: list[EngineInfo]
    lookup_requested_tokens: int
    lookup_hit_tokens: int
    stored_chunks: int
    retrieved_chunks: int
    evicted_chunks: int
    transfer_engine: str
    pinned_requests: int
    # replies the daemon dropped / delayed on purpose ($KVDEPOT_INJECT_FAULTS, soak tests only)
    injected_faults: dict[str, int] = msgspec.field(default_factory=dict)
    # copies past the watchdog's deadline that have not ended yet (kvdepot.server.watchdog)
    stuck_transfers: list[TransferInfo] = msgspec.field(default_factory=list)
    # per tier, bytes per tenant and their quotas (with --tenant-quota; kvdepot.server.quotas)
    tenants: list[TenantInfo] = msgspec.field(default_factory=list)


# --------------------------------------------------------------------------- requests


class Hello(Msg, tag="hello"):
    """First message of a client. Reply: `HelloReply` (or VERSION_MISMATCH)."""

    protocol_version: NonNegInt
    client: Name = ""
    pid: NonNegInt = 0


class Register(Msg, tag="reg"):
    """Register an engine's KV caches. Reply: `RegisterReply`.

    model: model identity (name + revision); part of the chunk-key namespace.
    shard: ``"tp{rank}of{world}"``, or ``"replicated"`` for MLA KV identical on every rank.
    chunk_size: tokens per chunk; a multiple of every group's tokens_per_block.
    staging: CUDA engines: a ``cuda_ipc`` device buffer of the engine (on the GPU of its KV
        caches) that its own process gathers chunks into and scatters them out of (see
        ``staging_offset`` in `Store` / `Retrieve`); the daemon then only copies it over PCIe.
        Absent: the daemon gathers and scatters the engine's blocks itself.
    fence: with ``staging``: the token under which the engine passed (descriptor socket,
        `kvdepot.protocol.fdpass`) a sealed memfd of ``fence_words`` uint64 words that its GPU
        writes after each staged store's gather (see ``fence`` in `Store`). Empty: the engine
        sends a staged store only once its gather completed.
    """

    model: Name
    shard: Name
    chunk_size: PosInt
    storages: list[StorageSpec]
    layers: list[LayerSpec]
    groups: list[KVGroupSpec]
    pid: NonNegInt = 0
    device: str = "cpu"
    staging: StorageSpec | None = None
    fence: Name = ""
    fence_words: Annotated[int, Meta(ge=0, le=1 << 20)] = 0


class Unregister(Msg, tag="unreg"):
    """Drop a registration (its engine memory is unmapped once transfers using it finish)."""

    registration: Name


class Lookup(Msg, tag="look"):
    """How many leading chunks of a prompt are cached for every shard.

    keys: one chain of chunk keys per shard the engine needs (``keys[shard][i]`` = chunk i).
    num_tokens: prompt length in tokens (for hit-rate metrics only).
    pin_request: if set, the hit chunks are pinned (not evictable) under this request name
        until `EndRequest`, the client's process exits, or the pin TTL passes.
    Reply: `LookupReply`.
    """

    keys: list[list[ChunkKey]]
    chunk_size: LookupChunkSize
    num_tokens: PromptTokens = 0
    model: Name = ""
    pin_request: Name = ""


class Chain(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One prompt's run of chunks in a `Store` or `Retrieve` that carries several (``chains``):
    the requests of several prompts in one message, moved through one staging region, one
    copy call and one reply.

    start: index in the message's ``keys`` (and chunk index in its ``block_ids`` and staging
        region) of the run's first chunk; the run ends where the next one starts.
    parent: Store: the key of the chunk before ``keys[start]`` (empty: the prompt's chunk 0).
    skip_tokens: Retrieve: leading tokens of ``keys[start]`` whose blocks are not written.
    """

    start: NonNegInt
    parent: Annotated[bytes, Meta(max_length=64)] = b""
    skip_tokens: NonNegInt = 0


class ChainStored(msgspec.Struct, array_like=True, frozen=True):
    """`StoreReply.chains`: what became of one `Chain`'s chunks (stored + present + skipped =
    its chunks)."""

    stored: int
    present: int
    skipped: int


class Store(Msg, tag="store"):
    """Copy whole chunks from engine blocks into the daemon.

    keys: chunk keys in prefix order; ``parent`` is the key of the chunk before ``keys[0]``
        (empty for chunk 0). A chunk is stored only if its parent is cached (or stored by this
        same request): a chunk without its prefix can never hit.
    block_ids: per gid, the block ids holding those chunks' tokens, in token order.
    event, reply_early: ignored (kept for the wire format). An interprocess CUDA event to
        wait on was seen to report its record complete before the work ahead of it ran (14
        engine processes on one GPU), and an early reply handed one out: every store is
        answered once its chunks are in L1, and the engine's writes of the blocks must have
        completed when it sends the store (unless ``fence`` says when they will).
    staging_offset: >= 0: the engine gathers the chunks into its registered staging buffer,
        chunk j at byte ``staging_offset + j * object_bytes`` in the canonical object format;
        the daemon reads only the staging buffer (``block_ids`` are still checked) and
        replies once the chunks are in L1 (the staging region is free on the reply). -1:
        the daemon gathers from the blocks.
    fence: > 0, staged only: the gather is still running or queued; the engine's GPU writes
        ``fence`` into fence word ``fence % fence_words`` (`Register.fence`) once it is done,
        and the daemon copies the region only after it sees that (polled from the CPU; a word
        that never comes fails the store with ENGINE_MEMORY after 30 s, or when the registration
        goes, nothing copied). 0: the
        gather already completed.
    staging_seq: staged: the staging region's number (`Drain`); 0: none given.
    chains: empty: ``keys`` are one run after ``parent``. Else several prompts' runs
        (`Chain`, ``chains[0].start == 0``, starts increasing; ``parent`` must be empty): each
        run chains onto its own parent, a missing parent skips only its own run, and the reply
        gives each run's counts. Only to a daemon whose `RegisterReply.chains` is set (an older
        one would read the runs as one chain).
    landed: staged and fenced (``fence == staging_seq``), no ``chains``, where
        `RegisterReply.landed` said so: if every chunk is copied (none present or skipped),
        the daemon's DMA stream writes `stored_value` into the region's fence word right after
        its copies, before the daemon's completion, commit and reply: the engine may take the
        store as done from the word (`StoreReply` then: ``stored == len(keys)``); the chunks
        become visible to lookups with the commit, which the reply follows.
    deadline_ns: unstaged (the daemon reads the engine's blocks itself), > 0: a
        ``CLOCK_MONOTONIC`` time in nanoseconds (``time.monotonic_ns()`` of the engine's host,
        which is the daemon's) after which the engine may reuse the blocks. A copy that has not
        begun by then is refused, and a store whose copies ended after it is not committed:
        both answer DEADLINE. 0: none (the blocks stay the store's until its reply).
    Reply: `StoreReply`.
    """

    registration: Name
    keys: list[ChunkKey]
    block_ids: list[BlockIds]
    parent: Annotated[bytes, Meta(max_length=64)] = b""
    cache_salt: Name = ""
    request: Name = ""
    event: bytes = b""
    reply_early: bool = False
    staging_offset: Annotated[int, Meta(ge=-1)] = -1
    fence: NonNegInt = 0
    staging_seq: NonNegInt = 0
    chains: list[Chain] = msgspec.field(default_factory=list)
    landed: bool = False
    deadline_ns: NonNegInt = 0


class Retrieve(Msg, tag="get"):
    """Copy cached chunks into engine blocks.

    keys / block_ids: as in `Store`; a block id of -1 leaves that block unwritten.
    skip_tokens: leading tokens of ``keys[0]`` whose blocks must not be written (the engine
        already holds them, e.g. from its own prefix cache); a multiple of every group's
        tokens_per_block.
    staging_offset: >= 0: the daemon writes chunk j into the engine's registered staging buffer
        at byte ``staging_offset + j * object_bytes`` (not into the blocks), and the engine
        scatters it after the reply, applying ``skip_tokens`` itself. -1: the daemon writes the
        blocks.
    staging_seq: staged: the staging region's number (`Drain`); 0: none given.
    chains: empty: ``keys`` are one run. Else several prompts' runs (`Chain`, as in `Store`;
        each with its own ``skip_tokens``, the message's must be 0); the leading chunks of each
        run that are cached are written (`RetrieveReply.chains`). A CUDA engine must stage such
        a retrieve (``staging_offset`` >= 0).
    landed: staged, with ``staging_seq`` and no ``chains``, where `RegisterReply.landed` said
        so: the engine enqueued its scatter before sending (gated on fence word ``staging_seq
        % fence_words``); after its copies into the ring the daemon's DMA stream writes
        ``staging_seq | 1 << 62 | retrieved << 40`` into that word. A retrieve that copies
        nothing leaves the word alone (the engine writes it when the reply comes).
    deadline_ns: unstaged, > 0: as in `Store`; the daemon writes no chunk into the blocks after
        it (the retrieve then answers DEADLINE, its earlier chunks possibly written).
    Reply: `RetrieveReply`; only its ``retrieved`` leading chunks were written.
    """

    registration: Name
    keys: list[ChunkKey]
    block_ids: list[TargetBlockIds]
    skip_tokens: NonNegInt = 0
    request: Name = ""
    staging_offset: Annotated[int, Meta(ge=-1)] = -1
    staging_seq: NonNegInt = 0
    chains: list[Chain] = msgspec.field(default_factory=list)
    landed: bool = False
    deadline_ns: NonNegInt = 0


# A gated retrieve's landed word (`Retrieve.landed`; KVD_LANDED_* in the kernel library):
# staging_seq | LANDED_BIT | chunks written << LANDED_COUNT_SHIFT; the engine's scatter adds
# GATE_DONE_BIT once it ran.
LANDED_BIT = 1 << 62
GATE_DONE_BIT = 1 << 61
LANDED_COUNT_SHIFT = 40
LANDED_MAX_SEQ = (1 << LANDED_COUNT_SHIFT) - 1
LANDED_MAX_CHUNKS = (1 << 21) - 1


def stored_value(staging_seq: int, stored: int) -> int:
    """A landed store's word (`Store.landed`): `landed_value` with `GATE_DONE_BIT`, as no GPU
    write of the region is pending once the daemon's copies ran (the engine reads it as
    settled, `kvdepot.client.staging.FenceWords.holds`)."""
    return landed_value(staging_seq, stored) | GATE_DONE_BIT


def landed_value(staging_seq: int, retrieved: int) -> int:
    """The value of a gated retrieve's landed word once ``retrieved`` leading chunks are in the
    ring (0 <= staging_seq <= LANDED_MAX_SEQ, 0 <= retrieved <= LANDED_MAX_CHUNKS; ValueError
    otherwise)."""
    if not (0 <= staging_seq <= LANDED_MAX_SEQ and 0 <= retrieved <= LANDED_MAX_CHUNKS):
        raise ValueError(f"landed word out of range: seq {staging_seq}, {retrieved} chunks")
    return staging_seq | LANDED_BIT | retrieved << LANDED_COUNT_SHIFT


class Drain(Msg, tag="drain"):
    """Settle the staged requests of a registration whose replies were lost (a client timeout
    rebuilt the connection): from now on the daemon refuses any staged request whose
    ``staging_seq`` is <= ``through_seq`` (one still on its way on the old connection copies
    nothing), and it replies once every such request it accepted has finished its copies. The
    engine may then reuse their staging regions. Reply: `OkReply`."""

    registration: Name
    through_seq: PosInt


class Settle(Msg, tag="settle"):
    """Settle this client's Stores and Retrieves of a registration that were lost with a
    connection (it timed out or closed): from now on the daemon refuses any Store or Retrieve of
    this client (its routing identity) on this registration whose ``rid`` is <= ``through_rid``
    (one still on its way on the old connection copies nothing), and it replies once every such
    request it accepted has finished its copies. The engine may then reuse their blocks.
    Reply: `OkReply` (UNKNOWN_REGISTRATION from a restarted daemon: nothing of the old one runs)."""

    registration: Name
    through_rid: PosInt


class EndRequest(Msg, tag="end"):
    """The engine is done with a request: release its pins. Reply: `OkReply`."""

    request: Name


class Describe(Msg, tag="desc"):
    """Reply: `DescribeReply`."""


class Flush(Msg, tag="flush"):
    """Drop cached chunks (all, or those of one model / cache_salt / tier).

    Chunks in use by a transfer are hidden at once and freed when the transfer ends.
    ``cache_salt=None`` matches every salt; ``""`` matches unsalted chunks only.
    Reply: `FlushReply`.
    """

    model: Name = ""
    cache_salt: Name | None = None
    tier: Name = ""


class Ping(Msg, tag="ping"):
    """Reply: `Pong`."""


Request = Union[Hello, Register, Unregister, Lookup, Store, Retrieve, EndRequest, Describe, Flush, Ping, Drain, Settle]

# --------------------------------------------------------------------------- replies


class HelloReply(Msg, tag="helloR"):
    protocol_version: int
    boot_id: str
    version: str


class RegisterReply(Msg, tag="regR"):
    """registration: id to use in Store/Retrieve; layout_fingerprint: hex digest of what the
    chunk bytes mean (the client seeds chunk keys with it); object_bytes: bytes per chunk;
    staging: the daemon serves `Register.staging` (requests may give ``staging_offset``);
    fence: it polls `Register.fence` (staged stores may give ``fence``); chains: it takes
    `Store.chains` / `Retrieve.chains` (several prompts' runs in one request); landed: its
    DMA stream can write the fence words (staged retrieves may give `Retrieve.landed`, staged
    stores `Store.landed`)."""

    registration: str
    layout_fingerprint: str
    object_bytes: int
    boot_id: str
    staging: bool = False
    fence: bool = False
    chains: bool = False
    landed: bool = False


class OkReply(Msg, tag="ok"):
    pass


class LookupReply(Msg, tag="lookR"):
    """hit_chunks: leading chunks cached for every shard (hit tokens = hit_chunks * chunk_size)."""

    hit_chunks: int


class StoreReply(Msg, tag="storeR"):
    """stored: chunks copied now (with ``reply_early``: being copied; a copy that then fails
    is logged and counted, and the chunks never become visible); present: already cached (not
    copied); skipped: not stored (parent missing or L1 full). stored + present + skipped ==
    len(keys). event (``reply_early`` only): interprocess CUDA event handle after which the
    engine may overwrite the blocks; stored_event (``reply_early`` only): one after which the
    bytes are in L1 (the chunks become visible to lookups once the daemon has seen that too).
    chains: for a `Store` with ``chains``, each run's counts (the fields above are their sums)."""

    stored: int
    present: int
    skipped: int
    event: bytes = b""
    stored_event: bytes = b""
    chains: list[ChainStored] = msgspec.field(default_factory=list)


class RetrieveReply(Msg, tag="getR"):
    """retrieved: leading chunks written into the engine's blocks (with ``Retrieve.chains``: the
    sum over the runs); event: interprocess CUDA event handle the engine must wait on before
    reading them (CUDA engines only); chains: for a `Retrieve` with ``chains``, each run's
    leading chunks written (staged: in the staging region at the runs' own chunk positions)."""

    retrieved: int
    event: bytes = b""
    chains: list[NonNegInt] = msgspec.field(default_factory=list)


class DescribeReply(Msg, tag="descR"):
    info: DaemonInfo


class FlushReply(Msg, tag="flushR"):
    objects: int
    bytes: int


class Pong(Msg, tag="pong"):
    boot_id: str


class ErrorReply(Msg, tag="err"):
    """Typed failure of the request ``rid`` (0 when the frame could not be decoded)."""

    code: int
    message: str


Reply = Union[
    HelloReply, RegisterReply, OkReply, LookupReply, StoreReply, RetrieveReply, DescribeReply,
    FlushReply, Pong, ErrorReply,
]

REQUEST_TAGS = frozenset(t.__struct_config__.tag for t in Request.__args__)


# --------------------------------------------------------------------------- chunk events
# Published by the daemon at `kvdepot.protocol.transport.events_endpoint` (`kvdepot.server.events`):
# two frames, the topic (`events_topic` of a model, or `EVENTS_ALL_MODELS`) and a `ChunkEventBatch`.

EVENTS_ALL_MODELS = b"*\0"  # the topic of events about every model (a flush of everything)


def events_topic(model: str) -> bytes:
    """The first frame of ``model``'s chunk events: its label, then NUL (no model's topic is a
    prefix of another's)."""
    return model.encode() + b"\0"


class ChunkEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """One model's chunk events of one pass of the daemon's loop, to be read in this order:
    ``cleared`` (every chunk of the model, or of every model, was flushed), ``stored`` (keys now
    readable in L1, from a store or from L3, or present when a store sent them again),
    ``removed`` (keys no tier holds any more). Keys are 16-byte chunk keys."""

    stored: list[bytes] = []
    removed: list[bytes] = []
    cleared: bool = False
