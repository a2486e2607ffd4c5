"""POSIX shared memory for CPU engines' KV caches (files under /dev/shm, mapped MAP_SHARED).

The engine creates the segment and owns its name (`create_shm` / `unlink_shm`); the daemon
maps it by name (`open_shm`). Mappings are torch tensors made by ``torch.from_file(...,
shared=True)``: the mapping lives exactly as long as the tensor, so the daemon unmaps an
engine's memory by dropping its last reference (no ``BufferError`` from an open export).
Python's ``multiprocessing.shared_memory`` is not used: on Python < 3.13 its resource
tracker unlinks segments that a non-owning process merely attached to.
"""

from __future__ import annotations

import os
import re

import torch

from kvdepot.protocol.errors import ErrorCode, RequestError

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")


def shm_path(name: str) -> str:
    """Path of a segment; ``name`` may carry a leading ``/`` (POSIX style).

    Raises:
        RequestError(ENGINE_MEMORY): the name contains characters other than letters, digits,
            ``_ . -`` (no paths).
    """
    bare = name.removeprefix("/")
    if not _NAME_RE.match(bare) or bare in (".", ".."):
        raise RequestError(ErrorCode.ENGINE_MEMORY, f"invalid shared-memory name {name!r}")
    return os.path.join(SHM_DIR, bare)


def create_shm(name: str, size_bytes: int) -> torch.Tensor:
    """Create (or replace) a zero-filled segment and map it: uint8 tensor ``[size_bytes]``."""
    path = shm_path(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size_bytes)
    finally:
        os.close(fd)
    return torch.from_file(path, shared=True, size=size_bytes, dtype=torch.uint8)


def open_shm(name: str, size_bytes: int) -> torch.Tensor:
    """Map an existing segment of at least ``size_bytes``: uint8 tensor ``[size_bytes]``.

    Raises:
        RequestError(ENGINE_MEMORY): missing segment or smaller than ``size_bytes``.
    """
    path = shm_path(name)
    try:
        actual = os.stat(path).st_size
    except OSError as exc:
        raise RequestError(ErrorCode.ENGINE_MEMORY, f"cannot open shared memory {name!r}: {exc.strerror}") from None
    if actual < size_bytes:
        raise RequestError(
            ErrorCode.ENGINE_MEMORY, f"shared memory {name!r} has {actual} bytes, registration says {size_bytes}")
    return torch.from_file(path, shared=True, size=size_bytes, dtype=torch.uint8)


def unlink_shm(name: str) -> None:
    """Remove a segment's name (mappings stay valid until unmapped). Missing is fine."""
    try:
        os.unlink(shm_path(name))
    except FileNotFoundError:
        pass
