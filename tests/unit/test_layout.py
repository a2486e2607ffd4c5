"""kvdepot.gpu.layout: layer views of every engine layout, layer grouping, fingerprints, errors.

Engine tensors come from `ShmKVCache` built with real models' shapes. A `LayerView` is checked
against the engine tensor it describes: the byte address it computes for (block, token, head,
kv) must be the address of that row in the engine's own tensor.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch

from kvdepot.client.kvcache import ALL_LAYOUTS, VLLM_ORDERS
from kvdepot.gpu.layout import (
    EngineLayout, LayerLayout, LayerView, dtype_from_name, dtype_name, group_layers, layer_view,
    layout_fingerprint,
)
from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.protocol.messages import KVGroupSpec, LayerSpec

DENSE_LAYOUTS = [lay for lay in ALL_LAYOUTS if lay != "mla"]
DENSE_DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn]
NUM_BLOCKS = 4

# (model, row_key): DeepSeek MLA rows: 576 bf16, fp8_ds_mla 656 B, DeepSeek-V4 584 B, indexer 132 B
MLA_MODELS = [
    ("DeepSeek-V3 (MLA)", "row_bytes"),
    ("DeepSeek-V3.2 fp8_ds_mla", "row_bytes"),
    ("DeepSeek-V4", "row_bytes"),
    ("DeepSeek-V3.2 fp8_ds_mla", "indexer_row_bytes"),
]
MLA_IDS = ["mla576-bf16", "fp8_ds_mla-656B", "dsv4-584B", "indexer-132B"]


def _layout(cache, chunk_size: int) -> EngineLayout:
    return group_layers(cache.layer_specs(), cache.group_specs(), chunk_size, [cache.size_bytes])


def _engine_row(cache, layer: int, b: int, t: int, h: int, kv: int) -> torch.Tensor:
    """The (block, token, head, kv) row of a layer, indexed in the engine's own tensor."""
    et = cache.engine_tensors[layer]
    if cache.layout in VLLM_ORDERS:  # [NB, H, N, C], C = K row | V row
        half = et.shape[-1] // 2
        return et[b, h, t, kv * half:(kv + 1) * half]
    if cache.layout.startswith("flash_attn"):  # (2, NB, N, H, D)
        return et[kv, b, t, h]
    if cache.layout == "flashinfer":  # (NB, 2, N, H, D)
        return et[b, kv, t, h]
    assert h == 0 and kv == 0
    return et[b, t]  # mla (NB, N, R)


def _check_view_addresses(cache, layer: int, view: LayerView) -> None:
    spec = cache.layer_specs()[layer]
    base = cache.storage.data_ptr() + spec.offset_bytes
    for b, t, h, kv in itertools.product(range(view.num_blocks), range(view.block_size), range(view.num_heads),
                                         range(view.num_kv)):
        row = _engine_row(cache, layer, b, t, h, kv)
        assert row.is_contiguous() and row.numel() * row.element_size() == view.row_bytes
        addr = base + b * view.block_stride + t * view.token_stride + h * view.head_stride + kv * view.kv_stride
        assert row.data_ptr() == addr, (layer, b, t, h, kv)
    et = cache.engine_tensors[layer]
    last = sum((n - 1) * s for n, s in zip(et.shape, et.stride())) * et.element_size() + et.element_size()
    assert view.extent_bytes() == last


# --------------------------------------------------------------------------- layer_view


@pytest.mark.parametrize("dtype", DENSE_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_layer_view_dense(layout, dtype, model_groups, shm_kv_cache):
    groups = model_groups("SmolLM2-135M", dtype)  # 30 layers, 3 KV heads, head_dim 64
    cache = shm_kv_cache(groups, NUM_BLOCKS, layout)
    specs = cache.layer_specs()
    assert {s.layout for s in specs} == {
        "vllm" if layout in VLLM_ORDERS else layout.removesuffix("_nhd").removesuffix("_hnd")}
    for li in (0, len(specs) - 1):
        view = layer_view(specs[li], 16)
        assert (view.num_blocks, view.block_size, view.num_heads, view.num_kv, view.row_bytes) == (
            NUM_BLOCKS, 16, 3, 2, 64 * dtype.itemsize)
        assert view.bytes_per_token == 3 * 2 * 64 * dtype.itemsize
        _check_view_addresses(cache, li, view)


@pytest.mark.parametrize("model,row_key", MLA_MODELS, ids=MLA_IDS)
def test_layer_view_mla_and_packed_rows(model, row_key, model_groups, shm_kv_cache):
    groups = model_groups(model, tokens_per_block=(64,), num_layers=2, row_key=row_key)
    cache = shm_kv_cache(groups, 2, "mla")
    expected_row = {"DeepSeek-V3 (MLA)": 576 * 2}.get(model, groups[0].head_dim)
    assert expected_row in (1152, 656, 584, 132)
    for li, spec in enumerate(cache.layer_specs()):
        assert spec.layout == "mla"
        view = layer_view(spec, 64)
        assert (view.num_heads, view.num_kv, view.row_bytes, view.head_stride, view.kv_stride) == (
            1, 1, expected_row, 0, 0)
        assert view.bytes_per_token == expected_row
        _check_view_addresses(cache, li, view)


def test_layer_view_strides_llama(model_groups, shm_kv_cache):
    """Exact byte strides of Llama-3.1-8B (H=8, D=128 bf16: row 256 B, page 64 KiB at N=16)."""
    groups = model_groups("Llama-3.1-8B")
    expected = {  # block, token, head, kv strides in bytes
        "LBNHC": (65536, 4096, 512, 256),
        "LBHNC": (65536, 512, 8192, 256),
        "BLNHC": (32 * 65536, 4096, 512, 256),
        "BLHNC": (32 * 65536, 512, 8192, 256),
        "flash_attn_nhd": (32768, 2048, 256, NUM_BLOCKS * 32768),
        "flash_attn_hnd": (32768, 256, 4096, NUM_BLOCKS * 32768),
        "flashinfer": (65536, 2048, 256, 32768),
    }
    for layout, strides in expected.items():
        cache = shm_kv_cache(groups, NUM_BLOCKS, layout)
        v = layer_view(cache.layer_specs()[5], 16)
        assert (v.block_stride, v.token_stride, v.head_stride, v.kv_stride) == strides, layout
        assert v.row_bytes == 256 and v.word_bytes() == 8


def test_word_bytes():
    v = LayerView(4, 64, 1, 1, 132, 64 * 132, 132, 0, 0)  # indexer rows: 132 = 4 * 33
    assert v.word_bytes() == 4
    assert v.word_bytes([4096, 8]) == 4
    assert v.word_bytes([2]) == 2
    assert v.word_bytes([4096, 1]) == 1
    assert LayerView(4, 16, 8, 2, 256, 65536, 4096, 512, 256).word_bytes([1 << 20]) == 8
    assert LayerView(4, 16, 1, 1, 6, 96, 6, 0, 0).word_bytes() == 2


def test_extent_bytes_of_empty_view():
    assert LayerView(0, 16, 8, 2, 256, 65536, 4096, 512, 256).extent_bytes() == 0


def test_dtype_names():
    assert dtype_from_name("bfloat16") is torch.bfloat16
    assert dtype_from_name("torch.float8_e4m3fn") is torch.float8_e4m3fn
    assert dtype_name(torch.float16) == "float16"
    for bad in ("float128", "bf16", "", "complex64"):
        with pytest.raises(RequestError) as ei:
            dtype_from_name(bad)
        assert ei.value.code is ErrorCode.LAYOUT


# --------------------------------------------------------------------------- group_layers


@pytest.mark.parametrize("model,chunk_size", [("SmolLM2-135M", 256), ("Llama-3.1-8B", 64), ("Qwen2.5-7B", 32)])
@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_group_layers_single_group(model, chunk_size, layout, model_kv_shapes, model_groups, shm_kv_cache):
    m = model_kv_shapes[model]
    cache = shm_kv_cache(model_groups(model), NUM_BLOCKS, layout)
    el = _layout(cache, chunk_size)
    assert el.chunk_size == chunk_size and el.tokens_per_block == [16]
    assert el.blocks_per_chunk(0) == chunk_size // 16
    assert el.object_bytes == chunk_size * m["kv_bytes_per_token"]  # bf16 bytes per token from the model data
    (g,) = el.groups
    assert (g.gid, g.num_layers, g.object_offset) == (0, m["layers"], 0)
    assert g.layer_names == cache.layer_names
    assert g.offsets == [(0, s.offset_bytes) for s in cache.layer_specs()]
    info = g.info()
    assert (info.num_layers, info.num_blocks, info.tokens_per_block, info.num_heads, info.num_kv) == (
        m["layers"], NUM_BLOCKS, 16, m["kv_heads"], 2)
    assert info.row_bytes == m["head_dim"] * 2 and info.bytes_per_token == m["kv_bytes_per_token"]
    assert info.kv_dtype == "bfloat16"
    assert info.dtype == ("int8" if layout in VLLM_ORDERS else "bfloat16")


def test_group_layers_mla_object_size(model_kv_shapes, model_groups, shm_kv_cache):
    m = model_kv_shapes["DeepSeek-V3 (MLA)"]
    cache = shm_kv_cache(model_groups("DeepSeek-V3 (MLA)", tokens_per_block=(64,)), 1, "mla")
    el = _layout(cache, 128)
    assert len(el.groups) == 1 and el.groups[0].num_layers == 61
    assert el.object_bytes == 128 * m["kv_bytes_per_token"]


def _rename(specs, prefix: str, storage: int) -> list[LayerSpec]:
    return [msgspec.structs.replace(s, name=f"{prefix}{s.name}", storage=storage) for s in specs]


def test_grouping_key_is_gid_shape_strides_dtype(model_groups, shm_kv_cache):
    """Layers of one gid but different strides (NHD vs HND) or dtypes form separate groups, in
    order of their first layer; layers within a group keep registration order."""
    smol = model_groups("SmolLM2-135M")
    nhd = _rename(shm_kv_cache(smol, NUM_BLOCKS, "flash_attn_nhd").layer_specs(), "nhd.", 0)
    hnd = _rename(shm_kv_cache(smol, NUM_BLOCKS, "flash_attn_hnd").layer_specs(), "hnd.", 1)
    fp16 = _rename(shm_kv_cache(model_groups("SmolLM2-135M", torch.float16), NUM_BLOCKS,
                                "flash_attn_nhd").layer_specs(), "f16.", 2)
    sizes = [1 << 30] * 3
    # shape and strides equal, kv dtype differs -> two groups; interleaved registration
    specs = [s for pair in zip(hnd[:3], nhd[:3], fp16[:3]) for s in pair]
    el = group_layers(specs, [KVGroupSpec(0, 16)], 64, sizes)
    assert [g.layer_names for g in el.groups] == [
        ["hnd.layer.0", "hnd.layer.1", "hnd.layer.2"],
        ["nhd.layer.0", "nhd.layer.1", "nhd.layer.2"],
        ["f16.layer.0", "f16.layer.1", "f16.layer.2"],
    ]
    assert [g.offsets[1][0] for g in el.groups] == [1, 0, 2]
    assert [g.kv_dtype for g in el.groups] == ["bfloat16", "bfloat16", "float16"]
    per_group = 64 * 3 * 768  # chunk * layers * (3 heads * 2 * 64 * 2 B)
    assert [g.object_offset for g in el.groups] == [0, per_group, 2 * per_group]
    assert el.object_bytes == 3 * per_group
    # vLLM int8 views: same shape, strides and view dtype, K/V dtype differs -> two groups
    vb = _rename(shm_kv_cache(smol, NUM_BLOCKS, "LBNHC").layer_specs(), "vb.", 0)
    vh = _rename(shm_kv_cache(model_groups("SmolLM2-135M", torch.float16), NUM_BLOCKS, "LBNHC").layer_specs(),
                 "vh.", 1)
    assert (vb[0].shape, vb[0].strides, vb[0].dtype) == (vh[0].shape, vh[0].strides, vh[0].dtype)
    el = group_layers([vb[0], vh[0], vb[1]], [KVGroupSpec(0, 16)], 64, sizes)
    assert [g.layer_names for g in el.groups] == [["vb.layer.0", "vb.layer.1"], ["vh.layer.0"]]
    assert [g.kv_dtype for g in el.groups] == ["bfloat16", "float16"]
    # same (gid, shape, strides, dtype) at different offsets and storages: one group
    el = group_layers(nhd[:2] + _rename(nhd[2:4], "x.", 1), [KVGroupSpec(0, 16)], 64, sizes)
    assert len(el.groups) == 1 and el.groups[0].offsets == [
        (0, nhd[0].offset_bytes), (0, nhd[1].offset_bytes), (1, nhd[2].offset_bytes), (1, nhd[3].offset_bytes)]


@pytest.mark.parametrize("model", ["Gemma-2-2B", "gpt-oss-20b"])
@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_hybrid_two_groups_in_gid_order(model, layout, model_kv_shapes, model_groups, shm_kv_cache):
    m = model_kv_shapes[model]
    groups = model_groups(model, tokens_per_block=(16, 32))  # full attention gid 0, sliding gid 1
    cache = shm_kv_cache(groups, [8, 4], layout)
    specs = cache.layer_specs()
    half = m["layers"] // 2
    # model order alternates full / sliding; register the sliding (gid 1) layer first
    alternating = [s for pair in zip(specs[half:], specs[:half]) for s in pair]
    assert alternating[0].gid == 1
    el = group_layers(alternating, list(reversed(cache.group_specs())), 64, [cache.size_bytes])
    assert el.tokens_per_block == [16, 32]
    assert [el.blocks_per_chunk(0), el.blocks_per_chunk(1)] == [4, 2]
    assert [g.gid for g in el.groups] == [0, 1]
    assert [g.num_layers for g in el.groups] == [half, half]
    assert [g.view.block_size for g in el.groups] == [16, 32]
    assert [g.view.num_blocks for g in el.groups] == [8, 4]
    assert el.groups[0].layer_names == cache.layer_names[:half]
    assert el.object_bytes == 64 * m["kv_bytes_per_token"]
    assert el.groups[1].object_offset == 64 * m["kv_bytes_per_token"] // 2


# --------------------------------------------------------------------------- fingerprint


def test_fingerprint_independent_of_physical_layout_and_block_size(model_groups, shm_kv_cache):
    fps = set()
    for layout in DENSE_LAYOUTS:
        for tpb in (16, 32):
            cache = shm_kv_cache(model_groups("Llama-3.1-8B", tokens_per_block=(tpb,)), 2, layout)
            fps.add(_layout(cache, 256).fingerprint)
    assert len(fps) == 1
    (fp,) = fps
    assert len(fp) == 32 and int(fp, 16) >= 0


def test_fingerprint_distinguishes_what_the_bytes_mean(model_groups, shm_kv_cache):
    def fp(name, chunk_size=256, dtype=torch.bfloat16, tpb=(16,), layout="LBNHC", row_key="row_bytes", layers=None):
        groups = model_groups(name, dtype, tokens_per_block=tpb, num_layers=layers, row_key=row_key)
        return _layout(shm_kv_cache(groups, 1, layout), chunk_size).fingerprint

    fps = [
        fp("SmolLM2-135M"),
        fp("Qwen2.5-7B"),
        fp("Llama-3.1-8B"),
        fp("Llama-3.1-8B", chunk_size=512),
        fp("Llama-3.1-8B", dtype=torch.float16),
        fp("Llama-3.1-8B", dtype=torch.float8_e4m3fn),
        fp("gpt-oss-20b"),
        fp("gpt-oss-20b", tpb=(16, 32)),
        fp("DeepSeek-V3 (MLA)", tpb=(64,), layout="mla"),
        fp("DeepSeek-V3.2 fp8_ds_mla", tpb=(64,), layout="mla"),
        fp("DeepSeek-V3.2 fp8_ds_mla", tpb=(64,), layout="mla", row_key="indexer_row_bytes"),
        fp("DeepSeek-V4", tpb=(64,), layout="mla", layers=61),
    ]
    assert len(set(fps)) == len(fps)


def test_fingerprint_function_is_deterministic(model_groups, shm_kv_cache):
    cache = shm_kv_cache(model_groups("Qwen2.5-7B"), 1, "LBHNC")
    el = _layout(cache, 256)
    assert layout_fingerprint(256, el.groups) == el.fingerprint
    assert layout_fingerprint(512, el.groups) != el.fingerprint


# --------------------------------------------------------------------------- errors


def _layout_error(fn, *args, match: str | None = None) -> RequestError:
    with pytest.raises(RequestError, match=match) as ei:
        fn(*args)
    assert ei.value.code is ErrorCode.LAYOUT
    return ei.value


@pytest.mark.parametrize("tpb,chunk_size,lcm", [((16, 32), 48, 32), ((16, 32), 16, 32), ((16,), 40, 16),
                                                 ((256, 64, 8, 4), 128, 256)])  # DeepSeek-V4 block sizes
def test_chunk_size_not_multiple_of_block_size(tpb, chunk_size, lcm, model_groups, shm_kv_cache):
    groups = model_groups("gpt-oss-20b", tokens_per_block=tpb, num_layers=24) if len(tpb) < 4 else \
        model_groups("DeepSeek-V4", tokens_per_block=tpb, num_layers=4)
    cache = shm_kv_cache(groups, 1, "mla" if len(tpb) == 4 else "LBNHC")
    err = _layout_error(_layout, cache, chunk_size)
    assert f"chunk_size {chunk_size}" in err.message
    assert f"use a multiple of {lcm}" in err.message and "--chunk-size" in err.message
    _layout(cache, lcm * 2)  # the suggested fix works


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_layer_exceeding_storage(layout, model_groups, shm_kv_cache):
    groups = model_groups("DeepSeek-V3 (MLA)", num_layers=3) if layout == "mla" else model_groups("SmolLM2-135M")
    cache = shm_kv_cache(groups, NUM_BLOCKS, layout)
    specs, gspecs = cache.layer_specs(), cache.group_specs()
    end = max(s.offset_bytes + layer_view(s, 16).extent_bytes() for s in specs)
    assert end <= cache.size_bytes
    group_layers(specs, gspecs, 64, [end])  # exactly fits
    err = _layout_error(group_layers, specs, gspecs, 64, [end - 1])
    assert "beyond its storage" in err.message and f"{end - 1} bytes" in err.message
    moved = [msgspec.structs.replace(specs[0], offset_bytes=cache.size_bytes)]
    _layout_error(group_layers, moved, gspecs, 64, [cache.size_bytes], match="beyond its storage")
    _layout_error(group_layers, specs, gspecs, 64, [], match="names storage 0 of 0")


def _flash_spec(**kw) -> LayerSpec:
    """Llama-3.1-8B FlashAttention NHD layer: (2, 4, 16, 8, 128) bf16."""
    base = dict(name="l0", storage=0, offset_bytes=0, shape=[2, 4, 16, 8, 128],
                strides=[65536, 16384, 1024, 128, 1], dtype="bfloat16", kv_dtype="bfloat16", gid=0,
                layout="flash_attn")
    base.update(kw)
    return LayerSpec(**base)


@pytest.mark.parametrize("kw,match", [
    (dict(layout="paged"), "unknown layout"),
    (dict(layout="FLASH_ATTN"), "unknown layout"),
    (dict(dtype="float128"), "unsupported dtype"),
    (dict(kv_dtype="bf16"), "unsupported dtype"),
    (dict(strides=[65536, 16384, 1024, 128]), "differ in length"),
    (dict(shape=[4, 16, 8, 128], strides=[16384, 1024, 128, 1]), "expected 5 dims"),
    (dict(shape=[3, 4, 16, 8, 128]), "size 2"),
    (dict(strides=[65536, 16384, 1024, 1, 8]), "contiguous"),
    (dict(shape=[2, 4, 32, 8, 128], strides=[131072, 32768, 1024, 128, 1]), "block size 32"),
    (dict(layout="vllm", shape=[4, 8, 16, 512], strides=[65536, 512, 4096, 1]), "int8/uint8"),
    (dict(layout="vllm", dtype="int8", shape=[4, 8, 16, 510], strides=[65536, 510, 4096, 1]), "C=510"),
    (dict(layout="vllm", dtype="int8", shape=[4, 8, 16, 512], strides=[65536, 1, 4096, 8]), "stride 1"),
    (dict(layout="vllm", dtype="int8", shape=[4, 16, 512], strides=[8192, 512, 1]), "expected \\[num_blocks"),
    (dict(layout="mla", shape=[4, 16, 576, 1], strides=[9216, 576, 1, 1]), "expected \\(num_blocks"),
    (dict(layout="mla", shape=[4, 16, 576], strides=[1, 4, 64]), "row must be contiguous"),
    (dict(layout="mla", shape=[4, 16, 0], strides=[0, 0, 1]), "empty rows"),
    (dict(shape=[2, 4, 16, 0, 128]), "empty rows"),
    (dict(strides=[65536, 0, 1024, 128, 1]), "overlaps itself"),  # every block aliases block 0
    (dict(strides=[65536, 16384, 512, 128, 1]), "overlaps itself"),  # tokens overlap their heads
    (dict(strides=[128, 16384, 1024, 128, 1]), "overlaps itself"),  # V aliases head 1 of K
])
def test_layer_view_errors(kw, match):
    _layout_error(layer_view, _flash_spec(**kw), 16, match=match)


def test_absurd_chunk_sizes_are_layout_errors(model_groups, shm_kv_cache):
    from kvdepot.gpu.layout import MAX_CHUNK_TOKENS

    spec = _flash_spec()
    _layout_error(group_layers, [spec], [KVGroupSpec(gid=0, tokens_per_block=16)], MAX_CHUNK_TOKENS * 16,
                  [1 << 20], match="exceeds")
    big = _flash_spec(shape=[2, 4, 16, 8, 1 << 20], strides=[4 * 16 * 8 << 20, 16 * 8 << 20, 8 << 20, 1 << 20, 1])
    _layout_error(group_layers, [big], [KVGroupSpec(gid=0, tokens_per_block=16)], 1 << 16, [1 << 40],
                  match="smaller chunk_size")


def test_layer_view_error_names_the_layer():
    err = _layout_error(layer_view, _flash_spec(name="model.layers.7.attn", layout="paged"), 16)
    assert "model.layers.7.attn" in err.message


@pytest.mark.parametrize("groups,layer_gids,match", [
    ([KVGroupSpec(1, 16)], [1], r"gids must be 0..G-1, got \[1\]"),
    ([KVGroupSpec(0, 16), KVGroupSpec(2, 16)], [0, 2], r"gids must be 0..G-1, got \[0, 2\]"),
    ([KVGroupSpec(0, 16), KVGroupSpec(0, 16)], [0], "listed twice"),
    ([KVGroupSpec(0, 16)], [0, 1], "gid 1 not in groups"),
    ([], [0], "gid 0 not in groups"),
])
def test_group_ids_must_be_dense(groups, layer_gids, match):
    layers = [_flash_spec(name=f"l{i}", gid=g) for i, g in enumerate(layer_gids)]
    _layout_error(group_layers, layers, groups, 64, [1 << 30], match=match)


def test_no_layers():
    _layout_error(group_layers, [], [KVGroupSpec(0, 16)], 64, [1 << 30], match="no layers")


def test_layer_layout_values_are_wire_names():
    assert [m.value for m in LayerLayout] == ["vllm", "flash_attn", "flashinfer", "mla"]
