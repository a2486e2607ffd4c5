"""Paged KV caches in POSIX shared memory, laid out the way vLLM lays them out on a GPU.

This is what a CPU engine (and the demo and tests) uses to hold its KV where the daemon can
reach it, and to describe it in a `Register` message.

Layouts (``ShmKVCache.layout``):

* vLLM >= 0.33 standardized layout, one int8 allocation, each layer an int8 view
  ``[num_blocks, H, N, C]`` (C = K|V bytes of one head), physical order one of
  ``LBNHC`` (NHD, vLLM's default), ``LBHNC`` (HND), ``BLNHC``, ``BLHNC``.
* legacy per-layer tensors (each at its own offset in the same segment):
  ``flash_attn_nhd`` ``(2, NB, N, H, D)``, ``flash_attn_hnd`` (same shape, stride order
  (0, 1, 3, 2, 4)), ``flashinfer`` ``(NB, 2, N, H, D)``, ``mla`` ``(NB, N, R)``.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
import weakref
from collections.abc import Sequence

import torch

from kvdepot.gpu.layout import LayerLayout, dtype_name
from kvdepot.gpu.shm import create_memfd, create_shm, unlink_shm
from kvdepot.protocol.messages import KVGroupSpec, LayerSpec, StorageSpec

VLLM_ORDERS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC")
LEGACY_LAYOUTS = ("flash_attn_nhd", "flash_attn_hnd", "flashinfer", "mla")
ALL_LAYOUTS = VLLM_ORDERS + LEGACY_LAYOUTS


@dataclasses.dataclass(frozen=True)
class KVGroupShape:
    """Shape of one KV-cache group's layers.

    For dense attention a token of one layer is ``num_heads`` x (K, V) x ``head_dim`` values of
    ``dtype``. With ``mla=True`` it is one row of ``head_dim`` values (e.g. 576 bf16, or 656
    uint8 for fp8_ds_mla byte-packed rows) and ``num_heads`` must be 1.
    """

    gid: int
    num_layers: int
    num_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: torch.dtype = torch.bfloat16
    mla: bool = False

    @property
    def row_bytes(self) -> int:
        return self.head_dim * self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one layer."""
        return self.num_heads * (1 if self.mla else 2) * self.row_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return self.tokens_per_block * self.token_bytes


def export_cuda_storage(t: torch.Tensor) -> StorageSpec:
    """`StorageSpec` of the CUDA allocation holding tensor ``t`` (whose first byte is the
    storage's byte 0): a ``cudaIpcMemHandle_t`` of the caching allocator's block, the storage's
    offset in it, and the GPU's UUID (the daemon matches GPUs by UUID, never by ordinal).
    Layer offsets are then relative to ``t.data_ptr()``."""
    st = t.untyped_storage()
    shared = st._share_cuda_()  # (device, handle, size, offset in the block, ...)
    dev, handle, offset = shared[0], bytes(shared[1]), shared[3]
    if len(handle) == 66:
        # torch >= 2.5 prefixes the cudaIpcMemHandle_t with a version byte and a type byte:
        # 'c' = cudaMalloc'ed block (64-byte IPC handle follows), 'e' = expandable segment
        if handle[1:2] != b"c":
            raise ValueError("KV cache lives in an expandable segment; CUDA IPC needs "
                             "PYTORCH_CUDA_ALLOC_CONF without expandable_segments:True")
        handle = handle[2:]
    uuid = str(torch.cuda.get_device_properties(dev).uuid)
    return StorageSpec(kind="cuda_ipc", size_bytes=st.nbytes() - t.storage_offset() * t.element_size(),
                       handle=handle, device_uuid=uuid,
                       handle_offset_bytes=offset + t.storage_offset() * t.element_size())


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


class ShmKVCache:
    """A paged KV cache for several KV-cache groups in one shared-memory segment.

    Args:
        groups: the model's groups (gid 0..G-1), layers listed group by group.
        num_blocks: blocks per layer, one number for all gids or one per gid.
        layout: one of `ALL_LAYOUTS`.
        name: shared-memory name (default: a fresh unique name). The segment is unlinked by
            `close` (or, failing that, when the object is collected or the interpreter exits).
        device: ``"cuda"`` for a CUDA cache (shared by IPC handle); default CPU shared memory.
        sealed: CPU: an anonymous memfd sealed against any size change (``fd``; pass
            `storage_fds` to ``KVDepotClient.register``), so the daemon's copies can never fault
            on a shrunk segment (`kvdepot.gpu.shm`). False: a named /dev/shm segment, which a
            daemon accepts only with ``--allow-shm-names``.

    Attributes:
        storage: uint8 tensor over the whole segment.
        layer_names: ``layer.{i}`` in model order (gid-major).
        layer_gids: gid of each layer.
        engine_tensors: each layer's tensor as the engine would hold it (see module doc).
    """

    def __init__(self, groups: Sequence[KVGroupShape], num_blocks: int | Sequence[int], layout: str = "LBNHC",
                 name: str | None = None, device: str | torch.device | None = None, sealed: bool = True) -> None:
        if layout not in ALL_LAYOUTS:
            raise ValueError(f"layout {layout!r} not in {ALL_LAYOUTS}")
        self.groups = sorted(groups, key=lambda g: g.gid)
        if [g.gid for g in self.groups] != list(range(len(self.groups))):
            raise ValueError("gids must be 0..G-1")
        nbs = [num_blocks] * len(self.groups) if isinstance(num_blocks, int) else list(num_blocks)
        self.num_blocks = nbs
        self.layout = layout
        self.name = name or f"kvdepot-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        layers = [(g, nbs[g.gid]) for g in self.groups for _ in range(g.num_layers)]
        if layout in VLLM_ORDERS and any(g.mla for g in self.groups):
            raise ValueError("use layout 'mla' for MLA groups")
        self._plan: list[tuple[int, tuple, tuple, torch.dtype]] = []  # offset, shape, strides(elements), dtype
        if layout in VLLM_ORDERS:
            page = max(g.page_bytes for g, _ in layers)
            max_nb = max(nb for _, nb in layers)
            L = len(layers)
            size = _align(L * max_nb * page)
            for li, (g, nb) in enumerate(layers):
                h, n, c = g.num_heads, g.tokens_per_block, 2 * g.row_bytes
                if layout.startswith("LB"):
                    off, s_b = li * max_nb * page, page
                else:
                    off, s_b = li * page, L * page
                s_h, s_n = (c, h * c) if layout.endswith("NHC") else (n * c, c)
                self._plan.append((off, (nb, h, n, c), (s_b, s_h, s_n, 1), torch.int8))
        else:
            off = 0
            for g, nb in layers:
                h, n, d = g.num_heads, g.tokens_per_block, g.head_dim
                if layout == "flash_attn_nhd":
                    shape = (2, nb, n, h, d)
                    strides = (nb * n * h * d, n * h * d, h * d, d, 1)
                elif layout == "flash_attn_hnd":
                    shape = (2, nb, n, h, d)
                    strides = (nb * h * n * d, h * n * d, d, n * d, 1)
                elif layout == "flashinfer":
                    shape = (nb, 2, n, h, d)
                    strides = (2 * n * h * d, n * h * d, h * d, d, 1)
                else:
                    if not g.mla or h != 1:
                        raise ValueError("layout 'mla' needs mla=True groups with num_heads=1")
                    shape = (nb, n, d)
                    strides = (n * d, d, 1)
                if layout != "mla" and g.mla:
                    raise ValueError("MLA groups need layout 'mla'")
                self._plan.append((off, shape, strides, g.dtype))
                off = _align(off + nb * g.page_bytes)
            size = _align(off)
        self.size_bytes = max(size, 4096)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.fd: int | None = None  # the sealed memfd (sealed=True), else None
        if self.device.type == "cuda":
            # one device allocation, shared with the daemon by CUDA IPC handle (vLLM 0.33 style)
            self.storage = torch.zeros(self.size_bytes, dtype=torch.uint8, device=self.device)
        elif sealed:
            # an anonymous memfd sealed against shrinking: nothing can fault the daemon's copies
            self.fd, self.storage = create_memfd(self.name, self.size_bytes)
            self._unlink = weakref.finalize(self, os.close, self.fd)
            self.storage.zero_()
        else:
            self.storage = create_shm(self.name, self.size_bytes)
            # unlinked by close(), else when this object is collected or the interpreter exits:
            # a forgotten close() must not hold the segment's memory until the machine reboots
            self._unlink = weakref.finalize(self, unlink_shm, self.name)
            self.storage.zero_()  # commit the pages now, as an engine does when it allocates its cache
        self.layer_names = [f"layer.{i}" for i in range(len(layers))]
        self.layer_gids = [g.gid for g, _ in layers]
        self._layer_groups = [g for g, _ in layers]
        self.engine_tensors = [
            torch.as_strided(self.storage[off:].view(dt), shape, strides)
            for off, shape, strides, dt in self._plan
        ]

    # ------------------------------------------------------------------ description

    @property
    def register_device(self) -> str:
        """``Register.device`` for this cache: ``"cpu"`` or ``"cuda"``."""
        return "cuda" if self.device.type == "cuda" else "cpu"

    def storage_specs(self) -> list[StorageSpec]:
        if self.device.type == "cuda":
            return [export_cuda_storage(self.storage)]
        if self.fd is not None:
            return [StorageSpec(kind="memfd", size_bytes=self.size_bytes)]
        return [StorageSpec(kind="shm", size_bytes=self.size_bytes, name=self.name)]

    def storage_fds(self) -> list[int | None] | None:
        """``KVDepotClient.register``'s ``storage_fds`` for this cache (None unless sealed)."""
        return None if self.fd is None else [self.fd]

    def group_specs(self) -> list[KVGroupSpec]:
        return [KVGroupSpec(gid=g.gid, tokens_per_block=g.tokens_per_block) for g in self.groups]

    def layer_specs(self) -> list[LayerSpec]:
        wire_layout = {
            "flash_attn_nhd": LayerLayout.FLASH_ATTN, "flash_attn_hnd": LayerLayout.FLASH_ATTN,
            "flashinfer": LayerLayout.FLASHINFER, "mla": LayerLayout.MLA,
        }.get(self.layout, LayerLayout.VLLM).value
        return [
            LayerSpec(name=name, storage=0, offset_bytes=off, shape=list(shape), strides=list(strides),
                      dtype=dtype_name(dt), kv_dtype=dtype_name(g.dtype), gid=g.gid, layout=wire_layout)
            for name, g, (off, shape, strides, dt) in zip(self.layer_names, self._layer_groups, self._plan)
        ]

    # ------------------------------------------------------------------ logical access

    def token_view(self, layer: int, as_bytes: bool = False) -> torch.Tensor:
        """Layer ``layer``'s KV as ``[num_blocks, N, H, KV, D]`` (KV = 2 for K, V; 1 for MLA),
        a strided view over the shared memory in the group's dtype (uint8 and D = row bytes
        with ``as_bytes``). Writing into it writes the engine's cache."""
        g = self._layer_groups[layer]
        off, shape, strides, dt = self._plan[layer]
        es = dt.itemsize
        byte_strides = [s * es for s in strides]
        if self.layout in VLLM_ORDERS:
            nb, h, n, c = shape
            s_b, s_h, s_n, _ = byte_strides
            dims = (nb, n, h, 2, c // 2)
            bstr = (s_b, s_n, s_h, c // 2, 1)
        elif self.layout.startswith("flash_attn"):
            two, nb, n, h, d = shape
            dims = (nb, n, h, 2, d * es)
            bstr = (byte_strides[1], byte_strides[2], byte_strides[3], byte_strides[0], 1)
        elif self.layout == "flashinfer":
            nb, two, n, h, d = shape
            dims = (nb, n, h, 2, d * es)
            bstr = (byte_strides[0], byte_strides[2], byte_strides[3], byte_strides[1], 1)
        else:
            nb, n, r = shape
            dims = (nb, n, 1, 1, r * es)
            bstr = (byte_strides[0], byte_strides[1], 0, 0, 1)
        if as_bytes:
            return torch.as_strided(self.storage, dims, bstr, off)
        ges = g.dtype.itemsize
        assert off % ges == 0 and all(s % ges == 0 for s in bstr[:-1]), "unaligned layer view"
        words = self.storage[: self.size_bytes // ges * ges].view(g.dtype)
        return torch.as_strided(words, (*dims[:-1], dims[-1] // ges), tuple(s // ges for s in bstr[:-1]) + (1,),
                                off // ges)

    def read_tokens(self, layer: int, block_ids: Sequence[int], as_bytes: bool = False) -> torch.Tensor:
        """Copy out the tokens held by ``block_ids`` (in order): ``[T, H, KV, D]``."""
        v = self.token_view(layer, as_bytes)
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=v.device)
        out = v.index_select(0, idx)
        return out.reshape(-1, *out.shape[2:])

    def write_tokens(self, layer: int, block_ids: Sequence[int], data: torch.Tensor, as_bytes: bool = False) -> None:
        """Write ``data`` ``[T, H, KV, D]`` (T = len(block_ids) * N) into ``block_ids``."""
        v = self.token_view(layer, as_bytes)
        n = v.shape[1]
        data = data.reshape(len(block_ids), n, *v.shape[2:]).to(v.device)
        v.index_copy_(0, torch.as_tensor(list(block_ids), dtype=torch.long, device=v.device), data)

    def close(self) -> None:
        """Unlink the segment, or close the memfd (the mapping lives on until this object is
        dropped)."""
        if self.device.type != "cuda":
            self._unlink()

    def __enter__(self) -> ShmKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
