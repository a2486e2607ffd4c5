"""L3 tier: chunk objects in a Redis or Valkey server (or Redis Cluster) shared by daemons on
many nodes, through the maintained `redis` client (``redis.asyncio``, hiredis parser).

An object is one string value under ``<prefix><key hex>``: the same 4096-byte header as an L2
file (`kvdepot.server.objfile`: format version, key, layout fingerprint, size, xxh3-128 of the
payload) followed by the payload, set with a TTL. Every fetch verifies it before a byte reaches
L1, so a value that is truncated, stale or flipped (or written by anything else under the
prefix) is a miss, counted in ``kvdepot_corrupt_objects_total{tier="l3"}``.

Threading: the client runs on an asyncio loop of its own in one background thread, so neither
Redis' latency nor building and copying multi-MiB values ever runs on the daemon's event loop.
Requests come from the daemon's loop (`exists`, `fetch`, `write`, `flush`) and their results go
back to it through callbacks. Memory stays bounded: writes in flight are capped by
``queue_bytes`` (beyond it a write is dropped and counted); a fetch copies into an L1 extent
the daemon allocated.

Failure: every command has ``timeout_s``; after `_TRIP_FAILURES` failures in a row (or one
refused connection) the circuit opens for `_RETRY_S`: L3 is then skipped (lookups answer from
L1/L2 at once, writes are dropped), and the next request after it is a probe that closes the
circuit again if Redis answers. Redis down never fails a request and never blocks one for
longer than ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence

from kvdepot.server.disk import TierCounters
from kvdepot.server.objfile import HEADER_BYTES, CorruptObject, ObjectMeta, decode_header, encode_header, payload_checksum

log = logging.getLogger("kvdepot.l3")

_TRIP_FAILURES = 3
_RETRY_S = 5.0
# commands (pipelines) in flight at once, so connections to Redis stay bounded: fetches and
# writes (large values) share one budget, lookups (small, latency-bound) have their own
_IN_FLIGHT = 16
_LOOKUPS_IN_FLIGHT = 4


def redact(url: str) -> str:
    """``url`` without its password (for logs and describe)."""
    p = urllib.parse.urlsplit(url)
    if p.password is None:
        return url
    netloc = f"{p.username or ''}:***@{p.hostname}" + (f":{p.port}" if p.port else "")
    return urllib.parse.urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))


class RemoteTier:
    """The L3 tier (see the module docstring).

    Args:
        url: ``redis://[user:password@]host:port[/db]`` or ``rediss://`` (TLS); with ``cluster``,
            any node of a Redis Cluster.
        prefix: namespace of this deployment's keys.
        ttl_s: expiry of every object (0: none; Redis' own eviction policy then decides).
        queue_bytes: most payload bytes of writes in flight.
        timeout_s: per command (connect, read, write).
        cluster: the URL names a Redis Cluster node.

    Raises:
        ValueError: a URL that is not redis:// or rediss://, or a queue of 0 bytes or less.
    """

    name = "l3"

    def __init__(self, url: str, prefix: str = "kvdepot:", ttl_s: float = 86400.0, queue_bytes: int = 1 << 30,
                 timeout_s: float = 0.5, cluster: bool = False) -> None:
        if urllib.parse.urlsplit(url).scheme not in ("redis", "rediss"):
            raise ValueError(f"L3 URL {redact(url)!r} is not redis://... or rediss://...")
        if queue_bytes <= 0:
            raise ValueError("the L3 write queue must be > 0 bytes")
        self.url = url
        self.prefix = prefix.encode()
        self.ttl_s = ttl_s
        self.queue_limit_bytes = queue_bytes
        self.timeout_s = timeout_s
        self.cluster = cluster
        self.counters = TierCounters()
        self.queued_bytes = 0  # payload bytes of writes not yet ended (daemon loop)
        self.queued_writes = 0
        self._failures = 0
        self._open_until = 0.0  # circuit open (L3 skipped) until this time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None  # the daemon's
        self._rloop = asyncio.new_event_loop()  # the client's
        self._thread = threading.Thread(target=self._rloop.run_forever, name="kvdepot-l3", daemon=True)
        self._client = None
        self._slots: dict[str, asyncio.Semaphore] | None = None  # made on the client's loop

    # ------------------------------------------------------------------ start / stop

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the client's thread (no connection yet: a Redis that is down at start only
        opens the circuit)."""
        self._loop = loop
        self._thread.start()
        self._call(self._make_client(), lambda r, e: None)

    async def _make_client(self) -> None:
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError

        # one retry, at once, on a broken connection only (a pooled connection Redis closed, e.g.
        # when it restarted, is reopened); a timeout is never retried: it counts as a failure
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        kw = dict(socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s, retry=retry,
                  max_connections=_IN_FLIGHT + _LOOKUPS_IN_FLIGHT + 2)
        self._slots = {"bulk": asyncio.Semaphore(_IN_FLIGHT), "lookup": asyncio.Semaphore(_LOOKUPS_IN_FLIGHT),
                       "admin": asyncio.Semaphore(1)}
        if self.cluster:
            from redis.asyncio.cluster import RedisCluster

            self._client = RedisCluster.from_url(self.url, **kw)
        else:
            from redis.asyncio import Redis

            self._client = Redis.from_url(self.url, **kw)

    def close(self) -> None:
        """Let writes in flight end (at most ``timeout_s`` each), then stop the client."""
        if not self._thread.is_alive():
            return

        async def shut() -> None:
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if pending:
                await asyncio.wait(pending, timeout=2 * self.timeout_s + 1)
            if self._client is not None:
                await self._client.aclose()

        try:
            asyncio.run_coroutine_threadsafe(shut(), self._rloop).result(4 * self.timeout_s + 5)
        except (concurrent.futures.TimeoutError, Exception) as exc:  # noqa: BLE001 - stopping anyway
            log.warning("L3: client did not close cleanly: %s", exc)
        self._rloop.call_soon_threadsafe(self._rloop.stop)
        self._thread.join(5)

    # ------------------------------------------------------------------ circuit (daemon loop)

    @property
    def state(self) -> str:
        return "up" if time.monotonic() >= self._open_until else "down (circuit open)"

    def available(self) -> bool:
        """Whether to use L3 now: the circuit is closed, or its open time is over (the next
        request is the probe that closes it again, or opens it for another `_RETRY_S`)."""
        return time.monotonic() >= self._open_until

    def _ok(self) -> None:
        if self._open_until:
            log.info("L3 at %s answers again", redact(self.url))
        self._failures = 0
        self._open_until = 0.0

    def _failed(self, what: str, exc: BaseException) -> None:
        self.counters.errors += 1
        self._failures += 1
        refused = isinstance(exc, (ConnectionError, OSError)) or "connect" in type(exc).__name__.lower()
        if (self._failures >= _TRIP_FAILURES or refused) and time.monotonic() >= self._open_until:
            log.warning("L3 at %s failed (%s: %s: %s); skipping it for %.0f s", redact(self.url), what,
                        type(exc).__name__, exc, _RETRY_S)
            self._open_until = time.monotonic() + _RETRY_S
        elif self._failures == 1:
            log.warning("L3 at %s: %s failed: %s: %s", redact(self.url), what, type(exc).__name__, exc)

    def _call(self, coro, done: Callable[[object, BaseException | None], None], kind: str = "bulk") -> None:
        """Run ``coro`` on the client's loop (at most so many of its ``kind`` at once, in order
        of submission); ``done(result, error)`` on the daemon's loop."""

        async def bounded():
            if self._slots is None:  # _make_client itself
                return await coro
            async with self._slots[kind]:
                return await coro

        cf = asyncio.run_coroutine_threadsafe(bounded(), self._rloop)

        def back(f: concurrent.futures.Future) -> None:
            exc = f.exception() if not f.cancelled() else asyncio.CancelledError()
            res = None if exc is not None else f.result()
            try:
                self._loop.call_soon_threadsafe(done, res, exc)
            except RuntimeError:  # the daemon's loop is closed (shutting down)
                pass

        cf.add_done_callback(back)

    def _name(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    # ------------------------------------------------------------------ requests (daemon loop)

    def sizes(self, keys: Sequence[bytes], done: Callable[[list[int] | None], None]) -> None:
        """Payload bytes of each key's object (0: absent), in one round trip (a pipeline of
        STRLEN); ``done(None)`` when L3 is unavailable or fails."""
        if not self.available() or not keys:
            done(None if keys else [])
            return
        names = [self._name(k) for k in keys]

        async def run() -> list[int]:
            pipe = self._client.pipeline(transaction=False)
            for n in names:
                pipe.strlen(n)
            return await asyncio.wait_for(pipe.execute(), self.timeout_s)

        def back(res, exc) -> None:
            if exc is not None:
                self._failed("lookup", exc)
                done(None)
                return
            self._ok()
            done([max(0, int(n) - HEADER_BYTES) if int(n) > HEADER_BYTES else 0 for n in res])

        self._call(run(), back, "lookup")

    def fetch(self, key: bytes, size_bytes: int, out: memoryview,
              done: Callable[[ObjectMeta | None, BaseException | None], None]) -> None:
        """GET ``key``'s object, verify it and copy its payload into ``out`` (``size_bytes``
        long, e.g. an L1 extent) in the client's thread; ``done(meta, None)`` on the daemon's
        loop once ``out`` holds it, ``done(None, error)`` otherwise (`CorruptObject`: a bad or
        vanished value, counted in ``corrupt``)."""
        name = self._name(key)

        async def run() -> ObjectMeta:
            value = await self._client.get(name)
            if value is None:
                raise KeyError("gone from L3")  # expired or evicted since the lookup: a miss
            meta = decode_header(value[:HEADER_BYTES])
            if len(value) != HEADER_BYTES + meta.size_bytes:
                raise CorruptObject(f"value of {len(value)} bytes, header says {meta.size_bytes} + {HEADER_BYTES}")
            if meta.key != key or meta.size_bytes != size_bytes:
                raise CorruptObject("the value holds another object than asked for")
            payload = memoryview(value)[HEADER_BYTES:]
            if payload_checksum(payload) != meta.checksum:
                raise CorruptObject("payload checksum mismatch")
            out[:size_bytes] = payload
            return meta

        def back(meta, exc) -> None:
            if exc is None:
                self._ok()
                self.counters.read_bytes += HEADER_BYTES + size_bytes
            elif isinstance(exc, CorruptObject):
                log.warning("L3: dropping %s: %s", name.decode(), exc)
                self.counters.corrupt += 1
                self._call(self._client.unlink(name), lambda r, e: None, "admin")
            elif not isinstance(exc, KeyError):
                self._failed("fetch", exc)
            done(meta, exc)

        self._call(run(), back)

    def write(self, meta: ObjectMeta, payload: memoryview, done: Callable[[], None]) -> bool:
        """SET an object (its header built in the client's thread from ``meta``, whose checksum
        is computed there); ``done()`` on the daemon's loop once ``payload`` is no longer read.
        Returns False (``done`` not called) when L3 is unavailable or the write queue is full
        (counted in ``dropped_writes``)."""
        size = meta.size_bytes
        if not self.available() or self.queued_bytes + size > self.queue_limit_bytes:
            self.counters.dropped_writes += 1
            return False
        self.queued_bytes += size
        self.queued_writes += 1
        name, ttl = self._name(meta.key), self.ttl_s

        async def run() -> int:
            # one SET of header + payload (one copy out of L1, here, off the daemon's loop): a
            # reader never sees half a value. (SET header + APPEND payload in a MULTI would skip
            # the copy, but redis-py 8.1's asyncio cluster transactions break the connection
            # pool's event loop, and Redis then copies the value again to grow the string.)
            value = bytearray(HEADER_BYTES + size)
            body = memoryview(value)[HEADER_BYTES:]
            body[:] = payload[:size]
            encode_header(ObjectMeta(meta.key, meta.parent, meta.model, meta.cache_salt, meta.fingerprint, size,
                                     payload_checksum(body)), value)
            await self._client.set(name, memoryview(value), px=int(ttl * 1000) if ttl > 0 else None)
            return len(value)

        def back(n, exc) -> None:
            self.queued_bytes -= size
            self.queued_writes -= 1
            done()
            if exc is not None:
                self._failed("write", exc)
                return
            self._ok()
            self.counters.written_bytes += n

        self._call(run(), back)
        return True

    def flush(self, done: Callable[[int | None], None]) -> None:
        """Delete every key under the prefix (all of the shared store's objects of this
        deployment, whoever wrote them); ``done(count)``, or ``done(None)`` if L3 failed."""

        async def run() -> int:
            n, batch = 0, []
            kw = {"target_nodes": self._client.PRIMARIES} if self.cluster else {}  # every node's keys
            async for name in self._client.scan_iter(match=self.prefix + b"*", count=1000, **kw):
                batch.append(name)
                if len(batch) >= 1000:
                    n += await self._client.unlink(*batch)  # (a cluster client splits it by slot)
                    batch = []
            if batch:
                n += await self._client.unlink(*batch)
            return n

        def back(n, exc) -> None:
            if exc is not None:
                self._failed("flush", exc)
                done(None)
                return
            self._ok()
            done(n)

        self._call(run(), back, "admin")
