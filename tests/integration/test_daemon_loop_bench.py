"""benchmarks/daemon_loop.py (the daemon's event-loop CPU per request over its stream socket,
copies stubbed, no GPU) still runs end to end against the daemon as it is: every store stores
its chunk and every retrieve finds its chunk (the benchmark raises otherwise), in all three
phases. No timing is checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_daemon_loop_benchmark_answers_every_request_in_every_phase(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("daemon_loop", None)
    import daemon_loop

    out = tmp_path / "r.json"
    assert daemon_loop.main(["--requests", "300", "--depth", "4", "--repeat", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    assert r["object_bytes"] == 80 * 1 * 2 * 128 * 2 * 64  # 70B TP8, 64 tokens
    assert set(r["phases"]) == {"store", "retrieve", "both"}
    for ph in r["phases"].values():
        assert len(ph["runs"]) == 2
        assert ph["loop_us_per_request"] == min(x["loop_us_per_request"] for x in ph["runs"]) > 0
        assert ph["requests_per_s"] > 0


def test_daemon_loop_benchmark_with_the_copy_call_goes_through_the_kernel_library_call(tmp_path, monkeypatch):
    """``--copy-call``: the daemon's real CudaDevicePath.copy_staged and its call into a stand-in
    kernel library (built with cc) complete every request of every phase."""
    import shutil

    import pytest

    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) for the stand-in kernel library")
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("daemon_loop", None)
    import daemon_loop

    out = tmp_path / "r.json"
    assert daemon_loop.main(["--requests", "200", "--depth", "4", "--repeat", "1", "--copy-call",
                             "--out", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    assert r["copy_call"] is True
    assert all(ph["requests_per_s"] > 0 for ph in r["phases"].values())


def test_the_stand_in_library_answers_the_daemons_copy_call(tmp_path, monkeypatch):
    """The stand-in's kvd_dma_call reads the daemon's argument block (KvdDmaCall) as the real
    library does: the completion token reaches the pipe, and a block without a lane is refused."""
    import ctypes
    import os
    import shutil
    import struct

    import pytest

    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) for the stand-in kernel library")
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("daemon_loop", None)
    import daemon_loop

    lib = ctypes.CDLL(daemon_loop.build_stub(str(tmp_path)))
    lib.kvd_dma_call.argtypes = [ctypes.c_void_p]
    r, w = os.pipe()
    notified = ctypes.c_int(0)
    block = ctypes.create_string_buffer(72 + 16 * 2)
    struct.pack_into("=QQQQqqqQQ4Q", block, 0, 5, 0, 0, 64, 2, 1, w, 0xABCDEF, ctypes.addressof(notified), 1, 2, 3, 4)
    assert lib.kvd_dma_call(ctypes.addressof(block)) == 0 and notified.value == 1
    assert struct.unpack("<Q", os.read(r, 8))[0] == 0xABCDEF
    struct.pack_into("=Q", block, 0, 0)  # no lane
    assert lib.kvd_dma_call(ctypes.addressof(block)) == 1 and notified.value == 0
    os.close(r)
    os.close(w)


def test_the_daemons_copy_call_takes_requests_of_many_copies(tmp_path, monkeypatch):
    """CudaDevicePath.copy_staged over the stand-in library: a request of more copies than its
    argument block held so far gets a larger block, and every request's completion comes."""
    import asyncio
    import shutil

    import pytest

    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) for the stand-in kernel library")
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("daemon_loop", None)
    import daemon_loop

    from kvdepot.gpu.cuda_path import CompletionPipe

    async def run() -> list:
        pipe = CompletionPipe(asyncio.get_running_loop())
        path = daemon_loop._stub_path(daemon_loop.build_stub(str(tmp_path)), pipe)
        got: list = []
        for n in (1, 300, 2, 300):
            path.copy_staged(True, [4096 * (k + 1) for k in range(n)], [8192 * (k + 1) for k in range(n)], 64, None,
                             lambda err, n=n: got.append((n, err)))
        for _ in range(200):
            if len(got) == 4:
                break
            await asyncio.sleep(0.01)
        return got

    assert asyncio.run(run()) == [(1, None), (300, None), (2, None), (300, None)]
