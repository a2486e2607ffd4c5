"""L2 tier: chunk objects as files in one local directory, found again after a restart.

Layout of the directory (``--l2-path``)::

    lock                       flock-ed by the daemon using it (one daemon per directory)
    tmp/                       files being written (removed at start: a crash mid-write)
    objects/<hh>/<key hex>.<tag>.kvd   one object each (format: `kvdepot.server.objfile`)

A file appears under ``objects/`` only complete (written under ``tmp/``, then renamed), and
every read verifies its header and payload checksum, so neither a SIGKILL mid-write nor a torn
or bit-flipped file is ever served: a bad object is dropped, its file deleted and counted in
``kvdepot_corrupt_objects_total{tier="l2"}``. At start the directory is scanned (headers only)
and every intact object is indexed again, least recently used first by file mtime (a hit
touches its file).

Threading: the index is owned by the event loop; file I/O (write, read, unlink, the start-up
scan) runs on the tier's own thread pool, and completions come back to the loop through
``run_in_executor`` futures. Reads and writes are O_DIRECT where the filesystem supports it
(``direct_io=None``): a disk tier ten times the size of DRAM gains nothing from the page cache,
which would also count against a container's memory limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import errno
import fcntl
import logging
import mmap
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import msgspec

from kvdepot.server.quotas import TenantLedger
from kvdepot.server.objfile import (HEADER_BYTES, CorruptObject, ObjectMeta, decode_header, encode_header, file_bytes,
                                    padded, payload_checksum)

log = logging.getLogger("kvdepot.l2")


class DiskState(enum.Enum):
    WRITING = 1  # file being written; invisible
    READY = 2  # complete on disk; visible
    DOOMED = 3  # out of the index; its file is deleted once no read uses it (or its write ended)


class DiskEntry(msgspec.Struct, gc=False, eq=False):
    """One object in L2 (never tracked by the garbage collector, as `kvdepot.server.index.Entry`:
    an L2 of millions of chunks would make every full collection stall the daemon)."""

    key: bytes
    parent: bytes
    model: str
    cache_salt: str
    fingerprint: str
    size_bytes: int  # payload bytes
    path: str
    checksum: bytes = b""  # xxh3-128 of the payload, once known (written or scanned)
    state: DiskState = DiskState.WRITING
    readers: int = 0  # reads in progress + lookup pins: block eviction and deletion

    @property
    def file_bytes(self) -> int:
        return file_bytes(self.size_bytes)


@dataclasses.dataclass
class TierCounters:
    """What a tier counts (read by `describe`; the daemon mirrors them into /metrics cells)."""

    hits: int = 0  # chunks a lookup or retrieve found first in this tier
    read_bytes: int = 0
    written_bytes: int = 0
    dropped_writes: int = 0  # writes not made: queue full, or no evictable room
    errors: int = 0  # I/O errors (the object is dropped; nothing wrong is served)
    corrupt: int = 0  # objects that failed verification (dropped, file deleted)
    evictions: int = 0


class DiskTier:
    """The L2 tier (see the module docstring).

    Args:
        path: directory of the tier (created if missing).
        capacity_bytes: most bytes of object files (headers and padding included).
        queue_bytes: most payload bytes of writes queued or in progress (their L1 memory stays
            allocated until written); a write beyond it is dropped and counted.
        io_threads: threads doing file I/O.
        direct_io: O_DIRECT on (True), off (False), or where the filesystem supports it (None).
        quotas: salt -> most file bytes of that tenant here (`kvdepot.server.quotas`).
        on_leave: called as ``on_leave(model, key)`` when an object leaves the index.

    Raises:
        ValueError: a capacity or queue of 0 or less, or fewer than one I/O thread.
    """

    name = "l2"

    def __init__(self, path: str, capacity_bytes: int, queue_bytes: int, io_threads: int = 4,
                 direct_io: bool | None = None, quotas: Mapping[str, int] | None = None,
                 on_leave: Callable[[str, bytes], None] | None = None) -> None:
        if capacity_bytes <= 0 or queue_bytes <= 0 or io_threads < 1:
            raise ValueError("L2 needs a capacity and a write queue > 0 bytes and at least one I/O thread")
        self.path = os.path.abspath(path)
        self.capacity_bytes = capacity_bytes
        self.queue_limit_bytes = queue_bytes
        self.direct_io_wanted = direct_io
        self.direct_io = False
        self.counters = TierCounters()
        self.used_bytes = 0  # file bytes of the entries in the index
        self.queued_bytes = 0  # payload bytes of writes not yet ended
        self.queued_writes = 0
        self._entries: OrderedDict[bytes, DiskEntry] = OrderedDict()  # LRU first
        self.tenants = TenantLedger(quotas or {})  # file bytes per cache_salt, and their quotas
        self._on_leave = on_leave or (lambda model, key: None)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvdepot-l2")
        self._tls = threading.local()
        self._tag = secrets.token_hex(4)  # file names of this boot never collide with older ones
        self._seq = 0
        self._lock_fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._objects = os.path.join(self.path, "objects")
        self._tmp = os.path.join(self.path, "tmp")

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ start / stop

    def open(self) -> int:
        """Lock the directory, clear ``tmp/``, choose the I/O mode and index the objects on disk
        (headers only; payloads are verified when read). Blocking: run it before serving.
        Returns the number of objects found.

        Raises:
            OSError: the directory cannot be created or is locked by another daemon (EBUSY).
        """
        os.makedirs(self._tmp, exist_ok=True)
        os.makedirs(self._objects, exist_ok=True)
        self._lock_fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise OSError(errno.EBUSY, f"L2 directory {self.path} is in use by another kvdepot daemon") from None
        for name in os.listdir(self._tmp):
            _unlink(os.path.join(self._tmp, name))
        self.direct_io = self._probe_direct_io() if self.direct_io_wanted is not False else False
        paths = []
        for sub in sorted(os.listdir(self._objects)):
            d = os.path.join(self._objects, sub)
            if os.path.isdir(d):
                paths.extend(os.path.join(d, name) for name in os.listdir(d))
        # the headers are read by the I/O threads: on a cold disk each is a random 4 KiB read,
        # and several in flight hide their latency (measured: benchmarks/tiers.py, "start-up scan")
        found: list[tuple[int, DiskEntry]] = []
        for got in self._pool.map(self._scan_one, paths, chunksize=64):
            if isinstance(got, tuple):
                found.append(got)
            elif got == "corrupt":
                self.counters.corrupt += 1
            else:
                self.counters.errors += 1
        found.sort(key=lambda x: x[0])  # oldest first: LRU order
        for _, e in found:
            old = self._entries.get(e.key)
            if old is not None:  # an older copy whose deletion a crash interrupted
                self._unindex(old)
                _unlink(old.path)
            self._index(e)
        while self.used_bytes > self.capacity_bytes and self._entries:  # capacity lowered since
            e = next(iter(self._entries.values()))
            self._unindex(e)
            _unlink(e.path)
        for salt in list(self.tenants.used_bytes):  # quotas lowered since: the tenant's oldest go
            while self.tenants.over(salt, 0):
                e = next(self.tenants.oldest(salt))
                self._unindex(e)
                _unlink(e.path)
        log.info("L2 at %s: %d objects (%d bytes) found, capacity %d bytes, %s I/O", self.path, len(self._entries),
                 self.used_bytes, self.capacity_bytes, "O_DIRECT" if self.direct_io else "buffered")
        return len(self._entries)

    def _scan_one(self, path: str) -> tuple[int, DiskEntry] | str:
        """(mtime, entry) of the object file at ``path``, or "corrupt" (the file was removed)
        or "error" (it could not be read). Runs on an I/O thread."""
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                meta = decode_header(f.read(HEADER_BYTES), st.st_size)
            if not os.path.basename(path).startswith(meta.key.hex() + "."):
                raise CorruptObject("file name does not match its key")
        except CorruptObject as exc:
            log.warning("L2: dropping %s: %s", path, exc)
            _unlink(path)
            return "corrupt"
        except OSError as exc:
            log.warning("L2: cannot read %s: %s", path, exc)
            return "error"
        return st.st_mtime_ns, DiskEntry(meta.key, meta.parent, meta.model, meta.cache_salt, meta.fingerprint,
                                         meta.size_bytes, path, meta.checksum, DiskState.READY)

    def _probe_direct_io(self) -> bool:
        if not hasattr(os, "O_DIRECT"):
            return False
        probe = os.path.join(self._tmp, f"probe.{self._tag}")
        buf = mmap.mmap(-1, HEADER_BYTES)
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
            try:
                os.pwrite(fd, buf, 0)
            finally:
                os.close(fd)
            return True
        except OSError as exc:
            if self.direct_io_wanted:
                raise OSError(exc.errno, f"O_DIRECT is not supported under {self.path}: {exc.strerror}") from None
            return False
        finally:
            buf.close()
            _unlink(probe)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that owns the index (completions are delivered to it)."""
        self._loop = loop

    def close(self) -> None:
        """Finish the writes in progress, then release the directory."""
        self._pool.shutdown(wait=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # ------------------------------------------------------------------ index (loop thread)

    def get(self, key: bytes) -> DiskEntry | None:
        return self._entries.get(key)

    def ready(self, key: bytes) -> DiskEntry | None:
        e = self._entries.get(key)
        return e if e is not None and e.state is DiskState.READY else None

    def acquire(self, e: DiskEntry) -> None:
        assert e.state is DiskState.READY, f"acquire from {e.state}"
        e.readers += 1

    def release(self, e: DiskEntry) -> None:
        assert e.readers > 0, "release without acquire"
        e.readers -= 1
        if e.readers == 0 and e.state is DiskState.DOOMED:
            self._delete(e)

    def touch_chain(self, keys: list[bytes]) -> None:
        """Mark a hit chain most recently used, tail first so parents end up newer."""
        entries, tenants = self._entries, self.tenants
        for k in reversed(keys):
            e = entries.get(k)
            if e is not None:
                entries.move_to_end(k)
                tenants.touch(e.cache_salt, k)

    def _index(self, e: DiskEntry) -> None:
        self._entries[e.key] = e
        self.used_bytes += e.file_bytes
        self.tenants.add(e.cache_salt, e.key, e, e.file_bytes)

    def _unindex(self, e: DiskEntry) -> None:
        del self._entries[e.key]
        self.used_bytes -= e.file_bytes
        self.tenants.remove(e.cache_salt, e.key, e.file_bytes)
        self._on_leave(e.model, e.key)

    def _remove(self, e: DiskEntry) -> None:
        """Out of the index; the file goes when nothing uses it."""
        if self._entries.get(e.key) is e:
            self._unindex(e)
        was = e.state
        e.state = DiskState.DOOMED
        if was is DiskState.READY and e.readers == 0:
            self._delete(e)
        # WRITING: deleted when its write ends; readers > 0: when the last one leaves

    def _delete(self, e: DiskEntry) -> None:
        e.state = None  # deleted: no further transitions
        self._pool.submit(_unlink, e.path)

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.capacity_bytes:
            return False
        return self._evict(self._entries.values(), nbytes - (self.capacity_bytes - self.used_bytes)) is not None

    def _make_own_room(self, salt: str, nbytes: int) -> bool:
        """Evict tenant ``salt``'s least recently used objects until ``nbytes`` more fit its
        quota; False (nothing evicted) if its objects not in use cannot make that room."""
        tenants = self.tenants
        victims = self._evict(tenants.oldest(salt), tenants.used_bytes.get(salt, 0) + nbytes - tenants.limit(salt))
        for _ in victims or ():
            tenants.evicted(salt)
        return victims is not None

    def _evict(self, candidates, need_bytes: int) -> list[DiskEntry] | None:
        """Evict the first objects nobody reads among ``candidates`` (LRU order) until their file
        bytes reach ``need_bytes``; the victims, or None (nothing evicted) if they cannot."""
        victims = []
        for e in candidates:
            if need_bytes <= 0:
                break
            if e.state is DiskState.READY and e.readers == 0:
                victims.append(e)
                need_bytes -= e.file_bytes
        if need_bytes > 0:
            return None
        for e in victims:  # (after the loop: removing changes what it iterated)
            self._remove(e)
            self.counters.evictions += 1
        return victims

    def drop_where(self, pred: Callable[[DiskEntry], bool]) -> tuple[int, int]:
        """Remove every object matching ``pred`` (flush); files in use go when released.
        Returns (objects, file bytes) dropped."""
        victims = [e for e in self._entries.values() if pred(e)]
        for e in victims:
            self._remove(e)
        return len(victims), sum(e.file_bytes for e in victims)

    # ------------------------------------------------------------------ I/O

    def write(self, key: bytes, parent: bytes, model: str, cache_salt: str, fingerprint: str, payload: memoryview,
              size_bytes: int, done: Callable[[], None]) -> bool:
        """Write an object leaving L1. ``payload``: its L1 extent (``padded(size_bytes)`` bytes,
        left untouched but for the padding after ``size_bytes``, zeroed); ``done()`` runs on the
        loop once the extent is no longer read. Returns False, without calling ``done``, when the
        write is not made: the key is already in L2, the queue is full or no room can be
        evicted (the latter two counted in ``dropped_writes``)."""
        if key in self._entries:
            return False
        pad, fb = padded(size_bytes), file_bytes(size_bytes)
        if (self.queued_bytes + pad > self.queue_limit_bytes
                or (self.tenants.over(cache_salt, fb) and not self._make_own_room(cache_salt, fb))
                or not self._make_room(fb)):
            self.counters.dropped_writes += 1
            return False
        self._seq += 1
        h = key.hex()
        e = DiskEntry(key, parent, model, cache_salt, fingerprint, size_bytes,
                      os.path.join(self._objects, h[:2], f"{h}.{self._tag}{self._seq:x}.kvd"))
        self._index(e)
        self.queued_bytes += pad
        self.queued_writes += 1
        fut = self._loop.run_in_executor(self._pool, self._write_file, e, payload)

        def finished(f: asyncio.Future) -> None:
            self.queued_bytes -= pad
            self.queued_writes -= 1
            done()
            exc = asyncio.CancelledError() if f.cancelled() else f.exception()
            if exc is not None:
                log.error("L2: write of %s failed: %s", e.path, exc)
                self.counters.errors += 1
                if self._entries.get(key) is e:
                    self._unindex(e)
                e.state = None
                return
            e.checksum = f.result()
            self.counters.written_bytes += e.file_bytes
            if e.state is DiskState.WRITING:
                e.state = DiskState.READY
            else:  # flushed while being written
                self._delete(e)

        fut.add_done_callback(finished)
        return True

    def read(self, e: DiskEntry, out: memoryview, done: Callable[[BaseException | None], None]) -> None:
        """Read and verify a READY object into ``out`` (``padded(size_bytes)`` bytes, e.g. an L1
        extent); ``done(None)`` on the loop once ``out`` holds the payload, ``done(error)`` if it
        does not (the object is dropped: `CorruptObject` for a bad or vanished file, counted in
        ``corrupt``; another ``OSError`` in ``errors``)."""
        self.acquire(e)
        fut = self._loop.run_in_executor(self._pool, self._read_file, e, out)

        def finished(f: asyncio.Future) -> None:
            exc = asyncio.CancelledError() if f.cancelled() else f.exception()
            self.release(e)
            if exc is None:
                self.counters.read_bytes += e.file_bytes
            else:
                if isinstance(exc, CorruptObject):
                    log.warning("L2: dropping %s: %s", e.path, exc)
                    self.counters.corrupt += 1
                else:
                    log.error("L2: read of %s failed: %s", e.path, exc)
                    self.counters.errors += 1
                if e.state is DiskState.READY:
                    self._remove(e)
            done(exc)

        fut.add_done_callback(finished)

    # ------------------------------------------------------------------ file work (I/O threads)

    def _header_buf(self) -> mmap.mmap:
        buf = getattr(self._tls, "header", None)
        if buf is None:
            buf = self._tls.header = mmap.mmap(-1, HEADER_BYTES)  # page-aligned (O_DIRECT)
        return buf

    def _write_file(self, e: DiskEntry, payload: memoryview) -> bytes:
        size, pad = e.size_bytes, padded(e.size_bytes)
        if pad > size:
            payload[size:pad] = bytes(pad - size)
        checksum = payload_checksum(payload[:size])
        hdr = self._header_buf()
        encode_header(ObjectMeta(e.key, e.parent, e.model, e.cache_salt, e.fingerprint, size, checksum), hdr)
        tmp = os.path.join(self._tmp, os.path.basename(e.path))
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.direct_io else 0)
        fd = os.open(tmp, flags, 0o600)
        try:
            _pwrite_all(fd, [memoryview(hdr), payload[:pad]], 0)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        try:
            os.rename(tmp, e.path)
        except FileNotFoundError:  # first object under this <hh>/
            os.makedirs(os.path.dirname(e.path), exist_ok=True)
            os.rename(tmp, e.path)
        return checksum

    def _read_file(self, e: DiskEntry, out: memoryview) -> None:
        size, pad = e.size_bytes, padded(e.size_bytes)
        try:
            fd = os.open(e.path, os.O_RDONLY | (os.O_DIRECT if self.direct_io else 0))
        except FileNotFoundError:
            raise CorruptObject("file vanished") from None
        try:
            hdr = self._header_buf()
            if os.preadv(fd, [hdr], 0) != HEADER_BYTES:
                raise CorruptObject("header truncated")
            meta = decode_header(hdr, os.fstat(fd).st_size)
            if (meta.key, meta.size_bytes, meta.fingerprint) != (e.key, e.size_bytes, e.fingerprint):
                raise CorruptObject("the file holds another object than the index says")
            if e.checksum and meta.checksum != e.checksum:
                raise CorruptObject("stale file: its checksum is not the one written")
            if _pread_all(fd, out[:pad], HEADER_BYTES) != pad:
                raise CorruptObject("payload truncated")
        finally:
            os.close(fd)
        if payload_checksum(out[:size]) != meta.checksum:
            raise CorruptObject("payload checksum mismatch")
        try:
            os.utime(e.path)  # recency survives a restart (LRU order of the start-up scan)
        except OSError:
            pass


def _pwrite_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    total = sum(len(b) for b in bufs)
    done = 0
    while done < total:
        n = os.pwritev(fd, bufs, offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs = bufs[1:]
        if n:
            bufs = [bufs[0][n:], *bufs[1:]]


def _pread_all(fd: int, buf: memoryview, offset: int) -> int:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("L2: cannot delete %s: %s", path, exc)
