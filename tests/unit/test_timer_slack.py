"""`timer_slack_s`: a napping wait ends its nap by the thread's timer slack early."""

import ctypes
import sys
import threading

import pytest

from kvdepot.client.connection import timer_slack_s

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_TIMERSLACK) is Linux")


@linux_only
def test_reads_the_calling_threads_own_slack():
    got = {}

    def body():
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(29, 123_000, 0, 0, 0) == 0  # PR_SET_TIMERSLACK: 123 us for this thread only
        got["slack_s"] = timer_slack_s()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert got["slack_s"] == pytest.approx(123e-6)
    # the main thread keeps its own (the kernel's default is 50 us; a parent may have changed it)
    main_ns = ctypes.CDLL(None).prctl(30, 0, 0, 0, 0)
    assert timer_slack_s() == pytest.approx(main_ns / 1e9)
