"""`Drain`: the daemon settles staged requests whose replies a client lost. It answers once
every staged request it accepted up to ``through_seq`` finished its copies, and refuses any
such request that still arrives afterwards (its region may hold other bytes by then). Driven
through the daemon's dispatcher with the CUDA copies stubbed (benchmarks/daemon_cpu.py)."""

import importlib.util
import os
from pathlib import Path

import torch

from kvdepot.client.kvcache import KVGroupShape
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "daemon_cpu.py"


def _daemon(tmp_path):
    spec = importlib.util.spec_from_file_location("daemon_cpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    d, reg, lay = bench._daemon_with_registration(KVGroupShape(0, 2, 1, 64, 16, torch.bfloat16), 64, 64 << 20,
                                                  str(tmp_path))
    replies: list = []
    d.front.send = lambda identity, frame: replies.append(codec.decode_reply(frame))
    return d, reg, lay, replies


def test_a_drain_waits_for_accepted_copies_and_refuses_late_requests(tmp_path):
    d, reg, lay, replies = _daemon(tmp_path)
    path = d._cuda.p
    ids = [list(range(4))]

    def store(rid, seq, offset=0):
        d.front._dispatch(b"e", codec.encode(m.Store(rid=rid, registration=reg.id, keys=[os.urandom(16)], block_ids=ids,
                                               staging_offset=offset, staging_seq=seq)))

    store(1, 3)  # accepted; its copy has not finished
    assert len(path.done) == 1 and replies == []
    d.front._dispatch(b"e", codec.encode(m.Drain(rid=2, registration=reg.id, through_seq=5)))
    assert replies == []  # held by the copy of region 3
    store(3, 4)  # a request of a drained region still on its way: refused, nothing copied
    assert len(path.done) == 1
    assert isinstance(replies[-1], m.ErrorReply) and replies[-1].code == ErrorCode.INVALID_ARGUMENT
    store(4, 6, lay.object_bytes)  # a newer region: served as usual
    assert len(path.done) == 2
    path.done.pop(0)(None)  # region 3's copies end: its store and the Drain are answered
    assert sorted((type(r).__name__, r.rid) for r in replies[-2:]) == [("OkReply", 2), ("StoreReply", 1)]
    n = len(replies)
    d.front._dispatch(b"e", codec.encode(m.Drain(rid=5, registration=reg.id, through_seq=6)))
    assert len(replies) == n  # held: region 6 is still copying
    path.done.pop(0)(RuntimeError("copy failed"))  # a failed copy ends the request too
    assert sorted((type(r).__name__, r.rid) for r in replies[-2:]) == [("ErrorReply", 4), ("OkReply", 5)]
    assert not reg.staged_busy and not reg.drains


def test_a_drain_with_nothing_in_flight_is_answered_at_once(tmp_path):
    d, reg, _, replies = _daemon(tmp_path)
    d.front._dispatch(b"e", codec.encode(m.Drain(rid=7, registration=reg.id, through_seq=1)))
    assert isinstance(replies[-1], m.OkReply) and replies[-1].rid == 7
    d.front._dispatch(b"e", codec.encode(m.Drain(rid=8, registration="nope", through_seq=1)))
    assert replies[-1].code == ErrorCode.UNKNOWN_REGISTRATION
