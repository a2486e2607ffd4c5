"""L2 disk tier throughput next to the same directory's raw sequential disk bandwidth (no GPU).

Raw: ``threads`` files written, then read, in 32 MiB O_DIRECT (else buffered) requests from
page-aligned memory, one thread per file: what the disk gives sequential I/O from this process.
L2: the tier itself (`kvdepot.server.disk.DiskTier`, as the daemon drives it from its event
loop): objects of one chunk size written (header, xxh3-128 of the payload, tmp file, rename),
then read back and verified; GB/s count payload bytes. Each figure is the best of ``repeats``.

    python benchmarks/tiers.py [--dir DIR] [--total-bytes 2g] [--object-bytes 32m,2m] [--out r.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import tempfile
import threading
import time

from kvdepot.config import parse_bytes
from kvdepot.server.disk import DiskTier
from kvdepot.server.objfile import padded

_RAW_REQUEST_BYTES = 32 << 20


def raw_disk(path: str, total_bytes: int, threads: int, direct: bool) -> dict:
    """Sequential write then read of ``total_bytes`` over ``threads`` files; GB/s each way."""
    per = total_bytes // threads // _RAW_REQUEST_BYTES * _RAW_REQUEST_BYTES
    flags = os.O_DIRECT if direct else 0
    files = [os.path.join(path, f"raw{i}") for i in range(threads)]

    def run(fn) -> float:
        ts = [threading.Thread(target=fn, args=(f,)) for f in files]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return time.perf_counter() - t0

    def write(f: str) -> None:
        buf = mmap.mmap(-1, _RAW_REQUEST_BYTES)
        buf.write(os.urandom(4096) * (_RAW_REQUEST_BYTES // 4096))
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        try:
            for off in range(0, per, _RAW_REQUEST_BYTES):
                os.pwrite(fd, buf, off)
            if not direct:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read(f: str) -> None:
        buf = mmap.mmap(-1, _RAW_REQUEST_BYTES)
        fd = os.open(f, os.O_RDONLY | flags)
        try:
            for off in range(0, per, _RAW_REQUEST_BYTES):
                os.preadv(fd, [buf], off)
        finally:
            os.close(fd)

    w = run(write)
    if not direct:
        os.system("sync")
    r = run(read)
    for f in files:
        os.unlink(f)
    moved = per * threads
    return {"write_gbps": moved / w / 1e9, "read_gbps": moved / r / 1e9, "bytes": moved}


def l2_tier(path: str, total_bytes: int, object_bytes: int, threads: int, direct: bool | None) -> dict:
    """Write ``total_bytes`` of ``object_bytes`` objects through a DiskTier, then read them all."""
    n = max(1, total_bytes // object_bytes)
    tier = DiskTier(path, capacity_bytes=2 * n * (object_bytes + (1 << 20)), queue_bytes=n * padded(object_bytes),
                    io_threads=threads, direct_io=direct)
    tier.open()
    loop = asyncio.new_event_loop()
    tier.attach(loop)
    src = mmap.mmap(-1, padded(object_bytes))
    src.write(os.urandom(object_bytes))
    keys = [i.to_bytes(16, "little") for i in range(n)]
    try:
        async def write_all() -> float:
            done = asyncio.Event()
            left = [n]

            def one() -> None:
                left[0] -= 1
                if not left[0]:
                    done.set()

            t0 = time.perf_counter()
            for k in keys:  # every write reads the same L1 bytes: fine, they are only read
                assert tier.write(k, b"", "bench", "", "fp", memoryview(src), object_bytes, one)
            await done.wait()
            return time.perf_counter() - t0

        async def read_all() -> float:
            outs = [mmap.mmap(-1, padded(object_bytes)) for _ in range(threads * 2)]
            sem = asyncio.Semaphore(len(outs))
            t0 = time.perf_counter()

            async def one(i: int, k: bytes) -> None:
                async with sem:
                    fut = loop.create_future()
                    tier.read(tier.ready(k), memoryview(outs[i % len(outs)]), fut.set_result)
                    err = await fut
                    assert err is None, err

            await asyncio.gather(*(one(i, k) for i, k in enumerate(keys)))
            return time.perf_counter() - t0

        w = loop.run_until_complete(write_all())
        assert tier.counters.errors == 0 and len(tier) == n
        r = loop.run_until_complete(read_all())
        assert tier.counters.corrupt == 0
        return {"objects": n, "object_bytes": object_bytes, "write_gbps": n * object_bytes / w / 1e9,
                "read_gbps": n * object_bytes / r / 1e9, "direct_io": tier.direct_io}
    finally:
        tier.close()
        loop.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="", help="directory on the disk to measure (default: a temporary one)")
    ap.add_argument("--total-bytes", type=parse_bytes, default=2 << 30)
    ap.add_argument("--object-bytes", default="32m,2m", help="comma-separated object sizes")
    ap.add_argument("--threads", type=int, default=4, help="I/O threads (L2's default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--buffered", action="store_true", help="L2 and raw without O_DIRECT")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    base = tempfile.mkdtemp(prefix="kvdepot-tiers-", dir=args.dir or None)
    direct = not args.buffered
    res = {"dir": base, "total_bytes": args.total_bytes, "threads": args.threads, "results": []}
    try:
        best = lambda xs, k: max(x[k] for x in xs)  # noqa: E731
        raws = [raw_disk(base, args.total_bytes, args.threads, direct) for _ in range(args.repeats)]
        res["raw_write_gbps"], res["raw_read_gbps"] = best(raws, "write_gbps"), best(raws, "read_gbps")
        print(f"raw sequential ({'O_DIRECT' if direct else 'buffered'}, {args.threads} threads): "
              f"write {res['raw_write_gbps']:.2f} GB/s, read {res['raw_read_gbps']:.2f} GB/s")
        for size in [parse_bytes(s) for s in args.object_bytes.split(",")]:
            runs = []
            for i in range(args.repeats):
                d = os.path.join(base, f"l2-{size}-{i}")
                runs.append(l2_tier(d, args.total_bytes, size, args.threads, None if direct else False))
                shutil.rmtree(d)
            r = {"object_bytes": size, "objects": runs[0]["objects"], "direct_io": runs[0]["direct_io"],
                 "write_gbps": best(runs, "write_gbps"), "read_gbps": best(runs, "read_gbps")}
            r["write_vs_raw"] = r["write_gbps"] / res["raw_write_gbps"]
            r["read_vs_raw"] = r["read_gbps"] / res["raw_read_gbps"]
            res["results"].append(r)
            print(f"L2 objects of {size >> 20} MiB x {r['objects']} ({'O_DIRECT' if r['direct_io'] else 'buffered'}): "
                  f"write {r['write_gbps']:.2f} GB/s = {100 * r['write_vs_raw']:.1f}% of raw, "
                  f"read {r['read_gbps']:.2f} GB/s = {100 * r['read_vs_raw']:.1f}% of raw")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
