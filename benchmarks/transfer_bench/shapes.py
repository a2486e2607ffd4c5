"""Model shards' KV-cache shapes the benchmark runs (tests/data/model_kv_shapes.json)."""

from __future__ import annotations

import dataclasses

import torch

from kvdepot.client.kvcache import KVGroupShape


def say(*args) -> None:
    print(*args, flush=True)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One model shard's KV cache (from tests/data/model_kv_shapes.json)."""

    name: str
    groups: tuple[KVGroupShape, ...]
    layout: str
    shard: str

    @property
    def token_bytes(self) -> int:
        """Object bytes of one token (all layers of all groups)."""
        return sum(g.num_layers * g.token_bytes for g in self.groups)


BF16 = torch.bfloat16
SHAPES = [
    Shape("Llama-3.1-8B TP1", (KVGroupShape(0, 32, 8, 128, 16, BF16),), "LBNHC", "tp0of1"),
    Shape("Llama-3.1-70B TP4", (KVGroupShape(0, 80, 2, 128, 16, BF16),), "LBNHC", "tp0of4"),
    Shape("Llama-3.1-70B TP8", (KVGroupShape(0, 80, 1, 128, 16, BF16),), "LBNHC", "tp0of8"),
    Shape("DeepSeek-V3 MLA", (KVGroupShape(0, 61, 1, 576, 16, BF16, mla=True),), "mla", "replicated"),
    # 12 full + 12 sliding-window layers as two KV-cache groups with different block sizes
    Shape("gpt-oss-20b hybrid", (KVGroupShape(0, 12, 8, 64, 16, BF16), KVGroupShape(1, 12, 8, 64, 32, BF16)),
          "LBNHC", "tp0of1"),
]


def chunks_for(shape: Shape, chunk_size: int, bytes_per_point: float, outstanding: int) -> int:
    """Chunks per stream measurement: about ``bytes_per_point``, at least 2 per thread, at most 512."""
    ob = shape.token_bytes * chunk_size
    return max(2 * outstanding, min(512, int(bytes_per_point // ob)))

