"""`kvdepot.client.staging.GatherGate` on the GPU: a stream's wait for another stream's
numbered work (the vLLM worker's forward after the gathers of a sliding-window model's
stores), its timeout, and the claim that keeps a started piece of work from being abandoned."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SPIN_CYCLES_PER_MS = 1_500_000  # torch.cuda._sleep spins clock cycles (~1.5-2 GHz on H100 / H200)


@pytest.fixture
def gate():
    from kvdepot.client.staging import GatherGate
    from kvdepot.gpu.kernels import load_kernels

    kernels = load_kernels()
    if kernels is None:
        pytest.skip("no kernel library")
    g = GatherGate(kernels, timeout_s=5.0)
    yield g
    torch.cuda.synchronize()
    g.close()


def _marker_after(stream, marker, value):
    with torch.cuda.stream(stream):
        marker.fill_(value)


def test_the_waiting_stream_runs_only_after_the_signal(gate):
    engine, side = torch.cuda.Stream(), torch.cuda.Stream()
    marker = torch.zeros(1, dtype=torch.int64, device="cuda")
    gate.wait(1, engine)
    _marker_after(engine, marker, 7)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200 * SPIN_CYCLES_PER_MS)  # the "gathers": ~100-130 ms of work
        seen = marker.clone()  # what the engine's stream had done by the end of that work
    gate.signal(1, side)
    engine.synchronize()
    side.synchronize()
    assert seen.item() == 0, "the engine's stream went on before the signal"
    assert marker.item() == 7 and gate.done == 1 and gate.abandoned == 0


def test_a_wait_gives_up_after_its_timeout_and_the_late_work_is_refused(gate):
    engine = torch.cuda.Stream()
    gate.timeout_s = 0.05
    t0 = time.monotonic()
    gate.wait(2, engine)  # number 2 is never signalled
    engine.synchronize()
    waited_s = time.monotonic() - t0
    assert 0.04 < waited_s < 2.0, waited_s
    assert gate.abandoned == 2
    assert gate.claim(2) is False  # the thread that gets there late must not gather
    assert gate.claim(3) is True


def test_a_claimed_number_is_waited_for_past_the_timeout(gate):
    engine, side = torch.cuda.Stream(), torch.cuda.Stream()
    gate.timeout_s = 0.02
    assert gate.claim(4) is True  # the thread started on number 4 before the wait could give up
    marker = torch.zeros(1, dtype=torch.int64, device="cuda")
    gate.wait(4, engine)
    _marker_after(engine, marker, 9)
    with torch.cuda.stream(side):
        torch.cuda._sleep(300 * SPIN_CYCLES_PER_MS)  # far longer than the timeout
        seen = marker.clone()
    gate.signal(4, side)
    engine.synchronize()
    side.synchronize()
    assert seen.item() == 0 and marker.item() == 9
    assert gate.abandoned == 4  # it timed out, saw the claim, and waited on
    assert gate.done == 4
