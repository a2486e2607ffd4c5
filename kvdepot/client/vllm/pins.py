"""Pins on the sliding-window blocks a step's stores read, in vLLM's ``BlockPool``: vLLM lets a
sliding-window block go as it leaves the window while its request runs and hands it to another
request at once, so the scheduler side holds one reference on each block a step's stores read
until every worker reported that step's save ended (`KVDepotWorkerMeta.saves_ended`); the
transfer thread may then gather those stores as late as a full-attention model's."""

from __future__ import annotations

from collections.abc import Sequence

from kvdepot.client.vllm.plan import StoreJob


class StorePins:
    """The scheduler side's pins (`SchedulerConnector.bind_gpu_block_pool`).

    pool: vLLM's ``BlockPool`` (``touch``, ``free_blocks``, ``blocks``).
    sliding_gids: daemon gids of the groups whose blocks vLLM lets go while a request runs.
    workers: how many workers report each save (every rank of the engine).
    stats: `SchedulerConnector.stats`, whose ``blocks_pinned`` / ``blocks_unpinned`` this counts.
    """

    def __init__(self, pool, sliding_gids: Sequence[int], workers: int, stats: dict[str, int]) -> None:
        self.pool = pool
        self._sliding_gids = list(sliding_gids)
        self._workers = workers
        self._stats = stats
        self.saves_pinned = 0  # saves pinned so far (the newest one's number)
        self.saves: dict[int, list] = {}  # pinned save -> the KVCacheBlocks touched for it
        self.reports: dict[int, int] = {}  # pinned save -> workers that reported it ended so far

    def pin(self, stores: list[StoreJob], null_block_id: int) -> int:
        """Pin the sliding-window blocks ``stores`` read (one reference each, vLLM's
        ``BlockPool.touch``); returns the save's number, 0 if it reads none."""
        pool, null = self.pool, null_block_id
        pinned = []
        for job in stores:
            for i in self._sliding_gids:
                ids = [b for b in job.block_ids[i] if b != null]  # (half of them are null: `kept_from`)
                pinned += map(pool.blocks.__getitem__, ids)
        for blk in pinned:
            if blk.ref_cnt:  # its request holds it (always, as the step's stores are built)
                blk.ref_cnt += 1  # what touch() does to it, less a call per block
            else:
                pool.touch((blk,))  # in the free queue: taken out of it
        if not pinned:
            return 0
        self.saves_pinned += 1
        self.saves[self.saves_pinned] = pinned
        self._stats["blocks_pinned"] += len(pinned)
        return self.saves_pinned

    def unpin(self, saves_ended: dict[int, int]) -> None:
        """Drop the pins of the saves every worker has now reported ended (``saves_ended``: save
        number -> workers reporting it in this step's output)."""
        for seq, n in saves_ended.items():
            got = self.reports.get(seq, 0) + n
            if got < self._workers:
                self.reports[seq] = got
                continue
            self.reports.pop(seq, None)
            pinned = self.saves.pop(seq, None)
            if pinned:
                # one reference less each; blocks only the pin held go back to vLLM's free queue
                # (most of them: vLLM dropped its own when they left the window), as vLLM's
                # free_blocks would have queued them itself without the pin
                self.pool.free_blocks(pinned)
                self._stats["blocks_unpinned"] += len(pinned)

    @property
    def held(self) -> int:
        """Blocks pinned now (sliding-window stores not ended)."""
        return sum(len(b) for b in self.saves.values())
