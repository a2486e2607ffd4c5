"""Shared memory for CPU engines' KV caches, mapped MAP_SHARED by engine and daemon.

Two kinds:

* **sealed memfds** (`create_memfd` / `open_memfd`): the engine creates an anonymous memfd,
  sizes it and seals it against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW |
  F_SEAL_SEAL``), then passes the descriptor to the daemon over its ``PATH.fds`` socket
  (``SCM_RIGHTS``, `kvdepot.protocol.fdpass`). Nobody, the engine included, can make the file
  smaller afterwards, so a daemon copy can never touch a page beyond its end: no SIGBUS by
  construction. The daemon refuses a memfd without ``F_SEAL_SHRINK``.
* **named segments** (`create_shm` / `open_shm`): files under /dev/shm the daemon maps by
  name. A segment shrunk while the daemon copies from it would fault the copy (SIGBUS): the
  daemon checks sizes before each transfer (`Registration.check_memory`), which narrows but
  cannot close that window. Kept for clients that cannot pass descriptors; the daemon accepts
  them only with ``--allow-shm-names``. Mappings are torch tensors made by ``torch.from_file(...,
shared=True)``: the mapping lives exactly as long as the tensor, so the daemon unmaps an
engine's memory by dropping its last reference (no ``BufferError`` from an open export).
Python's ``multiprocessing.shared_memory`` is not used: on Python < 3.13 its resource
tracker unlinks segments that a non-owning process merely attached to.
"""

from __future__ import annotations

import fcntl
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


SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # what `create_memfd` sets


def create_memfd(name: str, size_bytes: int) -> tuple[int, torch.Tensor]:
    """A zero-filled anonymous memfd of ``size_bytes``, sealed against any size change, and its
    mapping: ``(fd, uint8 tensor [size_bytes])``. The caller owns ``fd`` (close it when the
    cache is dropped; the mapping stays valid without it). ``name`` only labels it in /proc.

    Raises:
        OSError: the kernel has no memfd sealing (Linux < 3.17) or memory ran out.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size_bytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        return fd, torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size_bytes, dtype=torch.uint8)
    except BaseException:
        os.close(fd)
        raise


def open_memfd(fd: int, size_bytes: int) -> torch.Tensor:
    """Map a memfd an engine passed (the daemon's side): uint8 tensor ``[size_bytes]``.

    Raises:
        RequestError(ENGINE_MEMORY): not a sealable file, not sealed against shrinking, or
            smaller than ``size_bytes``.
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        actual = os.fstat(fd).st_size
    except OSError as exc:
        raise RequestError(ErrorCode.ENGINE_MEMORY, f"the passed descriptor is not a memfd: {exc.strerror}") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise RequestError(ErrorCode.ENGINE_MEMORY, "the passed memfd is not sealed against shrinking "
                                                    "(F_SEAL_SHRINK): a copy could fault; see kvdepot.gpu.shm")
    if actual < size_bytes:
        raise RequestError(ErrorCode.ENGINE_MEMORY, f"the passed memfd has {actual} bytes, registration says "
                                                    f"{size_bytes}")
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size_bytes, dtype=torch.uint8)
