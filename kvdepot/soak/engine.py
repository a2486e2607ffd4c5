"""A soak engine process: a KV cache (shared memory, or CUDA memory with engine-side staging)
registered with the daemon, running random requests on overlapping prefixes until told to stop:
lookup (pinned) -> retrieve the hit into random blocks and check every byte -> write the rest
from its keys and store it -> end the request; now and then a flush. It survives what the fault
injector does to the daemon (errors are counted; a restarted daemon is registered with again)
and reports its counters to the orchestrator every ``report_interval_s``.

Which blocks hold which chunk is tracked (``shadow``): every ``verify_every`` requests the whole
cache is checked, so a copy that wrote outside its blocks is found too. Blocks an unanswered or
failed retrieve may have written are forgotten (their bytes are unknown, not wrong).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import random
import sys
import time

from kvdepot.protocol.errors import ErrorCode, KVDepotError
from kvdepot.soak.content import FAMILIES, Family, corrupt_bytes, write_chunk

# errors after which the engine reconnects (and registers again if the daemon restarted)
_RECOVER = (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE, ErrorCode.DISCONNECTED, ErrorCode.UNKNOWN_REGISTRATION,
            ErrorCode.INTERNAL, ErrorCode.BACKPRESSURE)
_SALTS = ("", "tenant-b")
_LOST = (ErrorCode.TIMEOUT, ErrorCode.DISCONNECTED, ErrorCode.INTERNAL)  # the copy may still run
_QUARANTINE_S = 30.0


@dataclasses.dataclass
class EngineSpec:
    """One soak engine. ``family``: index into `FAMILIES`; ``prompts``: size of the pool of base
    prompts whose prefixes the engines share; ``max_chunks``: chunks per request at most."""

    index: int
    endpoint: str
    family: int
    layout: str
    seed: int
    device: str = "cpu"
    timeout_s: float = 2.0
    prompts: int = 24
    max_chunks: int = 8
    unique_share: float = 0.25  # requests whose last chunks are new tokens (always stored)
    flush_share: float = 0.002  # requests followed by a flush of this engine's model
    verify_every: int = 25  # requests between checks of the whole cache
    report_interval_s: float = 0.5


class _Engine:
    def __init__(self, spec: EngineSpec, reports) -> None:
        import torch

        from kvdepot.client import KVDepotClient
        from kvdepot.client.kvcache import ShmKVCache

        torch.set_num_threads(1)
        self.spec = spec
        self.fam: Family = FAMILIES[spec.family]
        self.rng = random.Random(spec.seed)
        self.reports = reports
        device = "cuda" if spec.device == "cuda" else None
        # CPU: a sealed memfd, which the fault injector tries to shrink under the daemon's copies
        self.cache = ShmKVCache(list(self.fam.groups), list(self.fam.num_blocks), spec.layout, device=device,
                                sealed=device is None)
        self.client = KVDepotClient(spec.endpoint, timeout_s=spec.timeout_s, name=f"soak-engine-{spec.index}",
                                    connect=False)
        self.stream = torch.cuda.current_stream() if device else None
        self.reg = None
        self.reg_generation = -1
        # shadow[gid][block] = (chunk key, index of the block within the chunk) or None (unknown)
        self.shadow: list[list[tuple[bytes, int] | None]] = [[None] * n for n in self.fam.num_blocks]
        # how each block got what it holds, and what it held before: what a corrupt block's
        # report names (`explain`)
        self.origin: list[list[tuple | None]] = [[None] * n for n in self.fam.num_blocks]
        self.previous: list[list[tuple[bytes, int] | None]] = [[None] * n for n in self.fam.num_blocks]
        self.explained = 0
        self._selftest_rng = random.Random(spec.seed + 1)
        self._ring = None  # (ring offset, block ids, chunks) of the last staged retrieve
        # the engine's last staged copies: (request number, "store" / "retrieve", keys, ring offset)
        self.history: collections.deque = collections.deque(maxlen=48)
        self.quarantine: dict[tuple[int, int], float] = {}  # (gid, block) -> time.monotonic() it is free again
        self.counts = collections.Counter()
        self.errors = collections.Counter()
        self.last_progress = time.time()
        self._next_report = 0.0

    # ------------------------------------------------------------------ daemon

    def register(self) -> None:
        c, cache = self.client, self.cache
        if self.reg is None:
            self.reg = c.register(self.fam.model, "tp0of1", self.fam.chunk_size, cache.storage_specs(),
                                  cache.layer_specs(), cache.group_specs(), device=cache.register_device,
                                  local_storages=[cache.storage] if cache.register_device == "cuda" else None,
                                  staging_bytes=32 << 20, storage_fds=cache.storage_fds(),
                                  # every other CUDA engine retrieves through a ring of its own
                                  load_staging_bytes=(16 << 20) if self.spec.index % 2 else 0)
        else:
            self.reg = c.reregister(self.reg)
        self.reg_generation = c.generation
        self.counts["registrations"] += 1

    def recover(self, stop) -> None:
        """Reconnect until the daemon answers (registering again if it restarted) or ``stop``."""
        while not stop.is_set():
            try:
                self.client.ping()
                if self.reg is None or self.reg_generation != self.client.generation:
                    self.register()
                return
            except KVDepotError as exc:
                self.errors[exc.code.name] += 1
                self.report()
                time.sleep(0.05)

    # ------------------------------------------------------------------ one request

    def blocks_for(self, num_chunks: int) -> list[list[int]]:
        """Random distinct block ids per gid for ``num_chunks`` chunks, none in quarantine."""
        now = time.monotonic()
        if self.quarantine and min(self.quarantine.values()) < now:
            self.quarantine = {k: t for k, t in self.quarantine.items() if t >= now}
        out = []
        for g, n in enumerate(self.fam.num_blocks):
            free = [b for b in range(n) if (g, b) not in self.quarantine]
            out.append(self.rng.sample(free, min(len(free), num_chunks * self.fam.blocks_per_chunk(g))))
        return out

    def quarantine_blocks(self, ids: list[list[int]], free_at_s: float | None = None) -> None:
        """A copy that touches ``ids`` was lost (no answer): the daemon may still read or write
        them, so they are neither reused nor checked until ``free_at_s`` (a CPU store's
        ``blocks_free_at_s``: its deadline passed), else for ``_QUARANTINE_S`` (what the vLLM
        connector's ``hold_max_s`` does for a request's blocks)."""
        until = free_at_s if free_at_s is not None else time.monotonic() + _QUARANTINE_S
        if free_at_s is not None:
            self.counts["blocks_reused_after_deadline"] += sum(map(len, ids))
        self.forget(ids)
        for g, blocks in enumerate(ids):
            for b in blocks:
                self.quarantine[(g, b)] = until
        self.counts["quarantined_blocks"] += sum(map(len, ids))

    def chunk_blocks(self, ids: list[list[int]], j: int) -> list[list[int]]:
        return [x[j * self.fam.blocks_per_chunk(g):(j + 1) * self.fam.blocks_per_chunk(g)] for g, x in enumerate(ids)]

    def own(self, ids: list[list[int]], keys: list[bytes], lo: int, hi: int, how: tuple = ()) -> None:
        """Blocks of chunks [lo, hi) now hold those chunks (``how``: by what, for reports)."""
        for j in range(lo, hi):
            for g, blocks in enumerate(self.chunk_blocks(ids, j)):
                for part, b in enumerate(blocks):
                    self.shadow[g][b] = (keys[j], part)
                    self.origin[g][b] = (*how, j)

    def forget(self, ids: list[list[int]]) -> None:
        for g, blocks in enumerate(ids):
            for b in blocks:
                if self.shadow[g][b] is not None:
                    self.previous[g][b] = self.shadow[g][b]
                self.shadow[g][b] = None

    def tokens(self) -> tuple[list[int], str]:
        fam, rng = self.fam, self.rng
        base = rng.randrange(self.spec.prompts)
        n = rng.randint(1, self.spec.max_chunks) * fam.chunk_size
        r = random.Random(base * 7919 + 17)  # the base prompt's tokens: shared by every engine
        toks = [r.randrange(128_000) for _ in range(n)]
        if rng.random() < self.spec.unique_share:
            k = rng.randint(1, max(1, n // fam.chunk_size)) * fam.chunk_size
            toks[-k:] = [rng.randrange(128_000) for _ in range(k)]
        return toks, rng.choice(_SALTS)

    def request(self) -> None:
        c, fam = self.client, self.fam
        toks, salt = self.tokens()
        keys = self.reg.keys(toks, salt)
        req = f"soak-{self.spec.index}-{self.counts['requests']}"
        self.counts["requests"] += 1
        ids = self.blocks_for(len(keys))
        if any(len(x) < len(keys) * fam.blocks_per_chunk(g) for g, x in enumerate(ids)):
            self.counts["skipped_no_free_blocks"] += 1
            time.sleep(0.01)
            return
        hit = c.lookup(keys, fam.chunk_size, pin_request=req)
        self.counts["lookups"] += 1
        self.counts["lookup_hit_chunks"] += hit
        got = 0
        try:
            if hit:
                target = [x[:hit * fam.blocks_per_chunk(g)] for g, x in enumerate(ids)]
                self.forget(target)  # written by the retrieve from here on
                unstaged = c.unstaged_requests
                try:
                    pending = c.submit_retrieve(self.reg, keys[:hit], target, request=req)
                    got = pending.result(self.stream, cpu_wait=True)
                    region = getattr(pending, "_region", None)
                    self._ring = (region.offset, target, hit) if region is not None else None
                    if region is not None:
                        self.history.append((self.counts["requests"], "retrieve", keys[:hit], region.offset))
                    if self.stream is not None:
                        self.stream.synchronize()
                except KVDepotError as exc:
                    if exc.code in _LOST:
                        self.quarantine_blocks(target)
                    raise
                self.counts["retrieves"] += 1
                self.counts["retrieved_chunks"] += got
                self.counts["short_retrieves"] += got < hit
                how = ("retrieved", self.counts["requests"], "unstaged" if c.unstaged_requests > unstaged
                       else "staged" if self.reg.staging is not None else "direct",
                       c.generation)
                self.own(ids, keys, 0, got, how)
                before = self.counts["corrupt_checks"]
                self.check([(g, b, keys[j], p) for j in range(got)
                            for g, blocks in enumerate(self.chunk_blocks(ids, j)) for p, b in enumerate(blocks)],
                           request_keys=keys)
                if (self._ring is not None and got and self.counts["corrupt_checks"] == before
                        and self._selftest_rng.random() < 0.02):
                    # the explanation's ring check, on a retrieve that went right: it must say so
                    busy = [set(x) for x in ids]
                    self.counts["rescatter_selftests"] += 1
                    self.counts["rescatter_selftest_wrong"] += self.rescatter(keys[0], keys, busy) != "right"
            if got < len(keys):
                self.forget([x[got * fam.blocks_per_chunk(g):] for g, x in enumerate(ids)])
                for j in range(got, len(keys)):
                    write_chunk(self.cache, fam, keys[j], self.chunk_blocks(ids, j))
                self.own(ids, keys, got, len(keys), ("written", self.counts["requests"]))
                rest = [x[got * fam.blocks_per_chunk(g):] for g, x in enumerate(ids)]
                ps = None
                try:
                    ps = c.submit_store(self.reg, keys[got:], rest, parent=keys[got - 1] if got else b"",
                                        cache_salt=salt, request=req, after=self.stream)
                    region = getattr(ps, "_region", None)
                    if region is not None:
                        self.history.append((self.counts["requests"], "store", keys[got:], region.offset))
                    r = ps.result()
                except KVDepotError as exc:
                    if exc.code in _LOST:
                        self.quarantine_blocks(rest, getattr(ps, "blocks_free_at_s", None))
                    raise
                self.counts["stores"] += 1
                self.counts["stored_chunks"] += r.stored
        finally:
            try:
                c.end_request(req)
            except KVDepotError:
                pass  # the pin goes with the connection or its TTL
        if self.rng.random() < self.spec.flush_share:
            c.flush(model=fam.model)
            self.counts["flushes"] += 1
        if self.counts["requests"] % self.spec.verify_every == 0:
            self.check([(g, b, *owner) for g, col in enumerate(self.shadow) for b, owner in enumerate(col)
                        if owner is not None], whole_cache=True)
        self.last_progress = time.time()

    def check(self, items, whole_cache: bool = False, request_keys: list[bytes] = ()) -> None:
        compared, differ = corrupt_bytes(self.cache, self.fam, items)
        self.counts["verified_bytes"] += compared
        if whole_cache:
            self.counts["cache_checks"] += 1
        if differ:
            self.counts["corrupt_bytes"] += differ
            self.counts["corrupt_checks"] += 1
            self.explain(items, "whole-cache check" if whole_cache else "retrieve", request_keys)
            self.report(force=True)

    def explain(self, items, phase: str, request_keys: list[bytes]) -> None:
        """Print (stderr, one JSON line each, at most 20 per engine) which blocks are corrupt,
        how they got their bytes and what they hold instead: the chunk they held before (a write
        that never happened), another block of the same request (a misplaced copy), zeros."""
        if self.explained >= 20:
            return
        fam, cache = self.fam, self.cache
        busy = [set() for _ in fam.num_blocks]
        for g, b, _, _ in items:
            busy[g].add(b)
        bad = [(g, b, key, part) for g, b, key, part in items if corrupt_bytes(cache, fam, [(g, b, key, part)])[1]]
        bad_keys = list(dict.fromkeys(key for _, _, key, _ in bad))
        ring: dict[bytes, str | None] = {}
        refetched: dict[bytes, str] = {}
        if phase == "retrieve":  # the ring first: a refetch goes through it
            ring = {key: self.rescatter(key, request_keys, busy) for key in bad_keys}
            refetched = {key: self.refetch(key, busy) for key in bad_keys}
        for g, b, key, part in bad:
            layers = [layer for layer, lg in enumerate(cache.layer_gids) if lg == g]
            per_layer = [corrupt_bytes(_OneLayer(cache, layer), fam, [(g, b, key, part)])[1] for layer in layers]
            holds = "unknown"
            prev = self.previous[g][b]
            if prev is not None and corrupt_bytes(cache, fam, [(g, b, *prev)])[1] == 0:
                holds = "its previous chunk (stale)"
            elif (past := self._from_history(g, b)) is not None:
                holds = past
            else:
                for j, k in enumerate(request_keys):
                    for p in range(fam.blocks_per_chunk(g)):
                        if corrupt_bytes(cache, fam, [(g, b, k, p)])[1] == 0:
                            holds = f"chunk {j} block {p} of the same request"
                tok = [cache.read_tokens(layer, [b], as_bytes=True) for layer in layers]
                if holds == "unknown" and all(int(t.count_nonzero()) == 0 for t in tok):
                    holds = "zeros"
            print(json.dumps({"soak_corrupt": phase, "engine": self.spec.index, "model": fam.model,
                              "layout": self.spec.layout, "device": self.spec.device, "gid": g, "block": b,
                              "part": part, "key": key.hex()[:16], "differ_per_layer": per_layer,
                              "origin": self.origin[g][b], "holds": holds, "refetched": refetched.get(key),
                              "ring_now": ring.get(key),
                              "request": self.counts["requests"],
                              "generation": self.client.generation,
                              "unstaged_requests": self.client.unstaged_requests}), file=sys.stderr, flush=True)
            self.explained += 1
            if self.explained >= 20:
                return

    def _from_history(self, g: int, b: int) -> str | None:
        """Whether block ``b`` holds a chunk of one of the engine's recent staged copies."""
        fam, now = self.fam, self.counts["requests"]
        for req_no, kind, keys, offset in reversed(self.history):
            for j, k in enumerate(keys):
                for p in range(fam.blocks_per_chunk(g)):
                    if corrupt_bytes(self.cache, fam, [(g, b, k, p)])[1] == 0:
                        return (f"chunk {j} block {p} of the {kind} {now - req_no} requests ago "
                                f"(its ring offset {offset}, this retrieve's {self._ring[0] if self._ring else None})")
        return None

    def _spare(self, busy: list[set[int]]) -> list[list[int]] | None:
        fam = self.fam
        spare = []
        for g, n in enumerate(fam.num_blocks):
            free = [b for b in range(n) if b not in busy[g] and (g, b) not in self.quarantine]
            if len(free) < fam.blocks_per_chunk(g):
                return None
            spare.append(free[:fam.blocks_per_chunk(g)])
        self.forget(spare)
        return spare

    def rescatter(self, key: bytes, request_keys: list[bytes], busy: list[set[int]]) -> str | None:
        """Staged retrieves: scatter chunk ``key`` again out of the staging ring (where the
        daemon copied it) into spare blocks and check it: "right" says the ring holds the right
        bytes now (the first scatter read it too early), "wrong" that the copy into the ring
        brought wrong bytes."""
        if self._ring is None or self.reg.staging is None or key not in request_keys:
            return None
        offset, target, hit = self._ring
        j = request_keys.index(key)
        if j >= hit:
            return None
        spare = self._spare(busy)
        if spare is None:
            return "no spare blocks"
        fam = self.fam
        ids = [[-1] * (hit * fam.blocks_per_chunk(g)) for g in range(len(fam.num_blocks))]
        for g, blocks in enumerate(spare):
            n = fam.blocks_per_chunk(g)
            ids[g][j * n:(j + 1) * n] = blocks
        self.reg.staging.scatter(ids, hit, hit, offset, 0, self.stream)
        self.stream.synchronize()
        differ = corrupt_bytes(self.cache, fam, [(g, b, key, p) for g, blocks in enumerate(spare)
                                                 for p, b in enumerate(blocks)])[1]
        return "wrong" if differ else "right"

    def refetch(self, key: bytes, busy: list[set[int]]) -> str:
        """Retrieve the chunk ``key`` again into blocks outside ``busy`` and check it: "right"
        (the daemon holds the right bytes: the first retrieve went wrong on its way), "wrong
        again" (the stored object itself is wrong), "gone" (evicted meanwhile) or an error."""
        fam, c = self.fam, self.client
        spare = self._spare(busy)
        if spare is None:
            return "no spare blocks"
        try:
            got = c.retrieve(self.reg, [key], spare, request=f"refetch-{self.spec.index}-{self.counts['requests']}",
                             before=self.stream, cpu_wait=True)
            if self.stream is not None:
                self.stream.synchronize()
        except KVDepotError as exc:
            if exc.code in _LOST:
                self.quarantine_blocks(spare)
            return f"error {exc.code.name}"
        if not got:
            return "gone"
        differ = corrupt_bytes(self.cache, fam, [(g, b, key, p) for g, blocks in enumerate(spare)
                                                 for p, b in enumerate(blocks)])[1]
        return "wrong again" if differ else "right"

    def report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_report:
            return
        self._next_report = now + self.spec.report_interval_s
        staging = self.reg.staging if self.reg is not None else None
        msg = {"index": self.spec.index, "pid": os.getpid(), "registration": self.reg.id if self.reg else None,
               "memfd": self.cache.fd, "memfd_bytes": self.cache.size_bytes,
               "load_ring": staging is not None and staging.load_ring is not staging.ring,
               "counts": dict(self.counts), "errors": dict(self.errors), "last_progress": self.last_progress}
        try:
            self.reports.put_nowait(msg)
        except queue.Full:
            pass


def engine_main(spec: EngineSpec, reports, stop) -> None:
    """Entry point of an engine process (``multiprocessing`` spawn): runs until ``stop`` is set.
    With ``$KVDEPOT_SOAK_PROFILE`` set to a directory, the process's cProfile statistics go to
    ``engine-<index>-<pid>.prof`` there (where an engine's time goes, for the ops rate)."""
    prof_dir = os.environ.get("KVDEPOT_SOAK_PROFILE")
    if prof_dir:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        try:
            _engine_main(spec, reports, stop)
        finally:
            prof.disable()
            prof.dump_stats(os.path.join(prof_dir, f"engine-{spec.index}-{os.getpid()}.prof"))
        return
    _engine_main(spec, reports, stop)


def _engine_main(spec: EngineSpec, reports, stop) -> None:
    eng = _Engine(spec, reports)
    try:
        eng.recover(stop)
        while not stop.is_set():
            try:
                eng.request()
            except KVDepotError as exc:
                eng.errors[exc.code.name] += 1
                if exc.code == ErrorCode.UNKNOWN_REGISTRATION:
                    eng.reg_generation = -1  # the daemon lost it: register again
                if exc.code in _RECOVER:
                    eng.recover(stop)
            eng.report()
        eng.report(force=True)
        if eng.counts["rescatter_selftests"]:
            print(json.dumps({"soak_rescatter_selftest": eng.counts["rescatter_selftests"],
                              "wrong": eng.counts["rescatter_selftest_wrong"]}), file=sys.stderr, flush=True)
    finally:
        eng.client.close()
        eng.cache.close()


class _OneLayer:
    """A cache seen through one layer (the others report nothing): per-layer corrupt counts."""

    def __init__(self, cache, layer: int) -> None:
        self._cache, self._layer = cache, layer
        self.device = cache.device
        self.layer_gids = [g if i == layer else -1 for i, g in enumerate(cache.layer_gids)]

    def read_tokens(self, layer: int, block_ids, as_bytes: bool = False):
        return self._cache.read_tokens(layer, block_ids, as_bytes)
