"""benchmarks/transfer.py (a GPU benchmark) still imports, parses its options and refuses to
run without CUDA on this CPU machine, and its goal checks read the rows as the issue states
them (the measurements themselves run on the GPU machine only)."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _report():
    sys.path.insert(0, str(BENCH))
    try:
        from transfer_bench import report
    finally:
        sys.path.remove(str(BENCH))
    return report


def test_the_entry_point_imports_parses_and_needs_cuda():
    out = subprocess.run([sys.executable, str(BENCH / "transfer.py"), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--outstanding" in out.stdout and "fence word" in out.stdout, out.stderr
    out = subprocess.run([sys.executable, str(BENCH / "transfer.py"), "--quick"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "needs CUDA" in out.stdout, out.stdout + out.stderr


def _row(chunk, store, retrieve, both, lone_store=50.0, lone_retrieve=60.0, zmq=40.0):
    return {"shape": "s", "chunk_tokens": chunk, "object_bytes": 1 << 20, "chunks": 8, "store_gbps": 50.0,
            "retrieve_gbps": 50.0, "store_vs_roofline": store, "retrieve_vs_roofline": retrieve,
            "bidir_gbps": both, "bidir_vs_roofline": both / 100, "roofline_d2h_gbps": 55.0,
            "roofline_h2d_gbps": 55.0, "roofline_bidir_gbps": 100.0, "lone_store_overhead_us": lone_store,
            "lone_retrieve_overhead_us": lone_retrieve, "zmq_echo_us": zmq, "ping_us": 60.0}


def test_goals_per_chunk_size():
    report = _report()
    got = {t["target"]: t["pass"] for t in report.evaluate_targets([
        _row(64, 0.96, 0.94, 91.0), _row(256, 0.97, 0.95, 94.0, lone_retrieve=81.0), _row(1024, 0.99, 0.99, 99.0)])}
    assert got == {
        "s chunk 64: store stream >= 95% of roofline": True,
        "s chunk 64: retrieve stream >= 95% of roofline": False,
        "s chunk 64: store+retrieve together >= 95% of the both-ways roofline": False,
        "s chunk 256: store stream >= 96% of roofline": True,
        "s chunk 256: retrieve stream >= 96% of roofline": False,
        "s chunk 256: store+retrieve together >= 96% of the both-ways roofline": False,
        "s chunk 256: lone store overhead <= 2x bare zmq rtt (us)": True,
        "s chunk 256: lone retrieve overhead <= 2x bare zmq rtt (us)": False,
        "s chunk 1024: store stream >= 96% of roofline": True,
        "s chunk 1024: retrieve stream >= 96% of roofline": True,
        "s chunk 1024: store+retrieve together >= 96% of the both-ways roofline": True,
    }
    assert "s" in report.format_row(_row(256, 0.97, 0.95, 94.0))


def test_a_gpu_run_without_the_kernel_library_says_why(monkeypatch):
    """The GPU benchmarks refuse to measure the torch fallback by accident (`kernels_missing`):
    a .so built from other source (any edit of kvdepot/gpu/csrc, comments included) is named
    with the reason; a library that loads is no reason."""
    sys.path.insert(0, str(BENCH))
    try:
        from transfer_bench import procs
    finally:
        sys.path.remove(str(BENCH))
    from kvdepot.gpu import kernels

    monkeypatch.setattr(kernels, "load_kernels", lambda: object())
    assert procs.kernels_missing() is None

    monkeypatch.setattr(kernels, "load_kernels", lambda: None)
    monkeypatch.setattr(kernels, "_load_error", "/tmp/stale.so was built from other source (aaaa, this kvdepot has bbbb)")
    assert procs.kernels_missing() == "/tmp/stale.so was built from other source (aaaa, this kvdepot has bbbb)"
    assert procs.FALLBACK_FLAG == "--allow-torch-fallback"
