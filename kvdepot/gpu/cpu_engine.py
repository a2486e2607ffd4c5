"""CPU transfer engine: copies chunks between an engine's KV cache in host memory (POSIX shared
memory) and canonical objects, with torch strided copies.

This is the transfer path of CPU engines (and the reference the CUDA kernels are tested
against). Each copy is one ``Tensor.copy_`` per (layer group, run of consecutive block ids):
when the layers of a group are equally spaced in one storage (vLLM >= 0.33 views over one
allocation, legacy per-layer tensors are handled layer by layer) all layers move in that one
call. Copies run on whole machine words (8/4/2 bytes) when every stride and offset allows.
torch releases the GIL inside ``copy_``, so the daemon runs these in worker threads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdepot.gpu.layout import EngineLayout, LayerGroup

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split block ids into runs of consecutive ids; ids < 0 (blocks left alone) are in no run.

    Returns ``(index_in_list, first_block_id, length)`` triples, e.g.
    ``[4, 5, 6, 9] -> [(0, 4, 3), (3, 9, 1)]``, ``[-1, 0, 1, -1] -> [(1, 0, 2)]``.
    """
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1 or block_ids[i - 1] < 0:
            if block_ids[start] >= 0:
                runs.append((start, block_ids[start], i - start))
            start = i
    return runs


class _GroupPlan:
    """Precomputed torch views of one layer group over the engine's storages."""

    __slots__ = ("group", "word", "engine_views", "stacked")

    def __init__(self, group: LayerGroup, storages: Sequence[torch.Tensor]) -> None:
        v = group.view
        offs = [o for _, o in group.offsets]
        w = v.word_bytes([*offs, group.object_offset])
        wd = _WORD_DTYPES[w]
        self.group = group
        self.word = w
        size = (v.num_blocks, v.block_size, v.num_heads, v.num_kv, v.row_bytes // w)
        stride = (v.block_stride // w, v.token_stride // w, v.head_stride // w, v.kv_stride // w, 1)
        words = [s[: s.numel() // w * w].view(wd) for s in storages]
        sids = {sid for sid, _ in group.offsets}
        deltas = {b - a for a, b in zip(offs, offs[1:])}
        if len(sids) == 1 and len(deltas) <= 1 and min(deltas, default=0) >= 0:
            # all layers equally spaced in one storage: one 6-D view [L, B, N, H, KV, row]
            delta = deltas.pop() if deltas else 0
            self.stacked = True
            self.engine_views = [
                torch.as_strided(words[sids.pop()], (len(offs), *size), (delta // w, *stride), offs[0] // w)
            ]
        else:
            self.stacked = False
            self.engine_views = [
                torch.as_strided(words[sid], size, stride, off // w) for sid, off in group.offsets
            ]

    def object_view(self, obj: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """The group's slice of a canonical object as ``[L, blocks, N, H, KV, row_words]``."""
        g, v, w = self.group, self.group.view, self.word
        n = chunk_size * g.bytes_per_token
        sl = obj[g.object_offset : g.object_offset + n].view(_WORD_DTYPES[w])
        return sl.view(chunk_size // v.block_size, v.block_size, g.num_layers, v.num_heads, v.num_kv,
                       v.row_bytes // w).permute(2, 0, 1, 3, 4, 5)


class CpuTransferEngine:
    """Gathers / scatters canonical objects for one registration.

    Args:
        layout: the registration's `EngineLayout`.
        storages: the engine's storages as 1-D uint8 tensors (mapped shared memory).
    """

    name = "cpu-torch"

    def __init__(self, layout: EngineLayout, storages: Sequence[torch.Tensor]) -> None:
        self.layout = layout
        self.plans = [_GroupPlan(g, storages) for g in layout.groups]

    def _copy(self, obj: torch.Tensor, block_ids: Sequence[Sequence[int]], skip_tokens: int, to_object: bool) -> None:
        cs = self.layout.chunk_size
        assert obj.numel() == self.layout.object_bytes and obj.dtype == torch.uint8, "object buffer size"
        for plan in self.plans:
            g = plan.group
            skip = skip_tokens // g.view.block_size
            ids = list(block_ids[g.gid])[skip:]
            ov = plan.object_view(obj, cs)
            for i0, b0, k in block_runs(ids):
                i0 += skip
                if plan.stacked:
                    ev = plan.engine_views[0]
                    if to_object:
                        ov[:, i0 : i0 + k].copy_(ev[:, b0 : b0 + k])
                    else:
                        ev[:, b0 : b0 + k].copy_(ov[:, i0 : i0 + k])
                else:
                    for li, ev in enumerate(plan.engine_views):
                        if to_object:
                            ov[li, i0 : i0 + k].copy_(ev[b0 : b0 + k])
                        else:
                            ev[b0 : b0 + k].copy_(ov[li, i0 : i0 + k])

    def gather(self, obj: torch.Tensor, block_ids: Sequence[Sequence[int]]) -> None:
        """Copy one chunk from engine blocks into ``obj``.

        Args:
            obj: uint8 tensor of ``layout.object_bytes`` (canonical format).
            block_ids: per gid, the ``chunk_size // tokens_per_block[gid]`` block ids of the
                chunk in token order (already range-checked by the caller).
        """
        self._copy(obj, block_ids, 0, True)

    def scatter(self, obj: torch.Tensor, block_ids: Sequence[Sequence[int]], skip_tokens: int = 0) -> None:
        """Copy one chunk from ``obj`` into engine blocks, leaving the blocks of the first
        ``skip_tokens`` tokens untouched (a multiple of every gid's tokens_per_block)."""
        self._copy(obj, block_ids, skip_tokens, False)
