"""L2 disk tier throughput next to the same directory's raw sequential disk bandwidth (no GPU).

Raw: ``threads`` files written, then read, in 32 MiB O_DIRECT (else buffered) requests from
page-aligned memory, one thread per file: what the disk gives sequential I/O from this process.
L2: the tier itself (`kvdepot.server.disk.DiskTier`, as the daemon drives it from its event
loop): objects of one chunk size written (header, xxh3-128 of the payload, tmp file, rename),
then read back and verified; GB/s count payload bytes. Each figure is the best of ``repeats``.

L3 (``--l3`` or ``--l3-url``): the tier (`kvdepot.server.remote.RemoteTier`: values built and
verified on its own thread) next to raw SET / GET of values of the same size through redis-py's
asyncio client with the same number in flight.

    python benchmarks/tiers.py [--dir DIR] [--total-bytes 2g] [--object-bytes 32m,2m] [--l3] [--out r.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time

from kvdepot.config import parse_bytes
from kvdepot.server.disk import DiskTier
from kvdepot.server.objfile import HEADER_BYTES, padded

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


def l2_scan(path: str, objects: int) -> dict:
    """Start-up scan of an L2 directory of ``objects`` small objects (4 KiB payloads): the time
    `DiskTier.open` takes to index them with no file page cached (``posix_fadvise(DONTNEED)``
    on every file: cold, as after a reboot or any restart following O_DIRECT writes), then
    once more with their headers cached (warm)."""
    tier = DiskTier(path, capacity_bytes=objects * (3 * HEADER_BYTES), queue_bytes=objects * 2 * HEADER_BYTES)
    tier.open()
    loop = asyncio.new_event_loop()
    tier.attach(loop)
    src = mmap.mmap(-1, HEADER_BYTES)
    src.write(os.urandom(HEADER_BYTES))
    try:
        async def write_all() -> None:
            done, left = asyncio.Event(), [objects]

            def one() -> None:
                left[0] -= 1
                if not left[0]:
                    done.set()

            for i in range(objects):
                assert tier.write(i.to_bytes(16, "little"), b"", "bench", "", "fp", memoryview(src), HEADER_BYTES, one)
            await done.wait()

        loop.run_until_complete(write_all())
    finally:
        tier.close()
        loop.close()
    out = {"objects": objects}
    for d, _, names in os.walk(path):  # (O_DIRECT writes leave nothing cached anyway)
        for name in names:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    for kind in ("cold", "warm"):  # a restart, then a second one (headers now cached)
        tier = DiskTier(path, capacity_bytes=objects * (3 * HEADER_BYTES), queue_bytes=HEADER_BYTES)
        t0 = time.perf_counter()
        found = tier.open()
        out[f"{kind}_s"] = time.perf_counter() - t0
        tier.close()
        assert found == objects, (found, objects)
    return out


def _redis_server(workdir: str) -> tuple[subprocess.Popen, str]:
    """A throwaway redis-server (no persistence) on a free local port."""
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        raise SystemExit("--l3 needs redis-server (apt-get install redis-server) or --l3-url")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    import redis

    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url, socket_connect_timeout=0.2).ping()
            return proc, url
        except redis.RedisError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)


def l3_raw(url: str, total_bytes: int, object_bytes: int, concurrency: int) -> dict:
    """redis-benchmark style: SET then GET of ``total_bytes`` in values of header + object
    bytes, ``concurrency`` commands in flight, with redis-py's asyncio client (hiredis)."""
    import redis.asyncio as ra

    n = max(1, total_bytes // object_bytes)
    value = os.urandom(object_bytes + 4096)

    async def run() -> tuple[float, float]:
        r = ra.Redis.from_url(url)
        sem = asyncio.Semaphore(concurrency)

        async def one(fn):
            async with sem:
                return await fn()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(lambda i=i: r.set(f"raw:{i}", value)) for i in range(n)))
        w = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(lambda i=i: r.get(f"raw:{i}")) for i in range(n)))
        rd = time.perf_counter() - t0
        assert all(len(g) == len(value) for g in got)
        await r.flushdb()
        await r.aclose()
        return w, rd

    w, rd = asyncio.run(run())
    return {"write_gbps": n * object_bytes / w / 1e9, "read_gbps": n * object_bytes / rd / 1e9}


def l3_tier(url: str, total_bytes: int, object_bytes: int, concurrency: int) -> dict:
    """The L3 tier (`kvdepot.server.remote.RemoteTier`) driven from an event loop as the daemon
    drives it: ``total_bytes`` of objects written, then fetched and verified, ``concurrency``
    fetches in flight."""
    from kvdepot.server.objfile import ObjectMeta
    from kvdepot.server.remote import RemoteTier

    n = max(1, total_bytes // object_bytes)
    loop = asyncio.new_event_loop()
    tier = RemoteTier(url, prefix="bench:", ttl_s=600, queue_bytes=(n + 1) * object_bytes, timeout_s=30)
    tier.open(loop)
    src = memoryview(os.urandom(object_bytes))
    keys = [i.to_bytes(16, "little") for i in range(n)]
    try:
        async def write_all() -> float:
            done, left = asyncio.Event(), [n]

            def one() -> None:
                left[0] -= 1
                if not left[0]:
                    done.set()

            t0 = time.perf_counter()
            for k in keys:
                assert tier.write(ObjectMeta(k, b"", "bench", "", "fp", object_bytes, b""), src, one)
            await done.wait()
            return time.perf_counter() - t0

        async def read_all() -> float:
            outs = [bytearray(object_bytes) for _ in range(concurrency)]
            sem = asyncio.Semaphore(concurrency)
            t0 = time.perf_counter()

            async def one(i: int, k: bytes) -> None:
                async with sem:
                    fut = loop.create_future()
                    tier.fetch(k, object_bytes, memoryview(outs[i % concurrency]),
                               lambda meta, err: fut.set_result(err))
                    err = await fut
                    assert err is None, err

            await asyncio.gather(*(one(i, k) for i, k in enumerate(keys)))
            return time.perf_counter() - t0

        w = loop.run_until_complete(write_all())
        assert tier.counters.errors == 0, tier.counters
        r = loop.run_until_complete(read_all())
        assert tier.counters.corrupt == 0
        flushed = loop.create_future()
        tier.flush(flushed.set_result)
        loop.run_until_complete(flushed)
        return {"objects": n, "write_gbps": n * object_bytes / w / 1e9, "read_gbps": n * object_bytes / r / 1e9}
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
    ap.add_argument("--l3", action="store_true", help="also L3, on a throwaway local redis-server")
    ap.add_argument("--l3-url", default="", help="also L3, on this Redis (its keys bench:* and raw:* are used)")
    ap.add_argument("--l3-total-bytes", type=parse_bytes, default=512 << 20)
    ap.add_argument("--l3-concurrency", type=int, default=8)
    ap.add_argument("--scan-objects", type=int, default=20000,
                    help="objects in the L2 start-up scan measurement (0: skip it)")
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
        if args.scan_objects:
            res["scan"] = l2_scan(os.path.join(base, "scan"), args.scan_objects)
            sc = res["scan"]
            print(f"L2 start-up scan of {sc['objects']} objects: {sc['cold_s']:.2f} s cold "
                  f"({1e6 * sc['cold_s'] / sc['objects']:.0f} us per object), {sc['warm_s']:.2f} s with headers cached")
            shutil.rmtree(os.path.join(base, "scan"))
        if args.l3 or args.l3_url:
            server, url = (None, args.l3_url) if args.l3_url else _redis_server(base)
            try:
                res["l3"] = []
                for size in [parse_bytes(s) for s in args.object_bytes.split(",")]:
                    raws = [l3_raw(url, args.l3_total_bytes, size, args.l3_concurrency) for _ in range(args.repeats)]
                    tiers = [l3_tier(url, args.l3_total_bytes, size, args.l3_concurrency) for _ in range(args.repeats)]
                    r = {"object_bytes": size, "raw_write_gbps": best(raws, "write_gbps"),
                         "raw_read_gbps": best(raws, "read_gbps"), "write_gbps": best(tiers, "write_gbps"),
                         "read_gbps": best(tiers, "read_gbps")}
                    r["write_vs_raw"] = r["write_gbps"] / r["raw_write_gbps"]
                    r["read_vs_raw"] = r["read_gbps"] / r["raw_read_gbps"]
                    res["l3"].append(r)
                    print(f"L3 objects of {size >> 20} MiB: write {r['write_gbps']:.2f} GB/s = "
                          f"{100 * r['write_vs_raw']:.1f}% of raw SET {r['raw_write_gbps']:.2f}, read "
                          f"{r['read_gbps']:.2f} GB/s = {100 * r['read_vs_raw']:.1f}% of raw GET {r['raw_read_gbps']:.2f}")
            finally:
                if server is not None:
                    server.kill()
                    server.wait()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
