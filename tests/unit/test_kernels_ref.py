"""The torch reference of the CUDA kernels (`copy_blocks_torch`, also the no-nvcc fallback)
agrees with the CPU transfer engine on CPU tensors, for several layouts and a hybrid model."""

import random

import pytest
import torch

from kvdepot.client.kvcache import KVGroupShape, ShmKVCache
from kvdepot.gpu.cpu_engine import CpuTransferEngine
from kvdepot.gpu.kernels import KvdGroupDesc, copy_blocks_torch
from kvdepot.gpu.layout import group_layers

CHUNK = 64


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "flash_attn_hnd", "flashinfer"])
def test_copy_blocks_torch_matches_cpu_engine(layout):
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    groups = [KVGroupShape(0, 2, 4, 32, 16, torch.bfloat16), KVGroupShape(1, 2, 4, 32, 32, torch.bfloat16)]
    c = ShmKVCache(groups, 24, layout)
    try:
        c.storage.copy_(torch.randint(0, 256, (c.size_bytes,), dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(seed)))
        lay = group_layers(c.layer_specs(), c.group_specs(), CHUNK, [c.size_bytes])
        n = 2
        ids = [rng.sample(range(24), n * lay.blocks_per_chunk(g)) for g in range(2)]
        ref = torch.zeros(n * lay.object_bytes, dtype=torch.uint8)
        cpu = CpuTransferEngine(lay, [c.storage])
        for j in range(n):
            cpu.gather(ref[j * lay.object_bytes:(j + 1) * lay.object_bytes],
                       [x[j * lay.blocks_per_chunk(g):(j + 1) * lay.blocks_per_chunk(g)] for g, x in enumerate(ids)])
        got = torch.zeros_like(ref)
        for g in lay.groups:
            layers = [c.storage[off:] for _, off in g.offsets]
            bpc = CHUNK // g.view.block_size
            copy_blocks_torch(g, layers, ids[g.gid], 0, n * bpc, got, lay.object_bytes, CHUNK, True)
            d = KvdGroupDesc.from_group(g, lay.object_bytes, CHUNK)
            assert (d.num_layers, d.blocks_per_chunk, d.object_offset) == (2, bpc, g.object_offset)
        assert torch.equal(got, ref)
    finally:
        c.close()
