"""The daemon and Python's garbage collector.

A collection runs on the thread whose allocation triggered it, holding the GIL: in the daemon
that is mostly the event loop's thread, so every request waits for it. A full collection walks
every object the collector tracks; after start-up (imports, torch, CUDA, the tiers' indexes)
those are ~170,000 objects, ~0.15 s per full collection on the dev VM, for objects that live as
long as the daemon. `freeze_heap` moves them out of the collector's sight once the daemon is
up, as vLLM's engine core does (``vllm.utils.gc_utils.freeze_gc_heap``); the index entries of
L1 and L2 are never tracked at all (`kvdepot.server.index.Entry`). `GcPauses` counts the
collections' time for ``/metrics`` (``kvdepot_gc_pause_seconds``), beside prometheus_client's
own count of collections (``python_gc_collections_total``).
"""

from __future__ import annotations

import gc
import time

GENERATIONS = ("0", "1", "2")


def freeze_heap() -> None:
    """Collect what is garbage now, then freeze every remaining tracked object (`gc.freeze`):
    later collections, full ones included, never walk them again. Call once the daemon is up."""
    gc.collect()
    gc.freeze()


class GcPauses:
    """Seconds spent in garbage collections per generation, since `install` (``gc.callbacks``;
    a collection on any thread counts). ``seconds[g]`` only grows: read it at scrape time."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.longest_s = 0.0
        self._t0 = 0.0

    def install(self) -> None:
        if self._cb not in gc.callbacks:
            gc.callbacks.append(self._cb)

    def close(self) -> None:
        if self._cb in gc.callbacks:
            gc.callbacks.remove(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        # collections never overlap (they hold the GIL and the collector's own lock)
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        spent = time.perf_counter() - self._t0
        gen = info.get("generation", 2)
        self.seconds[gen if 0 <= gen <= 2 else 2] += spent
        if spent > self.longest_s:
            self.longest_s = spent
