"""Hypothesis against a live daemon, with requests built from the message classes themselves
(msgspec's type info: every field of every request type, its constraints, nested structs): each
request decodes, reaches its handler, and gets its reply or a typed error; the daemon stays up
and a real engine's cached bytes stay right. Half the requests name a live registration, so
the handlers' checks of block ids, keys, sizes and offsets are reached, not only the lookup of
an unknown id."""

from __future__ import annotations

import random
import typing
import uuid

import msgspec
import msgspec.inspect as mi
import msgspec.structs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kv_engine as ke
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode
from kvdepot.protocol.transport import StreamSocket, stream_path

REQUESTS = typing.get_args(m.Request)
_INTS = st.one_of(st.integers(0, 64), st.sampled_from([255, 256, 4096, 2**31 - 1, 2**31, 2**63 - 1]),
                  st.integers(0, 2**40))


def _strategy(t: mi.Type) -> st.SearchStrategy:
    """A strategy for values of msgspec type ``t`` that pass its constraints (so the request
    decodes and reaches its handler)."""
    if isinstance(t, mi.IntType):
        lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -(2**40))
        hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 2**63 - 1)
        return st.one_of(_INTS, st.integers(lo, min(hi, lo + 8))).filter(lambda v: lo <= v <= hi)
    if isinstance(t, mi.StrType):
        if t.pattern:
            return st.from_regex(t.pattern, fullmatch=True)
        return st.text(st.characters(codec="ascii"), max_size=min(t.max_length or 40, 40))
    if isinstance(t, mi.BytesType):
        return st.binary(min_size=t.min_length or 0, max_size=min(t.max_length or 80, 80))
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.FloatType):
        return st.floats(allow_nan=False, allow_infinity=False)
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.ListType):
        return st.lists(_strategy(t.item_type), min_size=t.min_length or 0, max_size=min(t.max_length or 6, 6))
    if isinstance(t, mi.DictType):
        return st.dictionaries(_strategy(t.key_type), _strategy(t.value_type), max_size=4)
    if isinstance(t, mi.UnionType):
        return st.one_of(*[_strategy(x) for x in t.types])
    if isinstance(t, mi.StructType):
        fields = {f.name: _strategy(f.type) for f in t.fields if f.name != "rid"}
        return st.builds(t.cls, rid=st.just(0), **fields) if any(f.name == "rid" for f in t.fields) \
            else st.builds(t.cls, **fields)
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    raise NotImplementedError(f"no strategy for {t}")


_requests = st.one_of(*[_strategy(mi.type_info(cls)) for cls in REQUESTS])


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_generated_requests_of_every_type_round_trip_through_the_codec(data):
    for cls in REQUESTS:
        req = data.draw(_strategy(mi.type_info(cls)))
        assert type(req) is cls
        assert codec.decode_request(codec.encode(req)) == req


@pytest.fixture(scope="module")
def live(module_daemon):
    """A real engine with 3 chunks stored, and a raw stream connection to the daemon."""
    spec = ke.EngineSpec(module_daemon.endpoint, ke.SMOLLM2, "LBHNC", (16,), (24,), 16, 9100, model_id="fuzzed")
    eng = ke.Engine(spec)
    keys = eng.keys(ke.prompt_tokens(9100, 48))
    assert eng.client.store(eng.reg, keys, [[0, 1, 2]]).stored == 3
    sock = StreamSocket(stream_path(module_daemon.endpoint), f"fuzz-{uuid.uuid4().hex[:8]}".encode())
    yield eng, keys, sock
    sock.close()
    eng.close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(_requests, st.randoms(use_true_random=False))
def test_generated_requests_get_a_reply_or_a_typed_error(live, module_daemon, req, rnd: random.Random):
    eng, keys, sock = live
    if hasattr(req, "registration") and rnd.random() < 0.5:
        req.registration = eng.reg.id
    if isinstance(req, (m.Store, m.Retrieve, m.Lookup)) and rnd.random() < 0.3:
        req.keys = [keys] if isinstance(req, m.Lookup) else keys[:rnd.randint(0, 3)]
    if isinstance(req, m.Flush) and req.model in ("", "fuzzed"):
        req.model = "not-the-engine's"  # the engine's chunks are checked after the run
    if isinstance(req, m.Unregister) and req.registration == eng.reg.id:
        req.registration = "fuzz-unknown"
    if isinstance(req, m.Register) and req.storages and rnd.random() < 0.5:
        # a real segment, with layers that may not fit it
        req.storages[0] = msgspec.structs.replace(req.storages[0], name=eng.cache.name)
    req.rid = rnd.randint(1, 2**31)
    frame = codec.encode(req)
    if len(frame) > codec.MAX_FRAME_BYTES:
        return
    sock.send(frame)
    assert sock.poll(20_000), f"no reply to {req!r}"
    reply = codec.decode_reply(sock.recv())
    assert reply.rid == req.rid
    if isinstance(reply, m.ErrorReply):
        assert reply.code in set(ErrorCode) and reply.code not in (ErrorCode.INTERNAL,), reply
    assert module_daemon.alive


def test_after_the_fuzzing_the_engine_reads_back_its_own_bytes(live, module_daemon):
    eng, keys, _ = live
    assert eng.client.retrieve(eng.reg, keys, [[5, 6, 7]]) == 3
    for layer in range(len(eng.cache.layer_names)):
        a = eng.cache.read_tokens(layer, [0, 1, 2], as_bytes=True)
        b = eng.cache.read_tokens(layer, [5, 6, 7], as_bytes=True)
        assert a.equal(b), layer
    assert module_daemon.alive
