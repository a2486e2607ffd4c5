"""The engine-side staging of a client's stores (`Stager`): gathering a store's chunks into the
staging ring (`kvdepot.client.staging`) apart from sending it, so that the engine's own thread
may gather on its stream while another thread sends (the vLLM connector does so,
`kvdepot.client.vllm.worker`), and the local waits on a stream."""

from __future__ import annotations

from collections.abc import Sequence

from kvdepot.client.registration import Registration


class Stager:
    """Gathers of stores into registrations' staging rings, and waits for a stream's work.
    Owns one local CUDA event per stream it waited on (`fence`). Touches no socket: the
    engine's thread may stage while another thread uses the connection. ``owner``: the
    `kvdepot.client.connection.Connection` the regions' requests go on (only its thread
    reclaims them, `StagingRing.alloc`)."""

    def __init__(self, owner: object) -> None:
        self._owner = owner
        self._fences: dict = {}  # cudaStream_t -> a local event (`fence`)

    def stage_store(self, reg: Registration, block_ids: Sequence[Sequence[int]], num_chunks: int,
                    after=None, wait_for_room: bool = True):
        """Engine-side staging: enqueue on ``after`` (a ``torch.cuda.Stream``, default: the
        current stream) the gather of ``num_chunks`` chunks from the engine's blocks into a new
        region of the staging ring, then (fence words active) the GPU's write of the region's
        fence word. ``block_ids``: registered block ids per KV-cache group, chunk after chunk.
        Work enqueued on ``after`` later may overwrite the blocks. Without fence words this
        waits until the gather ran. Touches no socket: one thread may stage while another
        uses the client (the ring is thread-safe).

        Returns the `kvdepot.client.staging.StagingRegion` to pass to `submit_store`
        (``staged``) or to `abandon_region`; None: not staged (no ring, larger than the ring,
        or no room now with ``wait_for_room=False``).

        Raises:
            KernelError: the gather could not be enqueued (nothing is allocated then).
        """
        staging = reg.staging
        if staging is None or num_chunks <= 0:
            return None
        fenced = staging.fence_active
        region = staging.ring.alloc(num_chunks * reg.object_bytes, self._owner, wait=wait_for_room, fenced=fenced)
        if region is None:
            return None
        try:
            self.gather(reg, region, block_ids, num_chunks, after)
        except BaseException:
            region.fenced = False  # nothing of it is pending on the GPU (`gather`)
            region.release()
            raise
        return region

    def stage_store_pieces(self, reg: Registration, block_ids: Sequence[Sequence[int]], piece_chunks: Sequence[int],
                           after) -> list | None:
        """`stage_store` of chunks that go to the daemon as several requests (pieces of
        ``piece_chunks[q]`` chunks, in order): a region per piece, all filled by one call on
        ``after`` (a ``torch.cuda.Stream``; one launch per stretch of regions end to end), after
        which the GPU writes every piece's fence word (`EngineStaging.gather_pieces`). Fence
        words only; never waits for room. ``block_ids``: registered block ids per KV-cache
        group, of all the pieces' chunks, chunk after chunk.

        Returns the regions (piece q's to pass to its `submit_store`); None: not staged (no
        fence words in use, or no room for all of them now: stage them one by one instead).

        Raises:
            KernelError: the gather could not be enqueued (nothing is allocated then).
        """
        staging = reg.staging
        if staging is None or not staging.fence_active or not piece_chunks:
            return None
        regions = staging.ring.alloc_pieces([n * reg.object_bytes for n in piece_chunks], self._owner, fenced=True)
        if regions is None:
            return None
        try:
            staging.gather_pieces(block_ids, regions, piece_chunks, after)
        except BaseException:
            try:
                self.fence(after)  # no word will come: wait until what was enqueued ran
            except Exception:  # noqa: BLE001 - a context that fails this runs nothing more
                pass
            for r in regions:
                r.fenced = False
                r.release()
            raise
        return regions

    def gather(self, reg: Registration, region, block_ids: Sequence[Sequence[int]], num_chunks: int,
                after=None) -> None:
        """Enqueue on ``after`` (default: the current stream) the gather into ``region``, then
        its fence word's write (``region.fenced``; one call), or wait until the gather ran (not
        fenced).

        Raises:
            KernelError: the gather or the fence write could not be enqueued; nothing of the
                region is pending on the GPU then (what was enqueued before the error was
                waited for).
        """
        import torch

        staging = reg.staging
        stream = after if after is not None else torch.cuda.current_stream(staging.device)
        try:
            staging.gather(block_ids, num_chunks, region.offset, stream, region.seq if region.fenced else None)
        except BaseException:
            try:
                self.fence(stream)  # no word will come: wait until what was enqueued ran
            except Exception:  # noqa: BLE001 - a context that fails this runs nothing more
                pass
            raise
        if not region.fenced:
            self.fence(stream)

    @staticmethod
    def abandon_region(reg: Registration, region) -> None:
        """Give up a staged region whose store will not be sent (or was refused before any
        copy): free once its gather ran (its fence word), at once without fence words (the
        gather ran before `stage_store` returned). Never blocks."""
        fence = reg.staging.fence if reg.staging is not None else None
        if region.fenced and fence is not None:
            seq = region.seq
            region.is_free = lambda: fence.holds(seq)
        else:
            region.release()

    def fence(self, stream) -> None:
        """Return once the work enqueued on ``stream`` so far (the writes or the gather of a
        store's blocks) has completed on the GPU; at once if it already has.

        Why not hand the daemon an interprocess event to wait on: measured on an H200 with 14
        engine processes on one GPU (``kvdepot soak --device cuda --engines 14``), the daemon's
        ``cudaEventQuery`` on an engine's interprocess event reported a record complete while
        the work before it had not run yet (the engine's context was waiting for its time
        slice): the daemon copied a staging-ring region before the engine's gather wrote it,
        and the late gather then overwrote a retrieve's bytes in the same region (about 1 in
        1,000 retrieved chunks wrong). A local event, queried in the process that recorded it,
        is exact."""
        import torch

        ev = self._fences.get(stream.cuda_stream)
        if ev is None:
            with torch.cuda.device(stream.device):
                ev = self._fences[stream.cuda_stream] = torch.cuda.Event()
        ev.record(stream)
        if not ev.query():
            ev.synchronize()
