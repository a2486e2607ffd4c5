"""A kernel's first launch in a process does not wait for another stream's running kernel:
the kernel library loads all of its kernels when an engine is created (CUDA's lazy loading
would load each at its first launch, which may wait for the context's running work: a vLLM
worker's first store or load behind a forward). Runs tests/gpu/first_launch_proc.py in a fresh
process, where no kernel of the library has run yet. Skipped cleanly without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HERE = Path(__file__).parent


def test_first_gather_and_scatter_of_a_process_do_not_wait_for_another_streams_kernel():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_MODULE_LOADING"}
    p = subprocess.run([sys.executable, str(HERE / "first_launch_proc.py")], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    print(got)
    assert got["busy_s"] > 1.0  # the other stream's kernel was long enough to see a wait
    for name in ("gather", "scatter"):
        assert got[name]["done_while_busy"], got
        assert got[name]["call_s"] < got["busy_s"] / 2, got
