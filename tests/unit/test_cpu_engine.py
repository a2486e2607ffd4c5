"""kvdepot.gpu.cpu_engine: gather / scatter against a pure-torch reference of the canonical
object format.

Reference (kvdepot.gpu.layout module docstring)::

    object = group_0 | group_1 | ...            groups in gid order
    group  = [chunk_size, num_layers, H, KV, row_bytes] C-order bytes (token-major)

The reference reads each layer through the engine's own tensor (`ShmKVCache.engine_tensors`,
indexed the way the engine indexes it), never through `LayerView`, so it checks the layout
code as well as the copies. Engine memory is filled with random bytes (bf16 / fp16 / fp8 are
copied as bytes: NaN patterns included), comparisons are bit-exact.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvdepot.client.kvcache import ALL_LAYOUTS, VLLM_ORDERS
from kvdepot.gpu.cpu_engine import CpuTransferEngine, block_runs
from kvdepot.gpu.layout import dtype_name, group_layers
from kvdepot.protocol.messages import KVGroupSpec, LayerSpec

DENSE_LAYOUTS = [lay for lay in ALL_LAYOUTS if lay != "mla"]
DENSE_DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn]
SENTINEL = 0xA5


# --------------------------------------------------------------------------- reference


def logical_rows(layout: str, et: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's bytes as ``[num_blocks, N, H, KV, row_bytes]`` uint8, a view of the engine
    tensor ``et`` (or of the same-shaped tensor over ``base``, a same-sized byte buffer)."""
    if base is not None:
        words = base.view(et.dtype)
        et = torch.as_strided(words, et.shape, et.stride(), et.storage_offset())
    b = et.view(torch.uint8)  # last dim scaled to bytes
    if layout in VLLM_ORDERS:  # [NB, H, N, C], C = K row | V row
        return b.permute(0, 2, 1, 3).unflatten(-1, (2, b.shape[-1] // 2))
    if layout.startswith("flash_attn"):  # (2, NB, N, H, D)
        return b.permute(1, 2, 3, 0, 4)
    if layout == "flashinfer":  # (NB, 2, N, H, D)
        return b.permute(0, 2, 3, 1, 4)
    assert layout == "mla"  # (NB, N, R)
    return b[:, :, None, None, :]


def reference_object(cache, block_ids: list[list[int]], base: torch.Tensor | None = None) -> torch.Tensor:
    """Canonical object of one chunk: per gid, [T, L, H, KV, row] token-major, gids in order."""
    parts = []
    for gid in range(len(cache.groups)):
        layers = [li for li, g in enumerate(cache.layer_gids) if g == gid]
        per_layer = []
        for li in layers:
            rows = logical_rows(cache.layout, cache.engine_tensors[li], base)[block_ids[gid]]
            per_layer.append(rows.reshape(-1, *rows.shape[2:]))  # [T, H, KV, row]
        parts.append(torch.stack(per_layer, dim=1).reshape(-1))
    return torch.cat(parts)


def reference_scatter(cache, base: torch.Tensor, obj: torch.Tensor, block_ids: list[list[int]],
                      skip_tokens: int = 0) -> None:
    """Write ``obj`` into the blocks of ``base`` (a copy of the cache's storage), skipping the
    blocks of the first ``skip_tokens`` tokens."""
    off = 0
    for gid, g in enumerate(cache.groups):
        layers = [li for li, lg in enumerate(cache.layer_gids) if lg == gid]
        nblk, n = len(block_ids[gid]), g.tokens_per_block
        ref_rows = [logical_rows(cache.layout, cache.engine_tensors[li], base) for li in layers]
        h, kv, row = ref_rows[0].shape[2:]
        size = nblk * n * len(layers) * h * kv * row
        grp = obj[off:off + size].view(nblk, n, len(layers), h, kv, row)
        off += size
        for i, b in enumerate(block_ids[gid]):
            if i * n < skip_tokens:
                continue
            for j, rows in enumerate(ref_rows):
                rows[b].copy_(grp[i, :, j])
    assert off == obj.numel()


def fill_random(t: torch.Tensor, rng: torch.Generator) -> None:
    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=rng))


def engine_for(cache, chunk_size: int) -> CpuTransferEngine:
    layout = group_layers(cache.layer_specs(), cache.group_specs(), chunk_size, [cache.size_bytes])
    return CpuTransferEngine(layout, [cache.storage])


def random_block_ids(cache, chunk_size: int, rng: random.Random) -> list[list[int]]:
    """Per gid, distinct block ids in a random (non-consecutive) order."""
    return [rng.sample(range(cache.num_blocks[g.gid]), chunk_size // g.tokens_per_block) for g in cache.groups]


def new_object(engine: CpuTransferEngine) -> torch.Tensor:
    return torch.full((engine.layout.object_bytes,), SENTINEL, dtype=torch.uint8)


# --------------------------------------------------------------------------- block_runs


@pytest.mark.parametrize("ids,runs", [
    ([], []),
    ([7], [(0, 7, 1)]),
    ([4, 5, 6, 9], [(0, 4, 3), (3, 9, 1)]),
    ([0, 1, 2, 3], [(0, 0, 4)]),
    ([3, 2, 1], [(0, 3, 1), (1, 2, 1), (2, 1, 1)]),
    ([5, 5, 6], [(0, 5, 1), (1, 5, 2)]),
    ([9, 1, 2, 8, 9, 10, 0], [(0, 9, 1), (1, 1, 2), (3, 8, 3), (6, 0, 1)]),
    ([-1, 0, 1, -1], [(1, 0, 2)]),  # -1: left alone (a retrieve's null block)
    ([-1, -1], []),
    ([3, -1, 4, 5], [(0, 3, 1), (2, 4, 2)]),
])
def test_block_runs(ids, runs):
    assert block_runs(ids) == runs


def test_block_runs_partition_the_list(seed):
    rng = random.Random(seed)
    for _ in range(200):
        ids = [rng.randrange(12) for _ in range(rng.randrange(10))]
        runs = block_runs(ids)
        rebuilt = [b0 + j for _, b0, k in runs for j in range(k)]
        assert rebuilt == ids
        assert [i for i, _, _ in runs] == [sum(k for _, _, k in runs[:r]) for r in range(len(runs))]
        for (_, a, k), (_, b, _) in zip(runs, runs[1:]):
            assert b != a + k, "adjacent runs must not be mergeable"


# --------------------------------------------------------------------------- gather / scatter


def _gather_scatter_round(cache, chunk_size, seed, torch_rng, shm_kv_cache):
    rng = random.Random(seed)
    fill_random(cache.storage, torch_rng)
    eng = engine_for(cache, chunk_size)
    ids = random_block_ids(cache, chunk_size, rng)
    obj = new_object(eng)
    eng.gather(obj, ids)
    expected = reference_object(cache, ids)
    assert obj.numel() == expected.numel() == eng.layout.object_bytes
    assert torch.equal(obj, expected)

    # scatter into another cache of the same layout, at other blocks: exactly those blocks change
    dst = shm_kv_cache(cache.groups, cache.num_blocks, cache.layout)
    dst.storage.fill_(SENTINEL)
    dst_ids = random_block_ids(dst, chunk_size, rng)
    want = dst.storage.clone()
    reference_scatter(dst, want, obj, dst_ids)
    engine_for(dst, chunk_size).scatter(obj, dst_ids)
    assert torch.equal(dst.storage, want)
    assert torch.equal(reference_object(dst, dst_ids), obj)


@pytest.mark.parametrize("dtype", DENSE_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_gather_scatter_dense(layout, dtype, model_groups, shm_kv_cache, seed, torch_rng):
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
    cache = shm_kv_cache(model_groups("SmolLM2-135M", dtype), 12, layout)
    _gather_scatter_round(cache, 64, seed, torch_rng, shm_kv_cache)


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC", "flash_attn_hnd"])
def test_gather_scatter_llama(layout, model_groups, shm_kv_cache, seed, torch_rng):
    cache = shm_kv_cache(model_groups("Llama-3.1-8B"), 6, layout)
    _gather_scatter_round(cache, 64, seed, torch_rng, shm_kv_cache)


@pytest.mark.parametrize("model,row_key,num_layers", [
    ("DeepSeek-V3 (MLA)", "row_bytes", None),          # 61 layers x 576 bf16
    ("DeepSeek-V3.2 fp8_ds_mla", "row_bytes", None),   # 61 layers x 656 B packed
    ("DeepSeek-V4", "row_bytes", 8),                   # 584 B packed (layer count not in the data)
    ("DeepSeek-V3.2 fp8_ds_mla", "indexer_row_bytes", None),  # 132 B int8 indexer rows
], ids=["mla576-bf16", "fp8_ds_mla-656B", "dsv4-584B", "indexer-132B"])
def test_gather_scatter_mla(model, row_key, num_layers, model_groups, shm_kv_cache, seed, torch_rng):
    groups = model_groups(model, tokens_per_block=(16,), num_layers=num_layers, row_key=row_key)
    cache = shm_kv_cache(groups, 6, "mla")
    _gather_scatter_round(cache, 64, seed, torch_rng, shm_kv_cache)


@pytest.mark.parametrize("model", ["Gemma-2-2B", "gpt-oss-20b"])
@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_gather_scatter_hybrid(model, layout, model_groups, shm_kv_cache, seed, torch_rng):
    """Two KV-cache groups with 16- and 32-token blocks (full / sliding attention)."""
    groups = model_groups(model, tokens_per_block=(16, 32))
    cache = shm_kv_cache(groups, [6, 3], layout)
    _gather_scatter_round(cache, 64, seed, torch_rng, shm_kv_cache)


@pytest.mark.parametrize("src_layout,dst_layout", [
    ("LBNHC", "LBHNC"), ("flash_attn_nhd", "flash_attn_hnd"), ("LBNHC", "flash_attn_hnd"),
    ("BLHNC", "flashinfer"), ("flash_attn_hnd", "BLNHC"),
])
def test_nhd_to_hnd_round_trip(src_layout, dst_layout, model_groups, shm_kv_cache, torch_rng):
    """What an NHD engine stored, an HND engine of the same model retrieves bit-exactly, into
    different, non-consecutive block ids."""
    groups = model_groups("Qwen2.5-7B")  # 28 layers, 4 KV heads, head_dim 128
    src = shm_kv_cache(groups, 10, src_layout)
    dst = shm_kv_cache(groups, 10, dst_layout)
    fill_random(src.storage, torch_rng)
    dst.storage.fill_(SENTINEL)
    src_eng, dst_eng = engine_for(src, 64), engine_for(dst, 64)
    assert src_eng.layout.fingerprint == dst_eng.layout.fingerprint
    src_ids, dst_ids = [[3, 4, 5, 6]], [[9, 0, 7, 2]]
    obj = new_object(src_eng)
    src_eng.gather(obj, src_ids)
    dst_eng.scatter(obj, dst_ids)
    for li in range(len(src.layer_names)):
        a = logical_rows(src.layout, src.engine_tensors[li])[src_ids[0]]
        b = logical_rows(dst.layout, dst.engine_tensors[li])[dst_ids[0]]
        assert torch.equal(a, b), li
    # blocks not named are untouched
    for li in (0, len(dst.layer_names) - 1):
        rest = logical_rows(dst.layout, dst.engine_tensors[li])[[1, 3, 4, 5, 6, 8]]
        assert bool((rest == SENTINEL).all())
    back = new_object(dst_eng)
    dst_eng.gather(back, dst_ids)
    assert torch.equal(back, obj)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC", "flash_attn_hnd", "flashinfer"])
@pytest.mark.parametrize("skip_tokens", [0, 32, 64])
def test_scatter_skip_tokens(layout, skip_tokens, model_groups, shm_kv_cache, seed, torch_rng):
    """Blocks of the first ``skip_tokens`` tokens keep the engine's bytes; the rest are written.
    gpt-oss-20b with 16- and 32-token blocks: skipping 32 tokens skips 2 blocks of gid 0 and 1
    of gid 1."""
    rng = random.Random(seed)
    cache = shm_kv_cache(model_groups("gpt-oss-20b", tokens_per_block=(16, 32)), [8, 4], layout)
    eng = engine_for(cache, 64)
    obj = torch.randint(0, 256, (eng.layout.object_bytes,), dtype=torch.uint8, generator=torch_rng)
    obj[obj == SENTINEL] = 0  # no object byte looks like an untouched engine byte
    cache.storage.fill_(SENTINEL)
    ids = random_block_ids(cache, 64, rng)
    want = cache.storage.clone()
    reference_scatter(cache, want, obj, ids, skip_tokens)
    eng.scatter(obj, ids, skip_tokens=skip_tokens)
    assert torch.equal(cache.storage, want)
    for gid, g in enumerate(cache.groups):
        skipped = ids[gid][: skip_tokens // g.tokens_per_block]
        written = ids[gid][skip_tokens // g.tokens_per_block:]
        for li in (i for i, lg in enumerate(cache.layer_gids) if lg == gid):
            rows = logical_rows(cache.layout, cache.engine_tensors[li])
            assert bool((rows[skipped] == SENTINEL).all())
            assert not bool((rows[written] == SENTINEL).any())
    # the object's suffix after the skipped tokens is what the written blocks now hold
    got = reference_object(cache, ids)
    for gid, g in enumerate(cache.groups):
        start = eng.layout.groups[gid].object_offset
        per_token = eng.layout.groups[gid].bytes_per_token
        sl = slice(start + skip_tokens * per_token, start + 64 * per_token)
        assert torch.equal(got[sl], obj[sl])


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_scatter_leaves_blocks_of_id_minus_one_alone(layout, model_groups, shm_kv_cache, seed, torch_rng):
    """A retrieve's block id -1 (vLLM's null block in a sliding-window group) is never written;
    every other block gets exactly what it gets without the -1."""
    rng = random.Random(seed)
    cache = shm_kv_cache(model_groups("gpt-oss-20b", tokens_per_block=(16, 32)), [8, 4], layout)
    eng = engine_for(cache, 64)
    obj = torch.randint(0, 256, (eng.layout.object_bytes,), dtype=torch.uint8, generator=torch_rng)
    obj[obj == SENTINEL] = 0
    ids = random_block_ids(cache, 64, rng)
    hole = ids[1][0]  # the sliding-window group's first block of the chunk
    gid1_layers = [li for li, lg in enumerate(cache.layer_gids) if lg == 1]
    cache.storage.fill_(SENTINEL)
    eng.scatter(obj, [list(ids[0]), [-1] + list(ids[1][1:])])
    for li in gid1_layers:
        assert bool((logical_rows(cache.layout, cache.engine_tensors[li])[hole] == SENTINEL).all())
    holed = cache.storage.clone()
    cache.storage.fill_(SENTINEL)
    eng.scatter(obj, ids)
    for li in gid1_layers:
        rows = logical_rows(cache.layout, cache.engine_tensors[li])
        assert not bool((rows[hole] == SENTINEL).all())
        rows[hole] = SENTINEL
    assert torch.equal(cache.storage, holed)


def test_gather_into_arena_slice(model_groups, shm_kv_cache, torch_rng):
    """Objects live at aligned offsets inside one host arena; neighbours are not touched."""
    cache = shm_kv_cache(model_groups("SmolLM2-135M"), 8, "LBNHC")
    fill_random(cache.storage, torch_rng)
    eng = engine_for(cache, 32)
    n = eng.layout.object_bytes
    arena = torch.full((3 * 4096 + 2 * n,), SENTINEL, dtype=torch.uint8)
    obj = arena[4096 : 4096 + n]
    eng.gather(obj, [[6, 7]])
    assert torch.equal(obj, reference_object(cache, [[6, 7]]))
    assert bool((arena[:4096] == SENTINEL).all()) and bool((arena[4096 + n:] == SENTINEL).all())


def test_gather_rejects_wrong_object_size(model_groups, shm_kv_cache):
    cache = shm_kv_cache(model_groups("SmolLM2-135M"), 4, "LBNHC")
    eng = engine_for(cache, 32)
    with pytest.raises(AssertionError):
        eng.gather(torch.empty(eng.layout.object_bytes - 1, dtype=torch.uint8), [[0, 1]])
    with pytest.raises(AssertionError):
        eng.gather(torch.empty(eng.layout.object_bytes // 2, dtype=torch.int16), [[0, 1]])


# --------------------------------------------------------------------------- hand-made specs


def _packed_spec(name: str, storage: int, offset: int, num_blocks: int, row_bytes: int, n: int = 16) -> LayerSpec:
    return LayerSpec(name=name, storage=storage, offset_bytes=offset, shape=[num_blocks, n, row_bytes],
                     strides=[n * row_bytes, row_bytes, 1], dtype="uint8", kv_dtype="uint8", gid=0, layout="mla")


def _packed_rows(base: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    nb, n, r = spec.shape
    return torch.as_strided(base, (nb, n, r), (n * r, r, 1), spec.offset_bytes)


@pytest.mark.parametrize("offset,word", [(0, 4), (4, 4), (2, 2), (6, 2), (1, 1), (3, 1)])
def test_word_fallbacks_132_byte_rows(offset, word, torch_rng):
    """Indexer rows of 132 bytes at offsets that allow 4-, 2- or only 1-byte words."""
    nb, n, row, layers = 5, 16, 132, 3
    layer_bytes = nb * n * row
    specs = [_packed_spec(f"idx.{i}", 0, offset + i * layer_bytes, nb, row) for i in range(layers)]
    storage = torch.randint(0, 256, (offset + layers * layer_bytes + 7,), dtype=torch.uint8, generator=torch_rng)
    el = group_layers(specs, [KVGroupSpec(0, n)], 32, [storage.numel()])
    eng = CpuTransferEngine(el, [storage])
    assert eng.plans[0].word == word
    ids = [[4, 1]]
    obj = torch.empty(el.object_bytes, dtype=torch.uint8)
    eng.gather(obj, ids)
    expected = torch.stack([_packed_rows(storage, s)[ids[0]].reshape(-1, row) for s in specs], dim=1).reshape(-1)
    assert torch.equal(obj, expected)
    before = storage.clone()
    eng.scatter(obj, [[0, 2]])
    for s in specs:
        assert torch.equal(_packed_rows(storage, s)[[0, 2]], _packed_rows(before, s)[ids[0]])
        assert torch.equal(_packed_rows(storage, s)[[1, 3, 4]], _packed_rows(before, s)[[1, 3, 4]])
    assert torch.equal(storage[:offset], before[:offset])
    assert torch.equal(storage[offset + layers * layer_bytes:], before[offset + layers * layer_bytes:])


@pytest.mark.parametrize("case", ["uneven-gaps", "two-storages", "descending-offsets"])
def test_layers_not_equally_spaced(case, torch_rng):
    """Layers that are not one equally spaced run in one storage are copied layer by layer
    (fp8_ds_mla 656-byte rows)."""
    nb, n, row = 4, 16, 656
    lb = nb * n * row
    if case == "uneven-gaps":
        place = [(0, 0), (0, lb), (0, 3 * lb), (0, 4 * lb + 4096)]
    elif case == "two-storages":
        place = [(0, 0), (1, lb), (0, 2 * lb), (1, 3 * lb)]  # equally spaced offsets, alternating storages
    else:
        place = [(0, 3 * lb), (0, 2 * lb), (0, lb), (0, 0)]
    storages = [torch.randint(0, 256, (6 * lb,), dtype=torch.uint8, generator=torch_rng) for _ in range(2)]
    specs = [_packed_spec(f"mla.{i}", sid, off, nb, row) for i, (sid, off) in enumerate(place)]
    el = group_layers(specs, [KVGroupSpec(0, n)], 32, [s.numel() for s in storages])
    eng = CpuTransferEngine(el, storages)
    assert eng.plans[0].stacked is False  # the per-layer path is the one under test
    ids = [[3, 0]]
    obj = torch.empty(el.object_bytes, dtype=torch.uint8)
    eng.gather(obj, ids)
    expected = torch.stack([_packed_rows(storages[s.storage], s)[ids[0]].reshape(-1, row) for s in specs],
                           dim=1).reshape(-1)
    assert torch.equal(obj, expected)
    before = [s.clone() for s in storages]
    eng.scatter(obj, [[1, 2]])
    for s in specs:
        assert torch.equal(_packed_rows(storages[s.storage], s)[[1, 2]], _packed_rows(before[s.storage], s)[ids[0]])
        assert torch.equal(_packed_rows(storages[s.storage], s)[[0, 3]], _packed_rows(before[s.storage], s)[[0, 3]])


def test_equally_spaced_layers_use_one_stacked_copy(model_groups, shm_kv_cache):
    cache = shm_kv_cache(model_groups("SmolLM2-135M"), 4, "BLNHC")
    assert all(p.stacked for p in engine_for(cache, 32).plans)
