"""The worker's planner (`Planner`): a job's chunk keys for this shard, its registered block ids
and its split into pieces of at most a quarter of the staging ring it goes through. It touches
no socket and no GPU: what it returns depends only on the job and the worker's registration."""

from __future__ import annotations

import logging

from kvdepot.client.hashing import shard_keys, shard_mask
from kvdepot.client.vllm.layout import Registration
from kvdepot.client.vllm.plan import StoreJob

log = logging.getLogger("kvdepot.vllm")


class Planner:
    """Keys, block ids and pieces of one worker's jobs.

    Args:
        side: the `kvdepot.client.vllm.worker.WorkerConnector` (read: ``shard``, ``cfg.chunk_size``,
            ``groups``, ``reg`` and ``kvreg``, the registration and its staging rings; its
            ``stats`` count vLLM null blocks left alone).
    """

    def __init__(self, side) -> None:
        self.side = side
        self.registrar = side.registrar
        self.cfg = side.cfg
        self._masks: dict[bytes, bytes] = {}  # request seed -> this shard's mask
        self._warned_window = False  # `window_blocks_only` logged its warning

    def keys(self, chain: list[bytes], seed: bytes) -> list[bytes]:
        mask = self._masks.get(seed)
        if mask is None:
            if len(self._masks) > 4096:
                self._masks.clear()
            mask = self._masks[seed] = shard_mask(seed, self.side.shard)
        return shard_keys(chain, [mask])[0]

    def piece_chunks(self, kind: str = "store") -> int:
        """Most chunks per piece of a ``kind`` ("store" / "load") job: a quarter of the ring it
        goes through (loads: `EngineStaging.load_ring`), so that several are in flight."""
        kvreg = self.registrar.kvreg
        if kvreg is None or kvreg.staging is None:
            return 1 << 30
        st = kvreg.staging
        return max(1, (st.load_ring if kind == "load" else st.ring).size_bytes // 4 // kvreg.object_bytes)

    def block_ids(self, reg: Registration, g: int, ids: list[int], null_id: int | None) -> list[int]:
        """Manager block ids of daemon gid ``g`` -> registered block ids; ``null_id`` -> -1."""
        r = reg.ratio[g]
        if null_id is not None and self.side.groups[g].has_null_blocks and null_id in ids:
            self.side.stats["null_blocks_left_alone"] += 1
            return [-1 if b == null_id else b * r + i for b in ids for i in range(r)]
        return reg.expand(g, ids)

    def window_blocks_only(self, ids: list[list[int]], bpc: list[int]) -> bool:
        """Whether a load's registered block ids (`block_ids`, null -> -1) ask for no block a
        store left out (`TransferGroup.kept_from`): a vLLM that kept more of a sliding window
        than this connector expects gets no bytes of vLLM's null block (the load fails and
        vLLM recomputes; logged once)."""
        c = self.cfg.chunk_size
        for g, x, n in zip(self.side.groups, ids, bpc):
            drop = g.kept_from(c)
            if drop:
                r = n * g.block_size // c  # registered blocks per vLLM block
                if any(b != -1 for i in range(0, len(x), n) for b in x[i:i + drop * r]):
                    if not self._warned_window:
                        self._warned_window = True
                        log.warning("kvdepot: vLLM gave a load blocks of KV-cache group %d more than %d blocks "
                                    "before a chunk's end (the stores keep only those): such loads fail and "
                                    "vLLM recomputes them", g.vllm_gid, g.window_blocks)
                    return False
        return True

    def job_ids(self, job: StoreJob) -> list[list[int]]:
        """A store job's registered block ids per daemon gid, all its chunks.

        Raises:
            RuntimeError: a lazy job (`StoreJob.lazy`) not sliced by `Sender._sliced` first whose
                blocks include the null block (no caller gets there: lazy jobs are made only
                for models whose saves go through `Sender._save`).
        """
        if job.block_ids is None and not job.slice_block_ids():
            raise RuntimeError(f"store of request {job.req_id}: vLLM's null block among its blocks")
        reg = self.registrar.reg
        return [self.block_ids(reg, g, b, None) for g, b in enumerate(job.block_ids)]

    def store_pieces(self, job: StoreJob, ids: list[list[int]] | None = None) -> list[tuple[int, int, list[list[int]]]]:
        """A store job's pieces: (first chunk, end chunk, registered block ids per daemon gid);
        ``ids``: `job_ids`, if the caller has them."""
        reg, n = self.registrar.reg, len(job.chain)
        per = self.piece_chunks()
        if ids is None:
            ids = self.job_ids(job)
        bpc = [self.cfg.chunk_size // gs.tokens_per_block for gs in reg.groups]
        return [(s, min(n, s + per), [x[s * k:min(n, s + per) * k] for x, k in zip(ids, bpc)])
                for s in range(0, n, per)]
