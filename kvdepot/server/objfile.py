"""The on-disk format of one cached chunk object (the L2 tier's files).

A file is a 4096-byte header followed by the payload (the object's bytes exactly as L1 holds
them, kvdepot's canonical chunk format), zero-padded to a multiple of 4096 bytes so that reads
and writes can be O_DIRECT::

    offset  bytes  field
    0       8      magic b"KVDPOBJ\\0"
    8       4      format version (`FORMAT_VERSION`), little-endian u32
    12      4      meta length M, u32
    16      8      payload bytes P, u64 (the object's exact size; the padding is never read)
    24      16     xxh3-128 of the P payload bytes
    40      8      xxh3-64 of bytes [0, 40) and the meta (guards the header itself)
    48      M      meta: msgpack map {key, parent, model, cache_salt, fingerprint}
    48+M    ...    zeros up to 4096
    4096    P'     payload, P' = P rounded up to 4096

Every read verifies the header (magic, version, header checksum, the key and size the caller
expects, the file's length) and the payload's checksum, so a torn, truncated, stale or
bit-flipped file is reported as `CorruptObject`, never returned. Checksums are xxh3 from the
maintained `xxhash` package (it releases the GIL: I/O threads hash in parallel with the loop).
"""

from __future__ import annotations

import dataclasses
import struct

import msgspec
import xxhash

MAGIC = b"KVDPOBJ\0"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
PAGE_BYTES = 4096
_FIXED = struct.Struct("<8sIIQ16s")  # magic, version, meta length, payload bytes, payload checksum
_FIXED_BYTES = _FIXED.size + 8  # + header checksum (u64)


class CorruptObject(Exception):
    """A file that is not a complete, intact object of the expected key and size."""


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What a file says about its object (header fields)."""

    key: bytes  # chunk key
    parent: bytes  # key of the chunk before it; b"" for chunk 0
    model: str
    cache_salt: str
    fingerprint: str  # layout fingerprint of the registration that stored it
    size_bytes: int  # payload bytes
    checksum: bytes  # xxh3-128 digest of the payload (16 bytes)


def padded(size_bytes: int) -> int:
    """``size_bytes`` rounded up to a multiple of `PAGE_BYTES`."""
    return (size_bytes + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES


def file_bytes(size_bytes: int) -> int:
    """Length of the file of an object of ``size_bytes`` payload bytes."""
    return HEADER_BYTES + padded(size_bytes)


def payload_checksum(payload) -> bytes:
    """xxh3-128 digest (16 bytes) of a bytes-like payload."""
    return xxhash.xxh3_128_digest(payload)


def encode_header(meta: ObjectMeta, out) -> None:
    """Write ``meta``'s header into ``out`` (a writable buffer of `HEADER_BYTES`).

    Raises:
        ValueError: the meta does not fit in a header.
    """
    body = msgspec.msgpack.encode({"key": meta.key, "parent": meta.parent, "model": meta.model,
                                   "cache_salt": meta.cache_salt, "fingerprint": meta.fingerprint})
    if _FIXED_BYTES + len(body) > HEADER_BYTES:
        raise ValueError(f"object meta of {len(body)} bytes does not fit in a {HEADER_BYTES}-byte header")
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, len(body), meta.size_bytes, meta.checksum)
    h = xxhash.xxh3_64_intdigest(fixed + body)
    view = memoryview(out)
    view[: _FIXED.size] = fixed
    view[_FIXED.size : _FIXED_BYTES] = h.to_bytes(8, "little")
    view[_FIXED_BYTES : _FIXED_BYTES + len(body)] = body
    view[_FIXED_BYTES + len(body) : HEADER_BYTES] = bytes(HEADER_BYTES - _FIXED_BYTES - len(body))


def decode_header(header, file_size: int | None = None) -> ObjectMeta:
    """The meta of a header (the first `HEADER_BYTES` of a file).

    ``file_size``: the file's length, checked against the payload size it announces.

    Raises:
        CorruptObject: wrong magic or version, a header checksum mismatch, undecodable meta, or
            a file length that does not match.
    """
    view = memoryview(header)
    if len(view) < HEADER_BYTES:
        raise CorruptObject(f"header truncated: {len(view)} of {HEADER_BYTES} bytes")
    magic, version, meta_len, size, checksum = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CorruptObject("not a kvdepot object (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptObject(f"object format {version}, this kvdepot reads {FORMAT_VERSION}")
    if _FIXED_BYTES + meta_len > HEADER_BYTES:
        raise CorruptObject(f"meta length {meta_len} beyond the header")
    body = bytes(view[_FIXED_BYTES : _FIXED_BYTES + meta_len])
    want = int.from_bytes(view[_FIXED.size : _FIXED_BYTES], "little")
    if xxhash.xxh3_64_intdigest(bytes(view[: _FIXED.size]) + body) != want:
        raise CorruptObject("header checksum mismatch")
    if file_size is not None and file_size != file_bytes(size):
        raise CorruptObject(f"file is {file_size} bytes, a {size}-byte object needs {file_bytes(size)}")
    try:
        d = msgspec.msgpack.decode(body)
        return ObjectMeta(bytes(d["key"]), bytes(d["parent"]), str(d["model"]), str(d["cache_salt"]),
                          str(d["fingerprint"]), size, checksum)
    except (msgspec.DecodeError, KeyError, TypeError) as exc:
        raise CorruptObject(f"undecodable meta: {exc}") from None
