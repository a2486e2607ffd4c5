"""The L2 tier on its own: the object file format (every kind of damage is `CorruptObject`),
and `DiskTier` driven from an asyncio loop as the daemon drives it (write-behind, verified
reads, capacity eviction, flush, the start-up scan after a restart, one daemon per directory)."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
from pathlib import Path

import pytest

from kvdepot.server.disk import DiskState, DiskTier
from kvdepot.server.objfile import (HEADER_BYTES, CorruptObject, ObjectMeta, decode_header, encode_header, file_bytes,
                                    padded, payload_checksum)

SIZE = 3 * 4096 + 100  # not a multiple of a page: padding is exercised


def meta(key: bytes = b"k" * 16, size: int = SIZE) -> ObjectMeta:
    return ObjectMeta(key, b"p" * 16, "model-a", "salt", "fp1234", size, b"c" * 16)


def test_header_round_trip_and_damage():
    hdr = bytearray(HEADER_BYTES)
    encode_header(meta(), hdr)
    assert decode_header(hdr, file_bytes(SIZE)) == meta()
    with pytest.raises(CorruptObject, match="file is"):
        decode_header(hdr, file_bytes(SIZE) - 4096)  # truncated payload
    for pos in (0, 9, 20, 30, 60):  # magic, version, size, payload checksum, meta
        bad = bytearray(hdr)
        bad[pos] ^= 0x10
        with pytest.raises(CorruptObject):
            decode_header(bad, file_bytes(SIZE))
    with pytest.raises(CorruptObject, match="truncated"):
        decode_header(hdr[:100])
    with pytest.raises(ValueError, match="does not fit"):
        encode_header(ObjectMeta(b"k", b"", "m" * 5000, "", "", 1, b"c" * 16), bytearray(HEADER_BYTES))


class Harness:
    """A DiskTier on a loop, with an 'L1' of page-aligned buffers."""

    def __init__(self, path: Path, capacity_bytes: int = 1 << 20, queue_bytes: int = 1 << 20,
                 direct_io: bool | None = None) -> None:
        self.tier = DiskTier(str(path), capacity_bytes, queue_bytes, io_threads=2, direct_io=direct_io)
        self.found = self.tier.open()
        self.loop = asyncio.new_event_loop()
        self.tier.attach(self.loop)
        self.freed: list[bytes] = []

    def payload(self, seed: int, size: int = SIZE) -> mmap.mmap:
        buf = mmap.mmap(-1, padded(size))
        buf[:size] = bytes((seed * 7 + i) % 251 for i in range(size))
        buf[size:] = b"\xee" * (padded(size) - size)  # stale bytes after the object: must not matter
        return buf

    def write(self, key: bytes, seed: int, size: int = SIZE, parent: bytes = b"") -> bool:
        buf = self.payload(seed, size)
        return self.tier.write(key, parent, "model-a", "salt", "fp", memoryview(buf), size,
                               lambda: self.freed.append(key))

    def settle(self) -> None:
        async def wait():
            while self.tier.queued_writes:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.02)  # unlinks submitted by completions
        self.loop.run_until_complete(wait())

    def read(self, key: bytes) -> bytes | BaseException:
        e = self.tier.ready(key)
        assert e is not None
        out = mmap.mmap(-1, padded(e.size_bytes))
        fut = self.loop.create_future()
        self.tier.read(e, memoryview(out), fut.set_result)
        err = self.loop.run_until_complete(fut)
        return err if err is not None else bytes(out[: e.size_bytes])

    def close(self) -> None:
        self.tier.close()
        self.loop.close()


@pytest.fixture
def make(tmp_path):
    made = []

    def m(**kw) -> Harness:
        h = Harness(tmp_path / "l2", **kw)
        made.append(h)
        return h

    yield m
    for h in made:
        if not h.loop.is_closed():
            h.close()


def files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "l2" / "objects").glob("*/*.kvd"))


@pytest.mark.parametrize("direct_io", [None, False])
def test_write_read_verified_and_found_after_restart(make, tmp_path, direct_io):
    h = make(direct_io=direct_io)
    keys = [bytes([i]) * 16 for i in range(5)]
    for i, k in enumerate(keys):
        assert h.write(k, i, parent=keys[i - 1] if i else b"")
    assert not h.write(keys[0], 9), "a key already in L2 is not written again"
    assert h.tier.get(keys[0]).state is DiskState.WRITING
    h.settle()
    assert sorted(h.freed) == keys, "each write frees its L1 extent once done"
    assert len(h.tier) == 5 and h.tier.used_bytes == 5 * file_bytes(SIZE)
    for i, k in enumerate(keys):
        assert h.read(k) == bytes(h.payload(i)[:SIZE])
    assert all(p.stat().st_size == file_bytes(SIZE) for p in files(tmp_path))
    # padding on disk is zeros, not the stale bytes after the object in its L1 extent
    raw = files(tmp_path)[0].read_bytes()
    assert raw[HEADER_BYTES + SIZE:] == bytes(padded(SIZE) - SIZE)
    h.close()
    h2 = make(direct_io=direct_io)
    assert h2.found == 5 and h2.tier.ready(keys[3]).parent == keys[2]
    assert h2.read(keys[4]) == bytes(h2.payload(4)[:SIZE])


def test_damaged_files_are_never_served(make, tmp_path):
    h = make()
    keys = [bytes([i]) * 16 for i in range(4)]
    for i, k in enumerate(keys):
        h.write(k, i)
    h.settle()
    by_key = {bytes.fromhex(p.name.split(".")[0]): p for p in files(tmp_path)}
    with open(by_key[keys[0]], "r+b") as f:  # one payload bit
        f.seek(HEADER_BYTES + 1234)
        b = f.read(1)
        f.seek(HEADER_BYTES + 1234)
        f.write(bytes([b[0] ^ 1]))
    os.truncate(by_key[keys[1]], file_bytes(SIZE) - 4096)  # truncated
    by_key[keys[2]].unlink()  # vanished
    for k in keys[:3]:
        assert isinstance(h.read(k), CorruptObject)
        assert h.tier.get(k) is None, "a bad object is dropped"
    assert h.tier.counters.corrupt == 3
    assert h.read(keys[3]) == bytes(h.payload(3)[:SIZE])
    h.settle()
    assert [p.name.split(".")[0] for p in files(tmp_path)] == [keys[3].hex()], "bad files are deleted"
    # a flipped header byte is found by the start-up scan
    with open(files(tmp_path)[0], "r+b") as f:
        f.seek(70)
        b = f.read(1)
        f.seek(70)
        f.write(bytes([b[0] ^ 1]))
    (tmp_path / "l2" / "tmp" / "torn.kvd").write_bytes(b"half a write")
    h.close()
    h2 = make()
    assert h2.found == 0 and h2.tier.counters.corrupt == 1
    assert files(tmp_path) == [] and list((tmp_path / "l2" / "tmp").iterdir()) == []


def test_capacity_evicts_lru_never_a_read_in_progress(make):
    fb = file_bytes(SIZE)
    h = make(capacity_bytes=3 * fb)
    keys = [bytes([i]) * 16 for i in range(5)]
    for i in range(3):
        assert h.write(keys[i], i)
    h.settle()
    h.tier.touch_chain([keys[0]])  # keys[1] is now the LRU
    e1 = h.tier.ready(keys[1])
    h.tier.acquire(e1)  # e.g. pinned by a lookup
    assert h.write(keys[3], 3)
    h.settle()
    assert h.tier.get(keys[2]) is None and h.tier.get(keys[1]) is e1, "LRU evicted, the pinned one kept"
    h.tier.release(e1)
    assert h.tier.used_bytes == 3 * fb and h.tier.counters.evictions == 1
    big = 4 * fb
    assert not h.write(keys[4], 4, size=big), "larger than the whole tier"
    assert h.tier.counters.dropped_writes == 1


def test_queue_bound_drops_writes(make):
    h = make(queue_bytes=2 * padded(SIZE))
    assert h.write(b"a" * 16, 1) and h.write(b"b" * 16, 2)
    assert not h.write(b"c" * 16, 3), "a third queued write is over the bound"
    assert h.tier.counters.dropped_writes == 1
    h.settle()
    assert h.write(b"c" * 16, 3)
    h.settle()
    assert len(h.tier) == 3


def test_flush_while_writing_and_while_reading(make, tmp_path):
    h = make()
    h.write(b"a" * 16, 1)
    assert h.tier.drop_where(lambda e: True) == (1, file_bytes(SIZE))  # still WRITING
    h.settle()
    assert files(tmp_path) == [] and len(h.tier) == 0 and h.tier.used_bytes == 0
    h.write(b"b" * 16, 2)
    h.settle()
    e = h.tier.ready(b"b" * 16)
    h.tier.acquire(e)
    h.tier.drop_where(lambda e: e.model == "model-a")
    h.settle()
    assert len(files(tmp_path)) == 1, "a file in use stays until released"
    h.tier.release(e)
    h.settle()
    assert files(tmp_path) == []


def test_one_daemon_per_directory(make, tmp_path):
    make()
    with pytest.raises(OSError) as ei:
        Harness(tmp_path / "l2")
    assert ei.value.errno == errno.EBUSY and "in use by another kvdepot daemon" in str(ei.value)


def test_checksum_is_of_the_payload_only():
    a = bytes(range(256)) * 10
    assert payload_checksum(a) == payload_checksum(memoryview(bytearray(a)))
    assert payload_checksum(a) != payload_checksum(a[:-1] + b"\x00")
