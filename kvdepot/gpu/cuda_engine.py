"""CUDA transfer engine: gathers chunks of engine KV blocks into a flat device staging buffer in
the canonical object format (one kernel launch per layer group per batch), and scatters them
back; staging <-> pinned host objects is then one contiguous copy per object.

Engine memory is given as raw device pointers (what `cudaIpcOpenMemHandle` returns in the
daemon, or ``tensor.data_ptr()`` in process), so this module needs no torch tensor of the
engine's memory. Without the kernel library the torch reference (`copy_blocks_torch`) runs on
tensors wrapped around the same pointers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdepot.gpu.kernels import Kernels, KvdGroupDesc, copy_blocks_torch, load_kernels
from kvdepot.gpu.layout import EngineLayout


class _DevicePtr:
    """A raw device allocation seen as a uint8 tensor through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, size_bytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size_bytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def tensor_at(ptr: int, size_bytes: int, device: torch.device) -> torch.Tensor:
    """uint8 tensor ``[size_bytes]`` over device memory at ``ptr`` (not owned)."""
    with torch.cuda.device(device):
        return torch.as_tensor(_DevicePtr(ptr, size_bytes), device=device)


class CudaTransferEngine:
    """Gather / scatter for one registration on one device.

    Args:
        layout: the registration's `EngineLayout`.
        storage_ptrs: device pointer of each storage (index = `LayerSpec.storage`).
        storage_sizes: bytes of each storage.
        device: the engine's CUDA device.
        use_kernels: False forces the torch fallback (tests compare both).
    """

    def __init__(self, layout: EngineLayout, storage_ptrs: Sequence[int], storage_sizes: Sequence[int],
                 device: torch.device, use_kernels: bool = True) -> None:
        self.layout = layout
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.kernels: Kernels | None = load_kernels() if use_kernels else None
        self.name = "cuda-kernels" if self.kernels else "cuda-torch"
        self._layer_ptrs = [[storage_ptrs[s] + off for s, off in g.offsets] for g in layout.groups]
        self._descs = [KvdGroupDesc.from_group(g, layout.object_bytes, layout.chunk_size) for g in layout.groups]
        if self.kernels is not None:  # device arrays of layer pointers for the kernels
            self._layer_ptrs_dev = [torch.tensor(p, dtype=torch.int64, device=device) for p in self._layer_ptrs]
        # widest word per group, for staging buffers aligned to 256 bytes (the caching allocator's
        # minimum); checked again per call
        self._vec = ([self.kernels.vec_bytes(d, p, 0) for d, p in zip(self._descs, self._layer_ptrs)]
                     if self.kernels is not None else [])
        if self.kernels is None:
            storages = [tensor_at(p, n, device) for p, n in zip(storage_ptrs, storage_sizes)]
            self._layer_tensors = [[storages[s][off:] for s, off in g.offsets] for g in layout.groups]

    def copy(self, staging: torch.Tensor, block_ids: Sequence[Sequence[int]], num_chunks: int, to_staging: bool,
             stream: torch.cuda.Stream, skip_tokens: int = 0) -> None:
        """Enqueue the copies of ``num_chunks`` chunks on ``stream`` (returns at once).

        Args:
            staging: uint8 device tensor of at least ``num_chunks * object_bytes``; chunk j is
                object j.
            block_ids: per gid, ``num_chunks * chunk_size // tokens_per_block[gid]`` ids, token order
                (range-checked by the caller).
            to_staging: gather (engine -> staging) if True, else scatter.
            skip_tokens: leading tokens (from chunk 0) whose blocks are not touched.
        """
        lay = self.layout
        assert staging.numel() >= num_chunks * lay.object_bytes, "staging too small"
        for gi, g in enumerate(lay.groups):
            bpc = lay.chunk_size // g.view.block_size
            total = num_chunks * bpc
            first = min(skip_tokens // g.view.block_size, total)
            ids = block_ids[g.gid]
            if self.kernels is not None:
                desc = self._descs[gi]
                vec = self._vec[gi]
                if staging.data_ptr() % vec:
                    vec = self.kernels.vec_bytes(desc, self._layer_ptrs[gi], staging.data_ptr())
                self.kernels.copy_blocks(desc, self._layer_ptrs_dev[gi].data_ptr(), ids, first, total - first,
                                         staging.data_ptr(), to_staging, vec, self.device.index, stream.cuda_stream)
            else:
                with torch.cuda.stream(stream):
                    copy_blocks_torch(g, self._layer_tensors[gi], ids, first, total - first, staging,
                                      lay.object_bytes, lay.chunk_size, to_staging)
