"""Engine KV-cache layouts, layer grouping and the canonical object format.

Every layout an engine registers is reduced to one strided description of a layer
(`LayerView`): five logical dims ``[block, token, head, kv, row]`` with byte strides, where a
*row* is ``row_bytes`` contiguous bytes (one head's K or V: ``head_dim * elem_bytes``; or one
MLA / byte-packed row). What the engine's dims mean is given by `LayerLayout`:

===============  =====================================  ========================================
layout           engine tensor (strides in elements)    source
===============  =====================================  ========================================
``vllm``         ``[num_blocks, H, N, C]`` int8 view,   vLLM >= 0.33 standardized layout
                 C = 2 * head_dim * elem_bytes (K|V of  (KVCacheLayout LBNHC = NHD, LBHNC = HND,
                 one head packed); physical order is    BLNHC, BLHNC): every layer a view over
                 whatever the strides say               one int8 allocation
``flash_attn``   ``(2, num_blocks, N, H, D)``, NHD, or  vLLM < 0.33 FlashAttention backend
                 HND as stride order (0, 1, 3, 2, 4)
``flashinfer``   ``(num_blocks, 2, N, H, D)``           vLLM < 0.33 FlashInfer backend
``mla``          ``(num_blocks, N, R)``: R = 576 bf16   vLLM MLA (DeepSeek); fp8_ds_mla 656 B,
                 elements, or R bytes of a packed row   DeepSeek-V4 584 B, indexer 132 B int8
===============  =====================================  ========================================

(N = tokens per block, H = KV heads, D = head dim.)

Canonical object format
-----------------------
One *object* holds one chunk (``chunk_size`` tokens) of one shard. Its bytes do not depend on
the engine's physical layout, so an HND engine can retrieve what an NHD engine stored::

    object = group_0 | group_1 | ...           layer groups in canonical order (below)
    group  = [chunk_size, num_layers, H, KV, row_bytes]   C-order bytes (token-major)
             token t, layer l, head h, k(0)/v(1), row bytes

i.e. for every token, the rows of all the group's layers; within one layer and token the
heads in order, each head's K row then its V row (exactly vLLM 0.33's C packing). MLA and
byte-packed layouts have H = KV = 1. Token-major means a suffix of a chunk's tokens is a
contiguous suffix of each group, so retrieving after skipped leading blocks reads a
contiguous range.

Layer groups: layers sharing (gid, layout, shape, strides, dtype, kv_dtype) form one group
with one `LayerView` and a list of per-layer byte offsets. Canonical group order: by gid,
then by the registration index of the group's first layer; layers within a group keep
registration order.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
from collections.abc import Sequence

import torch

from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.protocol.messages import KVGroupSpec, LayerGroupInfo, LayerSpec


MAX_CHUNK_TOKENS = 1 << 20
MAX_OBJECT_BYTES = 1 << 36  # 64 GiB: far above any real chunk, far below integer-overflow territory


class LayerLayout(str, enum.Enum):
    """What the dims of a registered layer tensor mean (see the module docstring)."""

    VLLM = "vllm"
    FLASH_ATTN = "flash_attn"
    FLASHINFER = "flashinfer"
    MLA = "mla"


_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8",
        "int16", "int32", "int64",
    )
    if hasattr(torch, name)
}


def dtype_from_name(name: str) -> torch.dtype:
    """torch dtype for a wire dtype name (``"bfloat16"``; a ``"torch."`` prefix is accepted).

    Raises:
        RequestError(LAYOUT): unknown dtype.
    """
    key = name.removeprefix("torch.")
    try:
        return _DTYPES[key]
    except KeyError:
        raise RequestError(ErrorCode.LAYOUT, f"unsupported dtype {name!r}; supported: {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def elem_bytes(dtype_name_: str) -> int:
    return dtype_from_name(dtype_name_).itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class LayerView:
    """One layer's KV in engine memory as five logical dims with byte strides.

    Logical shape ``[num_blocks, block_size, num_heads, num_kv, row_bytes]``; ``row_bytes`` are
    contiguous. Strides are in bytes and non-negative.
    """

    num_blocks: int
    block_size: int  # tokens per block
    num_heads: int  # KV heads (1 for MLA / packed rows)
    num_kv: int  # 2 (K and V) or 1 (MLA / packed rows)
    row_bytes: int  # contiguous bytes of one (token, head, kv) row
    block_stride: int
    token_stride: int
    head_stride: int
    kv_stride: int

    @property
    def bytes_per_token(self) -> int:
        """Canonical bytes of one token of this layer (H * KV * row_bytes)."""
        return self.num_heads * self.num_kv * self.row_bytes

    def extent_bytes(self) -> int:
        """Bytes from the view's first byte to one past its last byte."""
        last = (
            (self.num_blocks - 1) * self.block_stride
            + (self.block_size - 1) * self.token_stride
            + (self.num_heads - 1) * self.head_stride
            + (self.num_kv - 1) * self.kv_stride
        )
        return last + self.row_bytes if self.num_blocks else 0

    def word_bytes(self, offsets: Sequence[int] = ()) -> int:
        """Largest word (8, 4, 2 or 1 bytes) dividing the row and every stride and offset."""
        g = math.gcd(self.row_bytes, self.block_stride, self.token_stride, self.head_stride,
                     self.kv_stride, *offsets)
        for w in (8, 4, 2):
            if g % w == 0:
                return w
        return 1


def layer_view(spec: LayerSpec, tokens_per_block: int) -> LayerView:
    """Reduce a registered layer to a `LayerView`.

    Raises:
        RequestError(LAYOUT): shape / strides / dtype do not match ``spec.layout``, the row is
            not contiguous, or the block size disagrees with the group's tokens_per_block.
    """

    def bad(why: str) -> RequestError:
        return RequestError(
            ErrorCode.LAYOUT,
            f"layer {spec.name!r} ({spec.layout}, shape {spec.shape}, strides {spec.strides}, "
            f"dtype {spec.dtype}): {why}",
        )

    try:
        layout = LayerLayout(spec.layout)
    except ValueError:
        raise bad(f"unknown layout; expected one of {[m.value for m in LayerLayout]}") from None
    if len(spec.shape) != len(spec.strides):
        raise bad("shape and strides differ in length")
    es = elem_bytes(spec.dtype)
    kv_es = elem_bytes(spec.kv_dtype)
    shape, st = spec.shape, [s * es for s in spec.strides]

    if layout is LayerLayout.VLLM:
        if len(shape) != 4:
            raise bad("expected [num_blocks, H, N, C]")
        nb, h, n, c = shape
        if es != 1:
            raise bad("vLLM >= 0.33 views are int8/uint8 (K|V bytes packed in C)")
        if c % 2 or (c // 2) % kv_es:
            raise bad(f"C={c} is not 2 * head_dim * {kv_es} bytes")
        if spec.strides[3] != 1:
            raise bad("C must be contiguous (stride 1)")
        view = LayerView(nb, n, h, 2, c // 2, st[0], st[2], st[1], c // 2)
    elif layout in (LayerLayout.FLASH_ATTN, LayerLayout.FLASHINFER):
        if len(shape) != 5:
            raise bad("expected 5 dims")
        if layout is LayerLayout.FLASH_ATTN:
            two, nb, n, h, d = shape
            kv_s, b_s = st[0], st[1]
        else:
            nb, two, n, h, d = shape
            b_s, kv_s = st[0], st[1]
        if two != 2:
            raise bad("the K/V dim must have size 2")
        if spec.strides[4] != 1:
            raise bad("head_dim must be contiguous (stride 1)")
        view = LayerView(nb, n, h, 2, d * es, b_s, st[2], st[3], kv_s)
    else:  # MLA / byte-packed rows
        if len(shape) != 3:
            raise bad("expected (num_blocks, block_size, row)")
        nb, n, r = shape
        if spec.strides[2] != 1:
            raise bad("the row must be contiguous (stride 1)")
        view = LayerView(nb, n, 1, 1, r * es, st[0], st[1], 0, 0)
    # the view must not alias itself: sorted by stride, each dim must step past everything inside it
    extent = view.row_bytes
    dims = [(view.kv_stride, view.num_kv), (view.head_stride, view.num_heads), (view.token_stride, view.block_size),
            (view.block_stride, view.num_blocks)]
    for stride, size in sorted((d for d in dims if d[1] > 1), key=lambda d: d[0]):
        if stride < extent:
            raise bad("the view overlaps itself (a stride is smaller than the data inside it)")
        extent = stride * (size - 1) + extent
    if view.block_size != tokens_per_block:
        raise bad(f"block size {view.block_size} != tokens_per_block {tokens_per_block} of gid {spec.gid}")
    if view.row_bytes == 0 or view.num_heads == 0:
        raise bad("empty rows")
    return view


@dataclasses.dataclass(slots=True)
class LayerGroup:
    """Layers sharing one `LayerView` (same gid, layout, shape, strides, dtypes).

    ``offsets`` are per layer: (storage index, byte offset of the layer view in that storage).
    ``object_offset`` is where this group starts inside a canonical object.
    """

    gid: int
    layout: str
    dtype: str
    kv_dtype: str
    view: LayerView
    layer_names: list[str]
    offsets: list[tuple[int, int]]
    object_offset: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.offsets)

    @property
    def bytes_per_token(self) -> int:
        """Canonical bytes of one token over all layers of the group."""
        return self.num_layers * self.view.bytes_per_token

    def info(self) -> LayerGroupInfo:
        v = self.view
        return LayerGroupInfo(
            gid=self.gid, layout=self.layout, dtype=self.dtype, kv_dtype=self.kv_dtype,
            num_layers=self.num_layers, num_blocks=v.num_blocks, tokens_per_block=v.block_size,
            num_heads=v.num_heads, num_kv=v.num_kv, row_bytes=v.row_bytes,
            bytes_per_token=self.bytes_per_token,
        )


@dataclasses.dataclass(slots=True)
class EngineLayout:
    """All layer groups of one registration plus the canonical object size.

    tokens_per_block: per gid (index = gid).
    """

    chunk_size: int
    tokens_per_block: list[int]
    groups: list[LayerGroup]
    object_bytes: int
    fingerprint: str
    # per gid, the blocks every layer of the gid has (valid block ids are below it)
    num_blocks: list[int] = dataclasses.field(init=False)
    # per gid, the blocks of one chunk (chunk_size // tokens_per_block)
    chunk_blocks: list[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        nb: dict[int, int] = {}
        for g in self.groups:
            nb[g.gid] = min(nb.get(g.gid, g.view.num_blocks), g.view.num_blocks)
        self.num_blocks = [nb.get(gid, 0) for gid in range(len(self.tokens_per_block))]
        self.chunk_blocks = [self.chunk_size // t for t in self.tokens_per_block]

    def blocks_per_chunk(self, gid: int) -> int:
        return self.chunk_size // self.tokens_per_block[gid]


def group_layers(
    layers: Sequence[LayerSpec],
    kv_groups: Sequence[KVGroupSpec],
    chunk_size: int,
    storage_sizes: Sequence[int],
) -> EngineLayout:
    """Group layers by (gid, layout, shape, strides, dtype, kv_dtype) and size the object.

    Args:
        layers: per-layer specs in registration (model) order.
        kv_groups: tokens per block for every gid used by ``layers``; gids must be 0..G-1.
        chunk_size: tokens per chunk; must be a multiple of every gid's tokens_per_block.
        storage_sizes: byte size of each storage the layers point into.

    Raises:
        RequestError(LAYOUT): a layer does not fit its storage, gids are missing or
            duplicated, or chunk_size is not a multiple of a group's tokens_per_block.
    """
    if not layers:
        raise RequestError(ErrorCode.LAYOUT, "no layers registered")
    tpb: dict[int, int] = {}
    for g in kv_groups:
        if g.gid in tpb:
            raise RequestError(ErrorCode.LAYOUT, f"gid {g.gid} listed twice in groups")
        tpb[g.gid] = g.tokens_per_block
    if sorted(tpb) != list(range(len(tpb))):
        raise RequestError(ErrorCode.LAYOUT, f"gids must be 0..G-1, got {sorted(tpb)}")
    for gid, bs in tpb.items():
        if chunk_size % bs:
            lcm = math.lcm(*tpb.values())
            raise RequestError(
                ErrorCode.LAYOUT,
                f"chunk_size {chunk_size} is not a multiple of gid {gid}'s {bs} tokens per block; "
                f"use a multiple of {lcm} (--chunk-size / chunk_size)",
            )
    if chunk_size > MAX_CHUNK_TOKENS:
        raise RequestError(ErrorCode.LAYOUT, f"chunk_size {chunk_size} exceeds {MAX_CHUNK_TOKENS} tokens")
    groups: dict[tuple, LayerGroup] = {}
    used_gids = set()
    for spec in layers:
        if spec.gid not in tpb:
            raise RequestError(ErrorCode.LAYOUT, f"layer {spec.name!r} has gid {spec.gid} not in groups")
        if spec.storage >= len(storage_sizes):
            raise RequestError(ErrorCode.LAYOUT, f"layer {spec.name!r} names storage {spec.storage} of {len(storage_sizes)}")
        view = layer_view(spec, tpb[spec.gid])
        end = spec.offset_bytes + view.extent_bytes()
        if end > storage_sizes[spec.storage]:
            raise RequestError(
                ErrorCode.LAYOUT,
                f"layer {spec.name!r} spans bytes [{spec.offset_bytes}, {end}) beyond its storage of "
                f"{storage_sizes[spec.storage]} bytes",
            )
        used_gids.add(spec.gid)
        key = (spec.gid, spec.layout, tuple(spec.shape), tuple(spec.strides), spec.dtype, spec.kv_dtype)
        grp = groups.get(key)
        if grp is None:
            grp = groups[key] = LayerGroup(spec.gid, spec.layout, spec.dtype, spec.kv_dtype, view, [], [])
        grp.layer_names.append(spec.name)
        grp.offsets.append((spec.storage, spec.offset_bytes))
    ordered = sorted(groups.values(), key=lambda g: g.gid)  # stable: first-layer order within a gid
    offset = 0
    for grp in ordered:
        grp.object_offset = offset
        offset += chunk_size * grp.bytes_per_token
    if offset > MAX_OBJECT_BYTES:
        raise RequestError(ErrorCode.LAYOUT, f"one chunk would be {offset} bytes (> {MAX_OBJECT_BYTES}); "
                                             "use a smaller chunk_size")
    tokens_per_block = [tpb[g] for g in range(len(tpb))]
    return EngineLayout(chunk_size, tokens_per_block, ordered, offset, layout_fingerprint(chunk_size, ordered))


def layout_fingerprint(chunk_size: int, groups: Sequence[LayerGroup]) -> str:
    """Hex digest of what a canonical object's bytes mean (independent of physical layout and
    block size): chunk size and, per group in order, gid, layer count, heads, K/V, row bytes
    and K/V dtype."""
    parts = [f"kvdepot-object-v1;chunk={chunk_size}"]
    for g in groups:
        v = g.view
        parts.append(f"g{g.gid}:L{g.num_layers}:H{v.num_heads}:KV{v.num_kv}:R{v.row_bytes}:{g.kv_dtype}")
    return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()
