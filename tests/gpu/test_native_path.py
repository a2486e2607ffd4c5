"""The daemon's whole-request CUDA calls (`kvd_store` / `kvd_retrieve` through
`CudaDevicePath`) against the CPU transfer engine: several batches through two staging slots,
one or two chunks per batch, whole chunks and chunks moved in pieces (finest: one block of
every group per piece; two pieces; skipped leading tokens inside and across pieces), a store
of non-contiguous chunks of a request, a retrieve of fewer chunks than the request has with
skipped leading blocks, the completion note through the pipe, and errors reported without
anything left running. Skipped cleanly without CUDA."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from kvdepot.client.kvcache import KVGroupShape
from kvdepot.gpu.cpu_engine import CpuTransferEngine
from kvdepot.gpu.layout import group_layers
from test_kernels import _cache  # a random-filled shared-memory KV cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CHUNK = 64
CASES = [
    ("llama8b-bf16-LBNHC", [KVGroupShape(0, 4, 8, 128, 16, torch.bfloat16)], "LBNHC"),
    ("hybrid-LBHNC", [KVGroupShape(0, 2, 8, 64, 16, torch.bfloat16), KVGroupShape(1, 3, 8, 64, 32, torch.bfloat16)],
     "LBHNC"),
    ("hybrid-flashinfer", [KVGroupShape(0, 2, 4, 64, 16, torch.float16), KVGroupShape(1, 2, 4, 64, 32, torch.float16)],
     "flashinfer"),
    ("fp8_ds_mla-656B", [KVGroupShape(0, 3, 1, 656, 16, torch.uint8, mla=True)], "mla"),
    ("indexer-132B", [KVGroupShape(0, 2, 1, 132, 16, torch.uint8, mla=True)], "mla"),
]


def _chunk_ids(lay, ids, j):
    return [g_ids[j * lay.blocks_per_chunk(g):(j + 1) * lay.blocks_per_chunk(g)] for g, g_ids in enumerate(ids)]


@pytest.fixture
def runtime():
    from kvdepot.gpu.cuda_path import CompletionPipe, CudaDevicePath
    from kvdepot.gpu.kernels import load_kernels

    kernels = load_kernels()
    if kernels is None:
        pytest.fail("kernel library could not be loaded or built")
    loop = asyncio.new_event_loop()
    pipe = CompletionPipe(loop)
    paths = []

    def make_path(batch_bytes):
        p = CudaDevicePath(torch.cuda.current_device(), kernels, pipe, batch_bytes)
        paths.append(p)
        return p

    yield kernels, loop, make_path
    for p in paths:
        p.close()
    pipe.close()
    loop.close()


def _run(loop, start):
    """Call ``start(done)`` and run the loop until ``done(err)`` fired; returns err."""
    fut = loop.create_future()
    start(lambda err: fut.set_result(err))
    return loop.run_until_complete(asyncio.wait_for(fut, 30))


@pytest.mark.parametrize("pieces,skip_blocks,per_slot", [("whole", 2, 1), ("finest", 2, 2), ("two", 1, 1)],
                         ids=["whole-skip2-1perbatch", "finest-skip2-2perbatch", "two-skip1-1perbatch"])
@pytest.mark.parametrize("groups,layout", [pytest.param(g, lay, id=n) for n, g, lay in CASES])
def test_store_and_retrieve_whole_requests(runtime, groups, layout, pieces, skip_blocks, per_slot):
    from kvdepot.gpu.cuda_path import NativeEngine

    kernels, loop, make_path = runtime
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    num_blocks, total = 48, 4
    dev = torch.device("cuda")
    src = _cache(groups, layout, num_blocks, seed)
    dst = _cache(groups, layout, num_blocks, seed + 1)
    try:
        lay = group_layers(src.layer_specs(), src.group_specs(), CHUNK, [src.size_bytes])
        ob = lay.object_bytes
        # slots of 1.5 (2.5) objects: one (two) chunks per batch, cycling through both slots
        path = make_path(ob * (2 * per_slot + 1) // 2)
        ids_src = [rng.sample(range(num_blocks), total * lay.blocks_per_chunk(g)) for g in range(len(groups))]
        ids_dst = [rng.sample(range(num_blocks), total * lay.blocks_per_chunk(g)) for g in range(len(groups))]
        cpu = CpuTransferEngine(lay, [src.storage])
        ref = torch.zeros(total, ob, dtype=torch.uint8)
        for j in range(total):
            cpu.gather(ref[j], _chunk_ids(lay, ids_src, j))

        src_dev = src.storage.to(dev)
        dst_dev = dst.storage.to(dev)
        torch.cuda.synchronize()
        eng_src = NativeEngine(kernels, dev.index or 0, lay, [src_dev.data_ptr()])
        eng_dst = NativeEngine(kernels, dev.index or 0, lay, [dst_dev.data_ptr()])
        lcm = max(g.tokens_per_block for g in groups)  # the block sizes here divide each other
        want = {"whole": (0, 1), "finest": (1, CHUNK // lcm), "two": (ob // 2 + 1, 2)}[pieces]
        for e in (eng_src, eng_dst):
            assert kernels.engine_set_piece_bytes(e.handle, want[0]) == want[1]
        host = torch.full((3, ob), 0x5A, dtype=torch.uint8).pin_memory()
        chunks = [3, 0, 2]  # not contiguous, not in order
        err = _run(loop, lambda done: path.store(eng_src, ids_src, total, chunks,
                                                 [host[k].data_ptr() for k in range(3)], done))
        assert err is None
        for k, j in enumerate(chunks):
            assert torch.equal(host[k], ref[j]), f"object {k} (chunk {j})"

        # retrieve chunks 0..2 of a 4-chunk request (chunk 3 missed), skipping two blocks' tokens
        skip = skip_blocks * lcm  # with two pieces of 32 tokens, skip1 (16 tokens) cuts the first
        objs = ref[:3].clone().pin_memory()
        event, _handle = kernels.event_create_ipc(dev.index or 0)
        try:
            err = _run(loop, lambda done: path.retrieve(eng_dst, ids_dst, total,
                                                        [objs[j].data_ptr() for j in range(3)], skip, event, done))
        finally:
            kernels.event_destroy(event)
        assert err is None
        expect = dst.storage.clone()
        cpu_dst = CpuTransferEngine(lay, [expect])
        for j in range(3):
            cpu_dst.scatter(objs[j], _chunk_ids(lay, ids_dst, j), skip_tokens=skip if j == 0 else 0)
        got = dst_dev.cpu()
        assert torch.equal(got, expect)  # also: chunk 3's blocks and the skipped blocks untouched
        assert not torch.equal(got, dst.storage)
        eng_src.close()
        eng_dst.close()
    finally:
        src.close()
        dst.close()


def test_errors_are_reported_not_raised_and_leave_the_lane_usable(runtime):
    from kvdepot.gpu.cuda_path import NativeEngine
    from kvdepot.gpu.kernels import KernelError

    kernels, loop, make_path = runtime
    groups = [KVGroupShape(0, 2, 2, 64, 16, torch.bfloat16)]
    src = _cache(groups, "LBNHC", 8, 1)
    try:
        lay = group_layers(src.layer_specs(), src.group_specs(), CHUNK, [src.size_bytes])
        path = make_path(4 * lay.object_bytes)
        src_dev = src.storage.cuda()
        eng = NativeEngine(kernels, torch.cuda.current_device(), lay, [src_dev.data_ptr()])
        host = torch.zeros(2, lay.object_bytes, dtype=torch.uint8).pin_memory()
        ids = [list(range(4))]
        # chunk index 5 of a 1-chunk request: refused before anything is enqueued
        err = _run(loop, lambda done: path.store(eng, ids, 1, [5], [host[0].data_ptr()], done))
        assert isinstance(err, KernelError) and "invalid" in str(err)
        # the lane still works
        err = _run(loop, lambda done: path.store(eng, ids, 1, [0], [host[1].data_ptr()], done))
        assert err is None
        ref = torch.zeros(lay.object_bytes, dtype=torch.uint8)
        CpuTransferEngine(lay, [src.storage]).gather(ref, ids)
        assert torch.equal(host[1], ref)
        eng.close()
        with pytest.raises(KernelError):  # chunk size not a multiple of the block size
            from kvdepot.gpu.kernels import KvdGroupDesc

            d = KvdGroupDesc.from_group(lay.groups[0], lay.object_bytes, lay.chunk_size)
            kernels.engine_create(torch.cuda.current_device(), [d], [[src_dev.data_ptr()] * 2], 40, lay.object_bytes)
        with pytest.raises(KernelError):
            kernels.event_open_ipc(b"\0" * 3, 0)
    finally:
        src.close()
