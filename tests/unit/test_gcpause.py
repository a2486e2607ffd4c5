"""The daemon's garbage-collector handling (`kvdepot.server.gcpause`)."""

from __future__ import annotations

import gc

from kvdepot.server.gcpause import GcPauses, freeze_heap


def test_pauses_are_counted_by_generation_until_closed():
    p = GcPauses()
    p.install()
    p.install()  # once only
    try:
        assert gc.callbacks.count(p._cb) == 1
        junk = [[i] for i in range(20000)]  # objects for the full collection to walk
        gc.collect(2)
        full = p.seconds[2]
        assert full > 0 and 0 < p.longest_s <= sum(p.seconds)
        gc.collect(0)
        assert p.seconds[0] > 0
        del junk
    finally:
        p.close()
    assert p._cb not in gc.callbacks
    gc.collect(2)
    assert p.seconds[2] == full  # no longer counting


def test_freeze_heap_takes_what_exists_out_of_later_collections():
    before = gc.get_freeze_count()
    kept = [[i] for i in range(5000)]  # lives on, as the daemon's start-up objects do
    try:
        freeze_heap()
        assert gc.get_freeze_count() >= before + len(kept)
        assert not any(o is kept for o in gc.get_objects())  # no generation holds it any more
    finally:
        gc.unfreeze()  # the test process's later tests collect as usual
