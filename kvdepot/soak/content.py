"""What a soak engine's KV bytes must be: every chunk's bytes derive from its chunk key, so any
engine (any layout, any block ids, any process) can write a chunk before storing it and check
every byte of a chunk it retrieved, with nothing shared but the key.

A chunk of family ``f`` with key ``k``: ``Generator(PCG64(k)).bytes(f.object_bytes)`` split in
cache layer order into ``[chunk_size, H, KV, row_bytes]`` uint8 pieces, one per layer (the
logical token rows of `kvdepot.client.kvcache.ShmKVCache.token_view`, whatever the layout).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvdepot.client.kvcache import KVGroupShape, ShmKVCache


@dataclasses.dataclass(frozen=True)
class Family:
    """Engines that share chunk keys: one model id, KV-cache groups, chunk size; any layout.

    Attributes:
        model: the model id the engines register (keys are seeded by it).
        groups: the KV-cache groups (gid 0.., tokens per block may differ: hybrid models).
        chunk_size: tokens per chunk (a multiple of every group's tokens per block).
        layouts: `ShmKVCache` layouts its engines pick from.
        num_blocks: blocks per gid of each engine's cache.
    """

    model: str
    groups: tuple[KVGroupShape, ...]
    chunk_size: int
    layouts: tuple[str, ...]
    num_blocks: tuple[int, ...]

    def blocks_per_chunk(self, gid: int) -> int:
        return self.chunk_size // self.groups[gid].tokens_per_block

    @functools.cached_property
    def layer_shapes(self) -> list[tuple[int, tuple[int, int, int, int]]]:
        """(gid, ``[chunk_size, H, KV, row_bytes]``) of each layer, in cache layer order."""
        return [(g.gid, (self.chunk_size, g.num_heads, 1 if g.mla else 2, g.row_bytes))
                for g in self.groups for _ in range(g.num_layers)]

    @functools.cached_property
    def layer_bytes(self) -> list[int]:
        return [math.prod(shape) for _, shape in self.layer_shapes]

    @functools.cached_property
    def object_bytes(self) -> int:
        return sum(self.layer_bytes)


_DENSE = KVGroupShape(0, 6, 3, 64, 16)  # a SmolLM2-like slice: 6 layers, 3 KV heads, head dim 64, bf16
FAMILIES: tuple[Family, ...] = (
    Family("soak-dense-c16", (_DENSE,), 16, ("LBNHC", "LBHNC", "flashinfer", "flash_attn_hnd", "BLNHC"), (96,)),
    Family("soak-dense-c32", (_DENSE,), 32, ("LBNHC", "BLHNC", "flash_attn_nhd"), (96,)),
    # hybrid: two KV-cache groups of different tokens per block (as gpt-oss: full + sliding window)
    Family("soak-hybrid-c64", (KVGroupShape(0, 4, 2, 64, 16), KVGroupShape(1, 4, 2, 64, 32)), 64,
           ("LBNHC", "LBHNC"), (96, 48)),
)


@functools.lru_cache(maxsize=256)  # engines on shared prefixes meet the same keys again and again
def chunk_layers(family: Family, key: bytes, device: str = "cpu") -> list[torch.Tensor]:
    """The bytes of the chunk with ``key``: per layer, uint8 ``[chunk_size, H, KV, row_bytes]`` on
    ``device`` (shared by callers: read only)."""
    if device != "cpu":
        return [t.to(device) for t in chunk_layers(family, key)]
    gen = np.random.Generator(np.random.PCG64(int.from_bytes(key, "little")))
    raw = torch.frombuffer(bytearray(gen.bytes(family.object_bytes)), dtype=torch.uint8)
    out, off = [], 0
    for (_, shape), n in zip(family.layer_shapes, family.layer_bytes):
        out.append(raw[off:off + n].view(shape))
        off += n
    return out


def write_chunk(cache: ShmKVCache, family: Family, key: bytes, block_ids: Sequence[Sequence[int]]) -> None:
    """Write the chunk with ``key`` into ``block_ids`` (per gid, the chunk's blocks in token order)."""
    for layer, data in enumerate(chunk_layers(family, key, str(cache.device))):
        cache.write_tokens(layer, block_ids[cache.layer_gids[layer]], data, as_bytes=True)


def corrupt_bytes(cache: ShmKVCache, family: Family, items: Iterable[tuple[int, int, bytes, int]]) -> tuple[int, int]:
    """Compare blocks with what they must hold, where the cache lives (one device sync in all).
    ``items``: ``(gid, block id, chunk key, index of the block within its chunk)``. Returns
    (bytes compared, bytes that differ)."""
    by_key: dict[bytes, list[tuple[int, int, int]]] = {}
    for gid, block, key, part in items:
        by_key.setdefault(key, []).append((gid, block, part))
    device = str(cache.device)
    compared, differ = 0, []
    for key, blocks in by_key.items():
        expected = chunk_layers(family, key, device)
        for layer, exp in enumerate(expected):
            gid = cache.layer_gids[layer]
            mine = [(b, p) for g, b, p in blocks if g == gid]
            if not mine:
                continue
            tpb = family.groups[gid].tokens_per_block
            got = cache.read_tokens(layer, [b for b, _ in mine], as_bytes=True)
            want = torch.cat([exp[p * tpb:(p + 1) * tpb] for _, p in mine])
            compared += want.numel()
            differ.append((got != want).sum())
    return compared, int(torch.stack(differ).sum()) if differ else 0
