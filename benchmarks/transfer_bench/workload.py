"""Request streams: items handed to threads, one-chunk STORE / RETRIEVE tasks (blocking, or
pipelined on one client as an engine's worker would, one or several one-chunk prompts per
request), and fresh keys."""

from __future__ import annotations

import collections
import threading
import time

import torch

from kvdepot.client import KVDepotClient, RetrieveItem, StoreItem


class _Work:
    """Items handed out to threads one at a time."""

    def __init__(self, items) -> None:
        self._items = list(items)
        self._i = 0
        self._lock = threading.Lock()
        self.done = 0

    def next(self):
        with self._lock:
            if self._i >= len(self._items):
                return None
            self._i += 1
            return self._items[self._i - 1]

    def add_done(self, n: int) -> None:
        with self._lock:
            self.done += n


def run_parallel(tasks, thread_cpu_s: list[float] | None = None) -> float:
    """Run each callable in its own thread, all released together; wall seconds from the
    release to the end of the last one. Re-raises the first error. ``thread_cpu_s``: each
    thread's own CPU seconds in its callable are appended to it."""
    barrier = threading.Barrier(len(tasks) + 1)
    errors: list[BaseException] = []

    def body(fn) -> None:
        try:
            barrier.wait()
            c0 = time.thread_time()
            fn()
            if thread_cpu_s is not None:
                thread_cpu_s.append(time.thread_time() - c0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(fn,), daemon=True) for fn in tasks]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt


def store_task(client: KVDepotClient, reg, stream, work: _Work):
    """One thread's STOREs: one chunk per request (parent b""), until ``work`` is empty."""

    def fn() -> None:
        while (item := work.next()) is not None:
            key, ids = item
            r = client.store(reg, [key], ids, after=stream)
            work.add_done(r.stored)

    return fn


def retrieve_task(client: KVDepotClient, reg, stream, work: _Work):
    """One thread's RETRIEVEs; its stream waits on the daemon's events and is synchronized at the
    end, so the thread ends when its data is in place."""

    def fn() -> None:
        while (item := work.next()) is not None:
            key, ids = item
            work.add_done(client.retrieve(reg, [key], ids, before=stream))
        if stream is not None:
            stream.synchronize()

    return fn


def _fill(q: collections.deque, work: _Work, depth: int, per_message: int, one, many) -> None:
    """Submit requests until ``depth`` are in ``q``: ``one(key, block_ids)`` per item, or with
    ``per_message`` > 1 ``many(items)`` per ``per_message`` items."""
    while len(q) < depth:
        items = []
        while len(items) < per_message and (item := work.next()) is not None:
            items.append(item)
        if not items:
            return
        q.append(one(*items[0]) if per_message == 1 else many(items))


def store_pipelined(client: KVDepotClient, reg, stream, work: _Work, depth: int, per_message: int = 1):
    """One thread keeping ``depth`` STOREs in flight on one client (`submit_store`); each reply
    comes once its chunks are in the daemon's L1. ``per_message`` > 1: each STORE carries that
    many one-chunk prompts (`submit_store_many`: one region, one gather, one message)."""

    def one(key, ids):
        return client.submit_store(reg, [key], ids, after=stream)

    def many(items):
        return client.submit_store_many(reg, [StoreItem([k], ids) for k, ids in items], after=stream)

    def fn() -> None:
        q: collections.deque = collections.deque()
        while True:
            _fill(q, work, depth, per_message, one, many)
            if not q:
                return
            work.add_done(q.popleft().result().stored)

    return fn


def retrieve_pipelined(client: KVDepotClient, reg, stream, work: _Work, depth: int, per_message: int = 1):
    """One thread keeping ``depth`` RETRIEVEs in flight on one client (`submit_retrieve`, or with
    ``per_message`` > 1 `submit_retrieve_many` of that many one-chunk prompts); the stream
    (engine-side staging: where the scatters run) is synchronized at the end."""

    # engine-side staging: each result enqueues its scatter, on the stream given to it
    before = stream if reg.staging is not None else None

    def one(key, ids):
        return client.submit_retrieve(reg, [key], ids)

    def many(items):
        return client.submit_retrieve_many(reg, [RetrieveItem([k], ids) for k, ids in items])

    def fn() -> None:
        q: collections.deque = collections.deque()
        while True:
            _fill(q, work, depth, per_message, one, many)
            if not q:
                break
            work.add_done(q.popleft().result(before))
        if stream is not None:
            stream.synchronize()

    return fn


def fresh_keys(reg, n: int, chunk_size: int) -> list[bytes]:
    """Keys of ``n`` one-chunk prompts of random tokens (distinct chunks, parent b"")."""
    toks = torch.randint(0, 1 << 30, (n, chunk_size)).tolist()
    return [reg.keys(t)[0] for t in toks]
