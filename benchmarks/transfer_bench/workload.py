"""Request streams: items handed to threads, one-chunk STORE / RETRIEVE tasks (blocking, or
pipelined on one client as an engine's worker would), and fresh keys."""

from __future__ import annotations

import collections
import threading
import time

import torch

from kvdepot.client import KVDepotClient


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


def store_pipelined(client: KVDepotClient, reg, stream, work: _Work, depth: int):
    """One thread keeping ``depth`` STOREs in flight on one client (`submit_store`); each reply
    comes once its chunk is in the daemon's L1."""

    def fn() -> None:
        q: collections.deque = collections.deque()
        while True:
            while len(q) < depth and (item := work.next()) is not None:
                key, ids = item
                q.append(client.submit_store(reg, [key], ids, after=stream))
            if not q:
                return
            work.add_done(q.popleft().result().stored)

    return fn


def retrieve_pipelined(client: KVDepotClient, reg, stream, work: _Work, depth: int):
    """One thread keeping ``depth`` RETRIEVEs in flight on one client (`submit_retrieve`); the
    stream (engine-side staging: where the scatters run) is synchronized at the end."""

    # engine-side staging: each result enqueues its scatter, on the stream given to it
    before = stream if reg.staging is not None else None

    def fn() -> None:
        q: collections.deque = collections.deque()
        while True:
            while len(q) < depth and (item := work.next()) is not None:
                key, ids = item
                q.append(client.submit_retrieve(reg, [key], ids))
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
