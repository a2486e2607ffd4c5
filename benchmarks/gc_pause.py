"""A full garbage collection in the daemon, against the size of its index (no GPU needed).

The daemon keeps one index entry per cached chunk (L1: `kvdepot.server.index.Entry`, L2:
`kvdepot.server.disk.DiskEntry`). A full collection of Python's garbage collector walks every
object it tracks and runs on the event loop's thread, so every request waits for it; CPython
runs one each time the objects that survived earlier collections grew by a quarter. This
fills an index with N chunks and times ``gc.collect()`` (the best of 3), with the objects the
collector tracks, next to the same run with the entries of a tracked ``slots`` dataclass of the
same fields (what the entries were before they became untracked ``msgspec`` structs).

    python benchmarks/gc_pause.py [--chunks 100000,1000000] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time

from kvdepot.server.index import ChunkIndex, EntryState


@dataclasses.dataclass(slots=True, eq=False)
class TrackedEntry:  # the fields of `Entry`, as a GC-tracked slots dataclass
    key: bytes
    parent: bytes
    offset: int
    size_bytes: int
    model: str
    cache_salt: str
    fingerprint: str = ""
    state: EntryState = EntryState.WRITING
    readers: int = 0
    children: int = 0
    linked: bool = False


def full_collection_ms() -> float:
    gc.collect()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


def measure(chunks: int, tracked: bool) -> dict:
    idx = ChunkIndex(lambda e, evicted: None)
    for i in range(chunks):
        e = idx.begin_write(os.urandom(16), b"", i * 4096, 4096, "model", "")
        idx.commit(e)
        if tracked:  # the same entry, as the tracked dataclass
            idx._entries[e.key] = TrackedEntry(e.key, e.parent, e.offset, e.size_bytes, e.model, e.cache_salt,
                                               state=e.state)
    out = {"chunks": chunks, "entries": "tracked dataclass" if tracked else "untracked struct (kvdepot)",
           "tracked_objects": len(gc.get_objects()), "full_collection_ms": full_collection_ms()}
    del idx
    gc.collect()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", default="100000,1000000")
    p.add_argument("--out")
    a = p.parse_args()
    rows = []
    for n in (int(x) for x in a.chunks.split(",")):
        for tracked in (False, True):
            r = measure(n, tracked)
            rows.append(r)
            print(f"{n:>9} chunks, {r['entries']:<27}: {r['tracked_objects']:>9} tracked objects, "
                  f"full collection {r['full_collection_ms']:7.1f} ms", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
