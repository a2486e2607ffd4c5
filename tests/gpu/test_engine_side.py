"""The engine process's own gather / scatter (`kvd_engine_gather` / `kvd_engine_scatter`, the
kernels of engine-side staging) against the CPU transfer engine: every group of a request in
fused launches (one launch for all groups, up to 800 block slots per launch, a launch's slots
crossing from one group into the next), groups of different block sizes, layer counts, dtypes
and copy widths (a 132-byte indexer row forces 4-byte words on every group of the launch),
skipped leading tokens and vLLM's null block (-1) in a scatter, and the fence word written
after the gather and after the scatter (one word per request after a gather of several
requests' regions, `kvd_engine_gather_pieces`). Skipped cleanly without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from kvdepot.client.kvcache import KVGroupShape
from kvdepot.gpu.cpu_engine import CpuTransferEngine
from kvdepot.gpu.layout import group_layers
from test_kernels import _cache  # a random-filled shared-memory KV cache
from test_native_path import _chunk_ids  # one chunk's block ids per group

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CHUNK = 64
# (name, groups, layout, chunks): 150 chunks of the hybrid cases are 600 + 300 (+ 150) block
# slots, so the first fused launch (800 slots) ends inside the second group
CASES = [
    ("dense-one-group", [KVGroupShape(0, 3, 2, 64, 16, torch.bfloat16)], "LBNHC", 5),
    ("gpt-oss-hybrid", [KVGroupShape(0, 2, 2, 64, 16, torch.bfloat16), KVGroupShape(1, 2, 2, 64, 32, torch.bfloat16)],
     "LBNHC", 150),
    ("three-groups-HND", [KVGroupShape(0, 2, 2, 64, 16, torch.bfloat16), KVGroupShape(1, 3, 2, 64, 32, torch.bfloat16),
                          KVGroupShape(2, 1, 1, 64, 64, torch.float16)], "LBHNC", 150),
    ("hybrid-with-132B-rows", [KVGroupShape(0, 2, 1, 132, 16, torch.uint8, mla=True),
                               KVGroupShape(1, 1, 1, 576, 32, torch.bfloat16, mla=True)], "mla", 40),
]


def _objects(cpu, lay, ids, n):
    ref = torch.zeros(n * lay.object_bytes, dtype=torch.uint8)
    for j in range(n):
        cpu.gather(ref[j * lay.object_bytes:(j + 1) * lay.object_bytes], _chunk_ids(lay, ids, j))
    return ref


@pytest.mark.parametrize("groups,layout,nchunks", [pytest.param(g, lay, n, id=name) for name, g, lay, n in CASES])
def test_engine_gather_and_scatter_of_every_group_match_the_cpu_engine(groups, layout, nchunks):
    import array

    from kvdepot.gpu.kernels import KvdGroupDesc, load_kernels

    kernels = load_kernels()
    if kernels is None:
        pytest.fail("kernel library could not be loaded or built")
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    dev = torch.device("cuda")
    num_blocks = nchunks * CHUNK // min(g.tokens_per_block for g in groups) + 8
    src = _cache(groups, layout, num_blocks, seed)
    dst = _cache(groups, layout, num_blocks, seed + 1)
    handles = []
    try:
        lay = group_layers(src.layer_specs(), src.group_specs(), CHUNK, [src.size_bytes])
        ngroups = len(groups)
        ids_src = [rng.sample(range(num_blocks), nchunks * lay.blocks_per_chunk(g)) for g in range(ngroups)]
        ids_dst = [rng.sample(range(num_blocks), nchunks * lay.blocks_per_chunk(g)) for g in range(ngroups)]
        ref = _objects(CpuTransferEngine(lay, [src.storage]), lay, ids_src, nchunks)

        def engine(storage):
            descs = [KvdGroupDesc.from_group(g, lay.object_bytes, lay.chunk_size) for g in lay.groups]
            ptrs = [[storage.data_ptr() + off for _, off in g.offsets] for g in lay.groups]
            h = kernels.engine_create(dev.index or 0, descs, ptrs, lay.chunk_size, lay.object_bytes)
            handles.append(h)
            return h

        src_dev, dst_dev = src.storage.to(dev), dst.storage.to(dev)
        stream = torch.cuda.Stream()
        ring = torch.full((nchunks * lay.object_bytes + 256,), 0xA5, dtype=torch.uint8, device=dev)
        base = (ring.data_ptr() + 255) // 256 * 256
        off = base - ring.data_ptr()
        word = torch.zeros(1, dtype=torch.int64, device=dev)
        flat = array.array("i", [b for g_ids in ids_src for b in g_ids])
        kernels.engine_gather(engine(src_dev), flat, nchunks, base, stream.cuda_stream, word.data_ptr(), 77)
        stream.synchronize()
        assert torch.equal(ring[off:off + nchunks * lay.object_bytes].cpu(), ref)
        assert word.item() == 77
        # the same chunks as three requests' regions, the first two end to end, the third
        # elsewhere: one call (two launches), then each request's word (`kvd_engine_gather_pieces`)
        ring.fill_(0x5A)
        words = torch.zeros(3, dtype=torch.int64, device=dev)
        n1, n2 = nchunks // 3, nchunks // 3
        n3 = nchunks - n1 - n2
        ob = lay.object_bytes
        other = torch.full((n3 * ob + 256,), 0x5A, dtype=torch.uint8, device=dev)
        other_base = (other.data_ptr() + 255) // 256 * 256
        kernels.engine_gather_pieces(handles[0], flat, array.array("Q", [base, base + n1 * ob, other_base]),
                                     array.array("q", [n1, n2, n3]),
                                     array.array("Q", [words.data_ptr() + 8 * q for q in range(3)]),
                                     array.array("Q", [5, 6, 7]), stream.cuda_stream)
        stream.synchronize()
        o = other_base - other.data_ptr()
        assert torch.equal(ring[off:off + (n1 + n2) * ob].cpu(), ref[:(n1 + n2) * ob])
        assert torch.equal(other[o:o + n3 * ob].cpu(), ref[(n1 + n2) * ob:])
        assert words.tolist() == [5, 6, 7]
        ring[off + (n1 + n2) * ob:off + nchunks * ob] = other[o:o + n3 * ob]  # the whole request for the scatter

        # scatter the leading nchunks - 1 chunks into other blocks, skipping the first two of
        # the largest block size's tokens; one block of the last group is the null block (-1)
        skip = 2 * max(g.tokens_per_block for g in groups)
        n_in = nchunks - 1
        last = ngroups - 1
        null_slot = lay.blocks_per_chunk(last) * (n_in - 1)  # in the last chunk scattered, past the skip
        ids_scatter = [list(x) for x in ids_dst]
        kept_block = ids_scatter[last][null_slot]
        ids_scatter[last][null_slot] = -1
        flat = array.array("i", [b for g_ids in ids_scatter for b in g_ids])
        kernels.engine_scatter(engine(dst_dev), flat, nchunks, n_in, base, skip, stream.cuda_stream,
                               word.data_ptr(), 78)
        stream.synchronize()
        assert word.item() == 78
        expect = dst.storage.clone()
        cpu_dst = CpuTransferEngine(lay, [expect])
        for j in range(n_in):
            left = skip - j * CHUNK  # tokens of this chunk still skipped (a 64-token block skips two chunks)
            if left >= CHUNK:
                continue
            cpu_dst.scatter(ref[j * lay.object_bytes:(j + 1) * lay.object_bytes], _chunk_ids(lay, ids_scatter, j),
                            skip_tokens=max(0, left))
        got = dst_dev.cpu()
        assert torch.equal(got, expect)  # the CPU engine leaves a -1 slot alone too
        # ... and the null slot's would-be block kept its bytes
        dst.storage.copy_(got)
        orig = _cache(groups, layout, num_blocks, seed + 1)
        try:
            checked = 0
            for li, gid in enumerate(dst.layer_gids):
                if gid == last:
                    assert torch.equal(dst.token_view(li, as_bytes=True)[kept_block],
                                       orig.token_view(li, as_bytes=True)[kept_block])
                    checked += 1
            assert checked
        finally:
            orig.close()
    finally:
        for h in handles:
            kernels.engine_destroy(h)
        src.close()
        dst.close()
