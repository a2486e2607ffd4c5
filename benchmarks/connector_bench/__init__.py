"""The parts of `benchmarks/vllm_connector.py` (the vLLM connector benchmark): the model it
drives (`model`), the direct-client and roofline references (`refs`), the prefix-hit runs
(`hits`), the trace report (`trace`), the do-nothing connector of ``--floor`` (`floor`), the
timers (`timers`) and the text report (`report`).

The benchmarks that drive vLLM's real scheduler (this one, `benchmarks/scheduler_step.py`) run
on the tests' vLLM harness (`tests/vllm/vllm_harness.py`, vLLM 0.33's real scheduler and
connector lifecycle, compiled modules stubbed where absent), imported here, before anything of
vLLM (its stubs must come first), from the one directory outside benchmarks/ they read;
`harness()` returns it.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

HARNESS_DIR = Path(__file__).resolve().parents[2] / "tests" / "vllm"
if str(HARNESS_DIR) not in sys.path:
    sys.path.append(str(HARNESS_DIR))
_HARNESS = importlib.import_module("vllm_harness")


def harness():
    """The ``vllm_harness`` module of the tests."""
    return _HARNESS
