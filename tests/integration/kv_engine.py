"""Engine side of the integration tests: real model KV shapes, seeded shared-memory caches and
the jobs that the spawned engine processes run (store, retrieve-and-verify, register-and-die).

Bytes are never shipped between processes: every layer of a cache is filled with bytes that
depend only on ``(fill_seed, layer, logical shape)`` (`layer_fill`), so a retrieving engine
regenerates what the storing engine held and compares every byte of its own cache: tokens
written by the retrieve must equal the source's tokens, every other byte must be unchanged.

Model shapes come from ``tests/data/model_kv_shapes.json`` (a copy of the project's shared table
of real models, whole model, TP=1).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvdepot.client import KVDepotClient
from kvdepot.client.registration import Registration
from kvdepot.client.kvcache import KVGroupShape, ShmKVCache

SHAPES_PATH = Path(__file__).parent.parent / "data" / "model_kv_shapes.json"  # tests/data

LLAMA_8B = "Llama-3.1-8B"
QWEN_7B = "Qwen2.5-7B"
SMOLLM2 = "SmolLM2-135M"
GEMMA2_2B = "Gemma-2-2B"
GPT_OSS_20B = "gpt-oss-20b"
DEEPSEEK_V3_MLA = "DeepSeek-V3 (MLA)"
DEEPSEEK_V32_FP8 = "DeepSeek-V3.2 fp8_ds_mla"


@functools.cache
def _models() -> dict[str, dict]:
    return {m["name"]: m for m in json.loads(SHAPES_PATH.read_text())["models"]}


def model_groups(model: str, tokens_per_block: Sequence[int]) -> list[KVGroupShape]:
    """KV-cache groups of a real model, one `KVGroupShape` per gid.

    * dense attention: one bf16 group of all layers;
    * hybrid (Gemma-2, gpt-oss: full + sliding-window layers): two groups of half the layers
      each (gid 0 full, gid 1 sliding), as vLLM's hybrid KV-cache manager makes them;
    * DeepSeek-V3 MLA: one group of 576-element bf16 rows (512 latent + 64 rope);
    * DeepSeek-V3.2 fp8_ds_mla: gid 0 the 656-byte uint8 packed MLA rows, gid 1 the
      132-byte int8 indexer rows.
    """
    m = _models()[model]
    tpb = list(tokens_per_block)
    if model == DEEPSEEK_V32_FP8:
        assert len(tpb) == 2, "fp8_ds_mla has 2 groups (MLA rows, indexer rows)"
        return [
            KVGroupShape(0, m["layers"], 1, m["row_bytes"], tpb[0], torch.uint8, mla=True),
            KVGroupShape(1, m["layers"], 1, m["indexer_row_bytes"], tpb[1], torch.int8, mla=True),
        ]
    if model == DEEPSEEK_V3_MLA:
        assert len(tpb) == 1
        groups = [KVGroupShape(0, m["layers"], m["kv_heads"], m["head_dim"], tpb[0], torch.bfloat16, mla=True)]
    elif "2 groups" in m["attention"] or "2 KV-cache groups" in m["attention"]:
        assert len(tpb) == 2 and m["layers"] % 2 == 0
        half = m["layers"] // 2
        groups = [KVGroupShape(gid, half, m["kv_heads"], m["head_dim"], tpb[gid]) for gid in (0, 1)]
    else:
        assert m["attention"] == "full" and len(tpb) == 1, m
        groups = [KVGroupShape(0, m["layers"], m["kv_heads"], m["head_dim"], tpb[0])]
    got = sum(g.num_layers * g.token_bytes for g in groups)
    assert got == m["kv_bytes_per_token"], f"{model}: {got} KV bytes per token, table says {m['kv_bytes_per_token']}"
    return groups


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """One engine's KV cache and registration."""

    endpoint: str
    model: str  # name in model_kv_shapes.json
    layout: str  # ShmKVCache layout (LBNHC, LBHNC, BLNHC, BLHNC, flash_attn_*, flashinfer, mla)
    tokens_per_block: tuple[int, ...]  # per gid
    num_blocks: tuple[int, ...]  # per gid
    chunk_size: int  # tokens per chunk
    fill_seed: int  # seed of the bytes the cache starts with
    shard: str = "tp0of1"  # "replicated" for MLA
    model_id: str = ""  # registered model identity (default: model)
    sealed: bool = True  # a sealed memfd passed to the daemon; False: a named /dev/shm segment

    @property
    def model_name(self) -> str:
        return self.model_id or self.model

    def groups(self) -> list[KVGroupShape]:
        return model_groups(self.model, self.tokens_per_block)

    def blocks_per_chunk(self, gid: int) -> int:
        return self.chunk_size // self.tokens_per_block[gid]


def warm_up() -> int:
    """Runs first in every engine process (torch is imported by now)."""
    torch.set_num_threads(1)
    return os.getpid()


# ---------------------------------------------------------------------------- bytes


def layer_fill(seed: int, layer: int, shape: Sequence[int]) -> torch.Tensor:
    """The bytes layer ``layer`` of a cache seeded ``seed`` starts with: uint8 ``shape``
    (``[num_blocks, N, H, KV, row_bytes]``, the cache's `ShmKVCache.token_view` bytes)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    return torch.randint(0, 256, tuple(shape), dtype=torch.uint8, generator=g)


def fill_cache(cache: ShmKVCache, seed: int) -> None:
    for layer in range(len(cache.layer_names)):
        v = cache.token_view(layer, as_bytes=True)
        v.copy_(layer_fill(seed, layer, v.shape))


def token_rows(block_ids: Sequence[int], tokens_per_block: int, start: int, stop: int) -> torch.Tensor:
    """Rows of a ``[num_blocks * N, ...]`` token view holding logical tokens [start, stop) when the
    tokens live in ``block_ids`` (in token order)."""
    t = torch.arange(start, stop)
    ids = torch.as_tensor(list(block_ids), dtype=torch.long)
    return ids[t // tokens_per_block] * tokens_per_block + t % tokens_per_block


def verify_cache(cache: ShmKVCache, spec: EngineSpec, block_ids: Sequence[Sequence[int]],
                 source: EngineSpec | None, source_block_ids: Sequence[Sequence[int]], lo_tok: int,
                 hi_tok: int) -> list[str]:
    """Compare every byte of ``cache`` with what it must hold: its own initial bytes, except
    logical tokens [lo_tok, hi_tok) of ``block_ids``, which must hold the ``source`` engine's
    tokens [lo_tok, hi_tok) of ``source_block_ids``. Returns one line per differing layer."""
    problems = []
    for layer in range(len(cache.layer_names)):
        gid = cache.layer_gids[layer]
        view = cache.token_view(layer, as_bytes=True)
        nb, n, *rest = view.shape
        expected = layer_fill(spec.fill_seed, layer, view.shape).reshape(nb * n, *rest)
        if hi_tok > lo_tok:
            assert source is not None
            src_n = source.tokens_per_block[gid]
            src = layer_fill(source.fill_seed, layer, (source.num_blocks[gid], src_n, *rest)).reshape(-1, *rest)
            expected[token_rows(block_ids[gid], n, lo_tok, hi_tok)] = \
                src[token_rows(source_block_ids[gid], src_n, lo_tok, hi_tok)]
        actual = view.reshape(nb * n, *rest)
        if not torch.equal(actual, expected):
            bad = (actual != expected).reshape(nb * n, -1).any(1).nonzero().flatten()
            problems.append(f"layer {layer} (gid {gid}): {bad.numel()} token rows differ, first rows {bad[:8].tolist()}")
    return problems


# ---------------------------------------------------------------------------- block ids


def rotated_block_ids(spec: EngineSpec, num_chunks: int, start: int = 3) -> list[list[int]]:
    """Per gid, consecutive ids that wrap around the end of the cache (runs of several blocks
    and a discontinuity): ``[nb-start, ..., nb-1, 0, 1, ...]``."""
    out = []
    for gid, nb in enumerate(spec.num_blocks):
        k = num_chunks * spec.blocks_per_chunk(gid)
        assert k <= nb, f"gid {gid}: {k} blocks needed, cache has {nb}"
        out.append([(nb - start + i) % nb for i in range(k)])
    return out


def shuffled_block_ids(spec: EngineSpec, num_chunks: int, seed: int) -> list[list[int]]:
    """Per gid, distinct block ids in random order."""
    rng = random.Random(seed)
    out = []
    for gid, nb in enumerate(spec.num_blocks):
        k = num_chunks * spec.blocks_per_chunk(gid)
        assert k <= nb, f"gid {gid}: {k} blocks needed, cache has {nb}"
        out.append(rng.sample(range(nb), k))
    return out


def chunk_slice(spec: EngineSpec, block_ids: Sequence[Sequence[int]], lo: int, hi: int) -> list[list[int]]:
    """The block ids of chunks [lo, hi) (per gid)."""
    return [list(ids[lo * spec.blocks_per_chunk(g): hi * spec.blocks_per_chunk(g)]) for g, ids in enumerate(block_ids)]


def prompt_tokens(seed: int, num_tokens: int, vocab: int = 128_000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(num_tokens)]


# ---------------------------------------------------------------------------- engine


class Engine:
    """A shared-memory KV cache filled from its seed, registered with the daemon.

    ``close`` unregisters (unless told not to), closes the client and unlinks the segment.
    """

    def __init__(self, spec: EngineSpec, name: str = "") -> None:
        self.spec = spec
        self.cache = ShmKVCache(spec.groups(), list(spec.num_blocks), spec.layout, sealed=spec.sealed)
        try:
            fill_cache(self.cache, spec.fill_seed)
            self.client = KVDepotClient(spec.endpoint, timeout_s=60.0, name=name)
            try:
                self.reg: Registration = self.client.register(
                    spec.model_name, spec.shard, spec.chunk_size, self.cache.storage_specs(),
                    self.cache.layer_specs(), self.cache.group_specs(), storage_fds=self.cache.storage_fds())
            except BaseException:
                self.client.close()
                raise
        except BaseException:
            self.cache.close()
            raise

    def keys(self, tokens: Sequence[int], cache_salt: str = "") -> list[bytes]:
        return self.reg.keys(tokens, cache_salt)

    def close(self, unregister: bool = True) -> None:
        try:
            if unregister:
                self.client.unregister(self.reg)
        finally:
            self.client.close()
            self.cache.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------- jobs


@dataclasses.dataclass(frozen=True)
class StoreJob:
    """Engine A: fill, register, store the whole chunks of ``tokens`` from ``block_ids``.

    The chunks go out in two Store requests: the first ``first_batch`` chunks, then the rest
    with ``parent`` = the last key of the first batch.
    """

    spec: EngineSpec
    tokens: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]  # per gid, for every whole chunk of tokens
    first_batch: int = 1
    cache_salt: str = ""


def store_job(job: StoreJob) -> dict:
    spec = job.spec
    with Engine(spec, name="engine-A") as eng:
        keys = eng.keys(job.tokens, job.cache_salt)
        n = len(keys)
        replies = []
        for lo, hi in ((0, min(job.first_batch, n)), (min(job.first_batch, n), n)):
            if lo == hi:
                continue
            r = eng.client.store(eng.reg, keys[lo:hi], chunk_slice(spec, job.block_ids, lo, hi),
                                 parent=keys[lo - 1] if lo else b"", cache_salt=job.cache_salt)
            replies.append([r.stored, r.present, r.skipped])
        hit = eng.client.lookup(keys, spec.chunk_size, num_tokens=len(job.tokens), model=spec.model_name)
        return {"pid": os.getpid(), "registration": eng.reg.id, "fingerprint": eng.reg.layout_fingerprint,
                "object_bytes": eng.reg.object_bytes, "num_chunks": n, "replies": replies, "hit": hit}


@dataclasses.dataclass(frozen=True)
class RetrieveJob:
    """Engine B: fill, register, look up ``tokens``, retrieve every whole chunk into
    ``block_ids`` (only the cached leading ones get written) and verify every byte."""

    spec: EngineSpec
    source: EngineSpec  # the engine that stored the chunks
    source_block_ids: tuple[tuple[int, ...], ...]
    tokens: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]  # per gid, for every whole chunk of tokens
    skip_tokens: int = 0
    cache_salt: str = ""


def retrieve_job(job: RetrieveJob) -> dict:
    spec = job.spec
    with Engine(spec, name="engine-B") as eng:
        keys = eng.keys(job.tokens, job.cache_salt)
        hit = eng.client.lookup(keys, spec.chunk_size, num_tokens=len(job.tokens), model=spec.model_name)
        retrieved = eng.client.retrieve(eng.reg, keys, job.block_ids, skip_tokens=job.skip_tokens)
        problems = verify_cache(eng.cache, spec, job.block_ids, job.source, job.source_block_ids,
                                min(job.skip_tokens, retrieved * spec.chunk_size), retrieved * spec.chunk_size)
        return {"pid": os.getpid(), "registration": eng.reg.id, "fingerprint": eng.reg.layout_fingerprint,
                "object_bytes": eng.reg.object_bytes, "num_chunks": len(keys), "hit": hit,
                "retrieved": retrieved, "problems": problems}


def register_store_and_die(spec: EngineSpec, tokens: Sequence[int], out_path: str, registered, proceed) -> None:
    """An engine that registers, stores the chunks of ``tokens`` from blocks 0.., pins them with a
    lookup, tells the test its registration id, and exits on ``proceed`` without unregistering,
    ending its request or closing anything."""
    warm_up()
    eng = Engine(spec, name="doomed-engine")
    keys = eng.keys(tokens)
    ids = rotated_block_ids(spec, len(keys), start=0)
    r = eng.client.store(eng.reg, keys, ids)
    assert eng.client.lookup(keys, spec.chunk_size, pin_request="doomed-request") == len(keys)
    Path(out_path).write_text(json.dumps({"registration": eng.reg.id, "stored": r.stored, "pid": os.getpid()}))
    eng.cache.close()  # unlink the name only; the daemon keeps its mapping
    registered.set()
    proceed.wait(60)
    os._exit(0)


def register_store_and_hang(spec: EngineSpec, tokens: Sequence[int], out_path: str, registered,
                            report_pid: int = 0) -> None:
    """Like `register_store_and_die`, but the engine waits to be killed (SIGKILL from the test).
    ``report_pid``: the pid its client tells the daemon instead of its own, as a process in
    another PID namespace (another container) would: a number naming some other process here."""
    if report_pid:
        os.getpid = lambda: report_pid  # this process only (spawned for the test)
    warm_up()
    eng = Engine(spec, name="doomed-engine")
    keys = eng.keys(tokens)
    r = eng.client.store(eng.reg, keys, rotated_block_ids(spec, len(keys), start=0))
    assert eng.client.lookup(keys, spec.chunk_size, pin_request="doomed-request") == len(keys)
    Path(out_path).write_text(json.dumps({"registration": eng.reg.id, "stored": r.stored,
                                          "transport": eng.client.conn.transport, "keys": [k.hex() for k in keys]}))
    eng.cache.close()
    registered.set()
    time.sleep(600)
