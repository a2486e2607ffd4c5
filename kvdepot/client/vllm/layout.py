"""vLLM KV-cache configuration -> kvdepot registration.

Which groups are cached
-----------------------
vLLM's ``KVCacheConfig.kv_cache_groups`` are indexed by *vLLM gid*. kvdepot stores the groups
that take part in prefix caching and external KV transfer
(``KVCacheConfig.prefix_cacheable_group_ids``: full attention, MLA, sliding window, chunked
local attention), renumbered 0..G-1 as *daemon gids* in vLLM gid order. Groups vLLM rebuilds
itself after a connector load (``enable_kv_transfer=False``) and per-request scratch groups
(not prefix-cacheable) are not stored. A model with a prefix-cacheable group the connector
cannot store (Mamba state, compressed or layer-less specs) runs without kvdepot (see
`transfer_groups`).

Tensors
-------
vLLM 0.33 hands the connector one view per layer, ``[B, H, N, C']`` in the spec's dtype (or
int8) over ONE allocation (``vllm.v1.kv_cache_interface.create_kv_cache_views``), physical
order ``KVCacheConfig.kv_cache_layout``; the views of different groups alias the same bytes
(a block id belongs to one group at a time). The connector registers each layer as the int8
view ``[B, H, N, C]`` (C = C' * elem bytes: K|V of one head) -- kvdepot layout ``vllm`` -- with
its byte offset in the allocation. With kernel-block splitting the view is kernel-granular
(``B = num_blocks * r``, ``N = block_size / r``): it is registered with N tokens per block and
manager block ``b`` becomes kernel blocks ``b*r .. b*r+r-1`` (`Registration.expand`).

Storage of the allocation
-------------------------
* CUDA: exported by IPC handle (`kvdepot.client.kvcache.export_cuda_storage`), registered
  with ``device="cuda"``.
* CPU: the daemon maps POSIX shared memory by name, so the allocation must be a
  ``/dev/shm`` segment: `shm_allocation` (the connector's ``get_mem_pool_context``) makes
  vLLM's ``torch.zeros`` of the KV cache a kvdepot segment, and `register_shm_segment` names a
  segment made elsewhere (e.g. `kvdepot.client.kvcache.ShmKVCache`). Tensors are matched to
  segments by address (`find_shm_segment`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode

from kvdepot.gpu.layout import LayerLayout, dtype_name, group_layers
from kvdepot.gpu.shm import create_memfd
from kvdepot.protocol.messages import KVGroupSpec, LayerSpec, StorageSpec


@dataclasses.dataclass(frozen=True, slots=True)
class TransferGroup:
    """One KV-cache group kvdepot stores.

    daemon_gid: gid in the registration (0..G-1).
    vllm_gid: index into ``KVCacheConfig.kv_cache_groups`` (and into vLLM's per-gid block ids).
    block_size: tokens per (manager) block of the group.
    layer_names: the group's layers, in vLLM's order.
    has_null_blocks: vLLM may put its null block into this group's block table for tokens the
        group no longer needs (sliding window, chunked local attention).
    window_blocks: sliding-window groups (vLLM's ``SlidingWindowSpec``): the blocks before a
        hit's end that vLLM keeps for it, ``ceil((window + extra_retained_tokens) / block_size)``
        (it lets every earlier block of a hit go: ``SlidingWindowManager.get_num_skipped_tokens``;
        one more token covers a full hit whose last token vLLM computes again); 0 for others.
        A store writes only each chunk's last ``window_blocks`` blocks of the group (`kept_from`).
    """

    daemon_gid: int
    vllm_gid: int
    block_size: int
    layer_names: tuple[str, ...]
    has_null_blocks: bool
    window_blocks: int = 0

    def kept_from(self, chunk_size: int) -> int:
        """Within each chunk of ``chunk_size`` tokens, the index of the first of this group's
        blocks a load can ever be given (0: all): since a hit ends on a chunk boundary, vLLM
        hands a load non-null blocks of this group only for the last ``window_blocks`` blocks
        of the hit's last chunk, so a store's earlier blocks would never be read."""
        per = chunk_size // self.block_size
        return per - self.window_blocks if 0 < self.window_blocks < per else 0


def _layer_spec(group, layer_name: str):
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer_name]
    return spec


def transfer_groups(kv_cache_config) -> tuple[list[TransferGroup], str]:
    """The groups kvdepot stores, or ``([], reason)`` when this model cannot be cached.

    Returns:
        (groups, reason): ``reason`` is empty when ``groups`` can be used.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, iter_layer_specs

    out: list[TransferGroup] = []
    for vgid in kv_cache_config.prefix_cacheable_group_ids:
        group = kv_cache_config.kv_cache_groups[vgid]
        spec = group.kv_cache_spec
        for s in iter_layer_specs(spec):
            if not isinstance(s, AttentionSpec):
                return [], (f"KV-cache group {vgid} holds {type(s).__name__} (recurrent state, not per-token KV); "
                            "kvdepot stores attention KV only")
            if not s.has_layer_views or s.tokens_per_state != 1:
                return [], f"KV-cache group {vgid} ({type(s).__name__}) packs tokens; kvdepot cannot address them"
        if not group.layer_names:
            continue
        full = all(isinstance(s, FullAttentionSpec) and getattr(s, "sliding_window", None) is None
                   and getattr(s, "attention_chunk_size", None) is None for s in iter_layer_specs(spec))
        out.append(TransferGroup(len(out), vgid, spec.block_size, tuple(group.layer_names), not full,
                                 _window_blocks(spec)))
    if not out:
        return [], "the model has no prefix-cacheable attention KV-cache group"
    return out, ""


def _window_blocks(spec) -> int:
    """`TransferGroup.window_blocks` of a group's spec: > 0 only where every layer is vLLM's
    ``SlidingWindowSpec`` (its manager lets the blocks behind the window go)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec, iter_layer_specs

    specs = list(iter_layer_specs(spec))
    if not specs or not all(isinstance(s, SlidingWindowSpec) and s.sliding_window for s in specs):
        return 0
    tokens = max(s.sliding_window + int(getattr(s, "extra_retained_tokens", 0) or 0) for s in specs)
    return -(-tokens // spec.block_size)


def attention_tag(kv_cache_config, groups: Sequence[TransferGroup]) -> str:
    """Which blocks of a chunk the engine may hold as vLLM's null block (`namespace_seed`'s
    ``attention``): per group that may hold some, its vLLM gid, its tokens per block (vLLM lets
    whole blocks go, so the block size decides which tokens a window keeps) and every layer's
    sliding window and local-attention chunk size (not the specs' class names, which vLLM may
    rename), with the tokens vLLM keeps behind a window where it keeps any
    (``extra_retained_tokens``: they decide `TransferGroup.window_blocks`, the blocks a store
    holds); empty for a full-attention model. A store of such a group carries the null block's bytes where
    vLLM had already let a block go, which only an engine that lets the same blocks go never
    loads."""
    from vllm.v1.kv_cache_interface import iter_layer_specs

    parts = []
    for g in groups:
        if g.has_null_blocks:
            spec = kv_cache_config.kv_cache_groups[g.vllm_gid].kv_cache_spec
            kinds = sorted({f"sw={getattr(s, 'sliding_window', None)}:acs={getattr(s, 'attention_chunk_size', None)}"
                            + (f":extra={extra}" if (extra := getattr(s, "extra_retained_tokens", 0)) else "")
                            for s in iter_layer_specs(spec)})
            parts.append(f"g{g.vllm_gid}:bs={g.block_size}=" + ",".join(kinds))
    return ";".join(parts)


def layout_name(kv_cache_config, cache_config=None) -> str:
    """The resolved physical layout name (``KVCacheLayout``), ``"LBNHC"`` if none is recorded."""
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if not name and cache_config is not None:
        name = getattr(cache_config, "kv_cache_layout", None)
    return name or "LBNHC"


def config_layer_specs(kv_cache_config, groups: Sequence[TransferGroup], layout: str
                       ) -> tuple[list[int], list[LayerSpec]]:
    """The registration the workers will make, computed from the config alone (no memory):
    (storage sizes, layer specs), with the strides vLLM's ``create_kv_cache_views`` gives
    (kernel block size = block size)."""
    from vllm.config.cache import _layout_from_name
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes, compute_layout_strides

    lay = _layout_from_name(layout)
    by_layer = {name: g for g in groups for name in g.layer_names}
    sizes = sorted({t.size for t in kv_cache_config.kv_cache_tensors}) or [1]
    specs: list[LayerSpec] = []
    for tensor in kv_cache_config.kv_cache_tensors:
        names = [n for n in tensor.layers if n in by_layer]
        if not names:
            continue
        g = by_layer[names[0]]
        spec = _layer_spec(kv_cache_config.kv_cache_groups[g.vllm_gid], names[0])
        num_blocks = kv_cache_config.num_blocks_of(tensor)
        shape = compute_layer_kv_cache_shape_bytes(spec, num_blocks)
        strides = compute_layout_strides(spec, num_blocks, len(tensor.layers), lay,
                                         fixed_strides=(tensor.layer_stride, tensor.block_stride, None, None, None))
        for li, name in enumerate(tensor.layers):
            if name not in by_layer:
                continue
            g = by_layer[name]
            spec = _layer_spec(kv_cache_config.kv_cache_groups[g.vllm_gid], name)
            specs.append(LayerSpec(name=name, storage=sizes.index(tensor.size),
                                   offset_bytes=tensor.offset + li * tensor.layer_stride, shape=list(shape),
                                   strides=list(strides[1:]), dtype="int8", kv_dtype=dtype_name(spec.dtype),
                                   gid=g.daemon_gid, layout=LayerLayout.VLLM.value))
    order = {name: i for g in groups for i, name in enumerate(g.layer_names)}
    specs.sort(key=lambda s: (s.gid, order.get(s.name, 0)))
    return sizes, specs


def predict_fingerprint(kv_cache_config, groups: Sequence[TransferGroup], chunk_size: int, layout: str) -> str:
    """The layout fingerprint the daemon will answer the workers' registrations with (it seeds
    chunk keys, which the scheduler computes before any worker registered).

    Raises:
        kvdepot.protocol.errors.RequestError(LAYOUT): the daemon would refuse this layout.
    """
    sizes, specs = config_layer_specs(kv_cache_config, groups, layout)
    kv_groups = [KVGroupSpec(gid=g.daemon_gid, tokens_per_block=g.block_size) for g in groups]
    return group_layers(specs, kv_groups, chunk_size, sizes).fingerprint


# ---------------------------------------------------------------------- shared memory segments


_segments_lock = threading.Lock()
_segments: dict[int, tuple[str, int, weakref.ref]] = {}  # base address -> (shm name, size, tensor ref)


def register_shm_segment(name: str, storage: torch.Tensor, fd: int | None = None) -> None:
    """Record that ``storage`` (a CPU tensor mapping the whole segment, e.g. from
    `kvdepot.gpu.shm.create_memfd` or ``ShmKVCache.storage``) is shared memory the daemon can
    map, so KV-cache views into it can be registered with the daemon: the sealed memfd ``fd``
    (``name`` only labels it), or without ``fd`` the /dev/shm segment ``name``."""
    base = storage.untyped_storage().data_ptr()
    size = storage.untyped_storage().nbytes()
    with _segments_lock:
        _segments[base] = (name, size, weakref.ref(storage), fd)


def unregister_shm_segment(storage: torch.Tensor) -> None:
    with _segments_lock:
        _segments.pop(storage.untyped_storage().data_ptr(), None)


def find_shm_segment(t: torch.Tensor) -> tuple[str, int, int, int | None] | None:
    """(segment name, segment size, byte offset of ``t``'s first element, memfd or None) for a
    CPU tensor inside a registered segment, else None."""
    ptr = t.data_ptr()
    with _segments_lock:
        for base, (name, size, _, fd) in _segments.items():
            if base <= ptr < base + size:
                return name, size, ptr - base, fd
    return None


_MIN_SHM_BYTES = 64 << 10  # smaller int8 buffers made under the context stay ordinary memory


class _ShmZeros(TorchFunctionMode):
    """Turns ``torch.zeros(n, dtype=int8, device=cpu)`` -- vLLM's KV-cache allocation
    (``vllm.v1.worker.utils.allocate_kv_cache``) -- into a zero-filled sealed memfd (nobody can
    shrink it under the daemon's copies, `kvdepot.gpu.shm`)."""

    def __init__(self, prefix: str, made: list[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self._prefix = prefix
        self._made = made

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and kwargs.get("dtype") in (torch.int8, torch.uint8):
            dev = kwargs.get("device")
            size = args[0] if len(args) == 1 else (args if args else kwargs.get("size"))
            if isinstance(size, (tuple, list)) and len(size) == 1:
                size = size[0]
            if isinstance(size, int) and size >= _MIN_SHM_BYTES and (dev is None or torch.device(dev).type == "cpu"):
                name = f"{self._prefix}-{len(self._made)}"
                fd, t = create_memfd(name, size)
                t = t.view(kwargs["dtype"])
                register_shm_segment(name, t, fd)
                self._made.append((fd, t))
                return t
        return func(*args, **kwargs)


class ShmSegments:
    """The sealed memfds one worker allocated its KV cache in (`allocation_context`); closed by
    `close` (also at garbage collection and interpreter exit; mappings stay valid)."""

    def __init__(self) -> None:
        self.prefix = f"kvdepot-vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.made: list[tuple[int, torch.Tensor]] = []  # (memfd, its mapping)
        self._finalizer = weakref.finalize(self, _close_all, self.made)

    def allocation_context(self) -> TorchFunctionMode:
        """Context under which vLLM's CPU KV-cache allocation lands in shared memory."""
        return _ShmZeros(self.prefix, self.made)

    def close(self) -> None:
        self._finalizer()


def _close_all(made: list[tuple[int, torch.Tensor]]) -> None:
    for fd, t in made:
        unregister_shm_segment(t)
        os.close(fd)
    made.clear()


# ---------------------------------------------------------------------- worker registration


@dataclasses.dataclass(slots=True)
class Registration:
    """What a worker registers: storages, layer specs, groups, and per daemon gid the number
    of kernel blocks per manager block (``ratio``)."""

    device: str  # "cpu" or "cuda"
    storages: list[StorageSpec]
    layers: list[LayerSpec]
    groups: list[KVGroupSpec]
    ratio: list[int]  # per daemon gid
    views: dict[str, torch.Tensor]  # layer name -> int8 view [B, H, N, C]
    local: list[torch.Tensor]  # CUDA: the storages' tensors in this process (engine-side staging)
    storage_fds: list[int | None] | None = None  # CPU: per storage, its sealed memfd (None: a /dev/shm name)

    def expand(self, daemon_gid: int, block_ids: Sequence[int]) -> list[int]:
        """Manager block ids of ``daemon_gid`` -> the registered (kernel) block ids."""
        r = self.ratio[daemon_gid]
        if r == 1:
            return list(block_ids)
        return [b * r + i for b in block_ids for i in range(r)]


def _int8_view(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as int8 (C scaled by the element size; needs a contiguous last dim)."""
    return t.view(torch.int8)


def build_registration(kv_caches: Mapping[str, torch.Tensor], kv_cache_config,
                       groups: Sequence[TransferGroup]) -> Registration:
    """Describe the worker's KV-cache views for `Register`.

    Raises:
        ValueError: a layer of a cached group is missing from ``kv_caches``, is not a 4-D
            ``[B, H, N, C]`` view, has a block size that does not divide the group's, or (CPU)
            lives outside a shared-memory segment (the message says what to change).
    """
    from kvdepot.client.kvcache import export_cuda_storage

    storages: list[StorageSpec] = []
    storage_index: dict[object, int] = {}
    layers: list[LayerSpec] = []
    views: dict[str, torch.Tensor] = {}
    ratio: list[int] = []
    local: list[torch.Tensor] = []
    fds: list[int | None] = []  # CPU: per storage, its memfd or None
    device = "cpu"
    for g in groups:
        group = kv_cache_config.kv_cache_groups[g.vllm_gid]
        gid_ratio = None
        for name in g.layer_names:
            t = kv_caches.get(name)
            if t is None:
                raise ValueError(f"layer {name!r} of KV-cache group {g.vllm_gid} is not among the registered caches")
            if t.dim() != 4 or t.stride(-1) != 1:
                raise ValueError(f"layer {name!r}: expected a [B, H, N, C] view with contiguous C, got shape "
                                 f"{tuple(t.shape)} strides {t.stride()} (vLLM >= 0.33 layout)")
            v = _int8_view(t)
            nb, _, n, _ = v.shape
            if g.block_size % n:
                raise ValueError(f"layer {name!r}: {n} tokens per block does not divide the group's {g.block_size}")
            r = g.block_size // n
            if gid_ratio is None:
                gid_ratio = r
            elif r != gid_ratio:
                raise ValueError(f"KV-cache group {g.vllm_gid}: layers split blocks differently ({gid_ratio} vs {r})")
            spec = _layer_spec(group, name)
            if t.is_cuda:
                device = "cuda"
                st = t.untyped_storage()
                key = ("cuda", st.data_ptr())
                if key not in storage_index:
                    base = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))
                    storage_index[key] = len(storages)
                    storages.append(export_cuda_storage(base))
                    local.append(base)
                sid, offset = storage_index[key], t.data_ptr() - st.data_ptr()
            else:
                found = find_shm_segment(t)
                if found is None:
                    raise ValueError(
                        f"layer {name!r}: a CPU KV cache must live in shared memory for the daemon to reach it; "
                        "vLLM allocates it there through the connector's get_mem_pool_context() (CPU workers), "
                        "other engines call kvdepot.client.vllm.register_shm_segment(name, storage)")
                seg, size, offset, fd = found
                key = ("shm", seg)
                if key not in storage_index:
                    storage_index[key] = len(storages)
                    storages.append(StorageSpec(kind="memfd" if fd is not None else "shm", size_bytes=size,
                                                name="" if fd is not None else seg))
                    fds.append(fd)
                sid = storage_index[key]
            layers.append(LayerSpec(name=name, storage=sid, offset_bytes=offset, shape=list(v.shape),
                                    strides=list(v.stride()), dtype="int8", kv_dtype=dtype_name(spec.dtype),
                                    gid=g.daemon_gid, layout=LayerLayout.VLLM.value))
            views[name] = v
        ratio.append(gid_ratio or 1)
    kv_groups = [KVGroupSpec(gid=g.daemon_gid, tokens_per_block=g.block_size // ratio[g.daemon_gid]) for g in groups]
    if device == "cuda" and any(s.kind != "cuda_ipc" for s in storages):
        raise ValueError("KV-cache layers are split between CPU and CUDA memory")
    return Registration(device, storages, layers, kv_groups, ratio, views, local,
                        fds if any(fd is not None for fd in fds) else None)
