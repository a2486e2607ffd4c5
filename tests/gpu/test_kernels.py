"""CUDA kernels vs the CPU transfer engine (itself tested against a pure-torch reference), for
every layout x dtype, several layer groups with different block sizes, other block ids, and
skipped leading blocks. Skipped cleanly without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from kvdepot.client.kvcache import KVGroupShape, ShmKVCache
from kvdepot.gpu.cpu_engine import CpuTransferEngine
from kvdepot.gpu.layout import group_layers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CHUNK = 64

# (name, groups, layouts): real shapes from tests/data/model_kv_shapes.json (layer counts cut
# down so every case stays small), dtypes as the models use them.
CASES = [
    ("llama8b-bf16", [KVGroupShape(0, 4, 8, 128, 16, torch.bfloat16)], "dense"),
    ("qwen7b-fp16", [KVGroupShape(0, 3, 4, 128, 16, torch.float16)], "dense"),
    ("llama70b-tp8-fp8", [KVGroupShape(0, 3, 1, 128, 16, torch.float8_e4m3fn)], "dense"),
    ("smollm2-bf16", [KVGroupShape(0, 5, 3, 64, 16, torch.bfloat16)], "dense"),
    ("gpt-oss-hybrid", [KVGroupShape(0, 2, 8, 64, 16, torch.bfloat16), KVGroupShape(1, 2, 8, 64, 32, torch.bfloat16)],
     "dense"),
    ("deepseek-mla-576", [KVGroupShape(0, 3, 1, 576, 16, torch.bfloat16, mla=True)], "mla"),
    ("fp8_ds_mla-656B", [KVGroupShape(0, 3, 1, 656, 16, torch.uint8, mla=True)], "mla"),
    ("dsv4-584B", [KVGroupShape(0, 2, 1, 584, 16, torch.uint8, mla=True)], "mla"),
    ("indexer-132B", [KVGroupShape(0, 2, 1, 132, 16, torch.uint8, mla=True)], "mla"),
]
DENSE_LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "flash_attn_nhd", "flash_attn_hnd", "flashinfer"]


def _params():
    for name, groups, kind in CASES:
        layouts = DENSE_LAYOUTS if kind == "dense" else ["mla"]
        for layout in layouts:
            if layout.startswith("BL") and len(groups) > 1:
                continue
            yield pytest.param(groups, layout, id=f"{name}-{layout}")


@pytest.fixture
def seed():
    s = random.randrange(1 << 30)
    print(f"seed={s}")
    return s


def _cache(groups, layout, num_blocks, seed):
    c = ShmKVCache(groups, num_blocks, layout)
    g = torch.Generator().manual_seed(seed)
    c.storage.copy_(torch.randint(0, 256, (c.size_bytes,), dtype=torch.uint8, generator=g))
    return c


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("groups,layout", list(_params()))
def test_gather_scatter_match_reference(groups, layout, use_kernels, seed):
    from kvdepot.gpu.cuda_engine import CudaTransferEngine

    if use_kernels:
        from kvdepot.gpu.kernels import load_kernels

        if load_kernels() is None:
            pytest.fail("kernel library could not be loaded or built")
    rng = random.Random(seed)
    num_blocks, num_chunks = 40, 3
    dev = torch.device("cuda")
    src = _cache(groups, layout, num_blocks, seed)
    dst = _cache(groups, layout, num_blocks, seed + 1)
    try:
        lay = group_layers(src.layer_specs(), src.group_specs(), CHUNK, [src.size_bytes])
        ids_src = [rng.sample(range(num_blocks), num_chunks * lay.blocks_per_chunk(g)) for g in range(len(groups))]
        ids_dst = [rng.sample(range(num_blocks), num_chunks * lay.blocks_per_chunk(g)) for g in range(len(groups))]
        # reference objects from the CPU engine
        cpu = CpuTransferEngine(lay, [src.storage])
        ref = torch.zeros(num_chunks * lay.object_bytes, dtype=torch.uint8)
        for j in range(num_chunks):
            cpu.gather(ref[j * lay.object_bytes:(j + 1) * lay.object_bytes],
                       [ids[j * lay.blocks_per_chunk(g):(j + 1) * lay.blocks_per_chunk(g)] for g, ids in enumerate(ids_src)])
        src_dev = src.storage.to(dev)
        dst_dev = dst.storage.to(dev)
        stream = torch.cuda.Stream()
        eng = CudaTransferEngine(lay, [src_dev.data_ptr()], [src.size_bytes], dev, use_kernels=use_kernels)
        staging = torch.full((num_chunks * lay.object_bytes,), 0xA5, dtype=torch.uint8, device=dev)
        stream.wait_stream(torch.cuda.current_stream())  # the fill and the caches' uploads ran there
        eng.copy(staging, ids_src, num_chunks, True, stream)
        stream.synchronize()
        assert torch.equal(staging.cpu(), ref)

        # scatter into another cache (other block ids), skipping the first two blocks' tokens
        skip = 2 * max(g.tokens_per_block for g in groups)
        before = dst_dev.clone()
        eng_dst = CudaTransferEngine(lay, [dst_dev.data_ptr()], [dst.size_bytes], dev, use_kernels=use_kernels)
        eng_dst.copy(staging, ids_dst, num_chunks, False, stream, skip_tokens=skip)
        stream.synchronize()
        expect = dst.storage.clone()
        cpu_dst = CpuTransferEngine(lay, [expect])
        for j in range(num_chunks):
            cpu_dst.scatter(ref[j * lay.object_bytes:(j + 1) * lay.object_bytes],
                            [ids[j * lay.blocks_per_chunk(g):(j + 1) * lay.blocks_per_chunk(g)]
                             for g, ids in enumerate(ids_dst)], skip_tokens=skip if j == 0 else 0)
        got = dst_dev.cpu()
        assert torch.equal(got, expect)
        # the skipped leading blocks kept their old bytes, and the rest changed
        skipped = {(li, b): dst.token_view(li, as_bytes=True)[b].clone()
                   for li, gid in enumerate(dst.layer_gids)
                   for b in ids_dst[gid][: skip // groups[gid].tokens_per_block]}
        assert skipped
        dst.storage.copy_(got)
        for (li, b), old in skipped.items():
            assert torch.equal(dst.token_view(li, as_bytes=True)[b], old)
        assert not torch.equal(got, before.cpu())
    finally:
        src.close()
        dst.close()
