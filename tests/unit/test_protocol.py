"""kvdepot.protocol: message round trips, decode errors, golden frames of released versions."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.protocol import codec
from kvdepot.protocol.codec import decode_reply, decode_request, encode, error_frame
from kvdepot.protocol.errors import ErrorCode, KVDepotError, RequestError
from kvdepot.protocol.messages import (
    PROTOCOL_VERSION, REQUEST_TAGS, DaemonInfo, Describe, DescribeReply, EndRequest, EngineInfo, ErrorReply,
    Flush, FlushReply, Hello, HelloReply, KVGroupSpec, LayerGroupInfo, LayerSpec, Lookup, LookupReply, OkReply,
    Drain, Ping, Pong, Register, RegisterReply, Reply, Request, Retrieve, RetrieveReply, Settle, StorageSpec, Store,
    StoreReply, TierInfo, Unregister,
)

GOLDEN_DIR = pathlib.Path(__file__).parents[1] / "golden"
REQUEST_TYPES = Request.__args__
REPLY_TYPES = Reply.__args__
_raw = msgspec.msgpack.encode  # encodes arbitrary (possibly invalid) frames

KEY16 = bytes(range(16))
KEY_MIN = b"\x00" * 8  # ChunkKey: 8..64 bytes
KEY_MAX = b"\xff" * 64
NAME_MAX = "n" * 4096
U64_MAX = 2**64 - 1


def _golden_module():
    spec = importlib.util.spec_from_file_location("kvdepot_make_golden", GOLDEN_DIR / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _decode(frame: bytes, cls: type):
    return decode_request(frame) if cls in REQUEST_TYPES else decode_reply(frame)


def _tag(cls: type) -> str:
    return cls.__struct_config__.tag


# --------------------------------------------------------------------------- round trips

ENGINE = EngineInfo(
    registration="r", model="m", shard="replicated", pid=1, device="cpu", chunk_size=256, object_bytes=70272 * 256,
    layout_fingerprint="f" * 32,
    groups=[LayerGroupInfo(gid=0, layout="mla", dtype="bfloat16", kv_dtype="bfloat16", num_layers=61,
                           num_blocks=8, tokens_per_block=64, num_heads=1, num_kv=1, row_bytes=1152,
                           bytes_per_token=70272)])

ROUND_TRIP = [
    # requests
    Hello(rid=0, protocol_version=1),
    Hello(rid=U64_MAX, protocol_version=PROTOCOL_VERSION, client="vllm \u00e9\u6f22", pid=2**31),
    Register(rid=1, model="m", shard="tp0of1", chunk_size=256, storages=[], layers=[], groups=[]),
    Register(rid=2, model=NAME_MAX, shard="tp3of8", chunk_size=1, pid=7, device="cuda:3",
             storages=[StorageSpec("shm", 1, name="/seg"),
                       StorageSpec("cuda_ipc", 2**40, handle=bytes(64), device_uuid="GPU-x")],
             layers=[LayerSpec("l0", 1, 2**40, [2, 4, 16, 3, 64], [0, 3072, 192, 64, 1], "bfloat16",
                               "bfloat16", 1, "flash_attn")],
             groups=[KVGroupSpec(0, 16), KVGroupSpec(1, 32)]),
    Unregister(rid=3, registration=""),
    Lookup(rid=4, keys=[], chunk_size=256),
    Lookup(rid=4, keys=[[]], chunk_size=256),
    Lookup(rid=4, keys=[[KEY_MIN, KEY_MAX], [KEY16]], chunk_size=16, num_tokens=2**32, model="m", pin_request="p"),
    Store(rid=5, registration="r", keys=[], block_ids=[]),
    Store(rid=5, registration="r", keys=[KEY_MAX], block_ids=[[], [0, 2**63]], parent=KEY_MAX, cache_salt="",
          request="q", event=b"\x00" * 64),
    Store(rid=5, registration="r", keys=[KEY16], block_ids=[[1]], cache_salt="tenant"),
    Retrieve(rid=6, registration="r", keys=[], block_ids=[[]]),
    Retrieve(rid=6, registration="r", keys=[KEY_MIN, KEY16], block_ids=[[5, 4], [9]], skip_tokens=16, request="q"),
    EndRequest(rid=7, request=""),
    Describe(rid=8),
    Flush(rid=9),
    Flush(rid=9, cache_salt=""),
    Flush(rid=9, model="m", cache_salt="tenant", tier="l1"),
    Ping(rid=10),
    Drain(rid=11, registration="r1", through_seq=7),
    Settle(rid=12, registration="r1", through_rid=4294967299),
    Store(rid=12, registration="r1", keys=[b"k" * 32], block_ids=[[1]], staging_offset=256, fence=9,
          staging_seq=9),
    # replies
    HelloReply(rid=1, protocol_version=1, boot_id="b", version="0.1.0"),
    RegisterReply(rid=2, registration="r", layout_fingerprint="", object_bytes=0, boot_id="b"),
    OkReply(rid=3),
    LookupReply(rid=4, hit_chunks=0),
    StoreReply(rid=5, stored=1, present=2, skipped=3),
    RetrieveReply(rid=6, retrieved=0),
    RetrieveReply(rid=6, retrieved=2, event=bytes(range(64))),
    DescribeReply(rid=8, info=DaemonInfo(
        boot_id="b", version="v", protocol_version=1, endpoints=[], metrics_port=0, uptime_s=0.0, tiers=[],
        engines=[], lookup_requested_tokens=0, lookup_hit_tokens=0, stored_chunks=0, retrieved_chunks=0,
        evicted_chunks=0, transfer_engine="cpu-torch", pinned_requests=0)),
    DescribeReply(rid=8, info=DaemonInfo(
        boot_id="b", version="v", protocol_version=1, endpoints=["ipc:///a", "tcp://127.0.0.1:5555"],
        metrics_port=9400, uptime_s=1.25, tiers=[TierInfo("l1", 1 << 30, 4096, 1)], engines=[ENGINE, ENGINE],
        lookup_requested_tokens=10, lookup_hit_tokens=5, stored_chunks=1, retrieved_chunks=2,
        evicted_chunks=3, transfer_engine="cuda", pinned_requests=4)),
    FlushReply(rid=9, objects=0, bytes=0),
    Pong(rid=10, boot_id=""),
    ErrorReply(rid=0, code=int(ErrorCode.MALFORMED), message=""),
    ErrorReply(rid=11, code=999, message="x" * 10000),  # unknown codes still travel
]


def _id(msg) -> str:
    return type(msg).__name__


@pytest.mark.parametrize("msg", ROUND_TRIP, ids=_id)
def test_round_trip(msg):
    frame = encode(msg)
    assert isinstance(frame, bytes)
    out = _decode(frame, type(msg))
    assert type(out) is type(msg)
    assert out == msg
    raw = msgspec.msgpack.decode(frame)
    assert raw[:2] == [_tag(type(msg)), msg.rid], "wire form is [tag, rid, field...]"


def test_round_trip_covers_every_message_type():
    assert {type(m) for m in ROUND_TRIP} == set(REQUEST_TYPES) | set(REPLY_TYPES)


def test_tags_are_unique_and_requests_and_replies_are_disjoint():
    req_tags = [_tag(t) for t in REQUEST_TYPES]
    rep_tags = [_tag(t) for t in REPLY_TYPES]
    assert len(set(req_tags)) == len(req_tags)
    assert len(set(rep_tags)) == len(rep_tags)
    assert not set(req_tags) & set(rep_tags)
    assert REQUEST_TAGS == frozenset(req_tags)


def test_flush_cache_salt_none_and_empty_are_distinct():
    any_salt, unsalted = Flush(rid=1), Flush(rid=1, cache_salt="")
    assert encode(any_salt) != encode(unsalted)
    assert decode_request(encode(any_salt)).cache_salt is None
    assert decode_request(encode(unsalted)).cache_salt == ""


def test_bytes_fields_are_msgpack_bin_not_str():
    # keys and handles travel as msgpack bin; a str where bytes belong is malformed
    raw = msgspec.msgpack.decode(encode(Store(rid=1, registration="r", keys=[KEY16], block_ids=[[0]])))
    assert raw[3] == [KEY16]
    frame = _raw(["store", 1, "r", [KEY16.hex()], [[0]]])
    with pytest.raises(RequestError) as ei:
        decode_request(frame)
    assert (ei.value.code, ei.value.rid) == (ErrorCode.MALFORMED, 1)


def test_missing_trailing_defaults_are_filled():
    # an older (shorter) frame decodes with the newer fields' defaults
    assert decode_request(_raw(["hello", 3, 1])) == Hello(rid=3, protocol_version=1, client="", pid=0)
    assert decode_request(_raw(["store", 4, "r", [KEY16], [[1]]])) == Store(
        rid=4, registration="r", keys=[KEY16], block_ids=[[1]])
    assert decode_request(_raw(["flush", 5])) == Flush(rid=5, cache_salt=None)


def test_extra_trailing_fields_are_ignored():
    # a newer peer's appended fields do not break an older decoder
    assert decode_request(_raw(["ping", 3, "future", 1])) == Ping(rid=3)
    assert decode_reply(_raw(["getR", 3, 2, b"", [1], "future"])) == RetrieveReply(rid=3, retrieved=2, chains=[1])


def test_error_frame():
    out = decode_reply(error_frame(17, ErrorCode.LAYOUT, "use a multiple of 32 (--chunk-size)"))
    assert out == ErrorReply(rid=17, code=6, message="use a multiple of 32 (--chunk-size)")
    err = KVDepotError(out.code, out.message)
    assert err.code is ErrorCode.LAYOUT and "[LAYOUT]" in str(err)
    assert KVDepotError(999, "x").code == 999  # unknown wire codes are kept as ints


def test_error_codes_are_stable():
    # wire values: append only, never renumber
    assert {c.name: c.value for c in ErrorCode} == {
        "MALFORMED": 1, "UNKNOWN_MESSAGE": 2, "VERSION_MISMATCH": 3, "UNKNOWN_REGISTRATION": 4,
        "INVALID_ARGUMENT": 5, "LAYOUT": 6, "ENGINE_MEMORY": 7, "INTERNAL": 8, "TIMEOUT": 9, "UNSUPPORTED": 10,
            "DISCONNECTED": 11, "UNAVAILABLE": 12, "FORBIDDEN": 13, "TIER_UNAVAILABLE": 14,
        "BACKPRESSURE": 15, "DEADLINE": 16,
    }


# --------------------------------------------------------------------------- decode errors

BAD_FRAMES = [
    # (id, frame, code, recovered rid)
    ("garbage-opcode", b"\xc1", ErrorCode.MALFORMED, 0),
    ("empty", b"", ErrorCode.MALFORMED, 0),
    ("truncated", encode(Ping(rid=5))[:-1], ErrorCode.MALFORMED, 0),
    ("trailing-bytes", encode(Ping(rid=5)) + b"\x00", ErrorCode.MALFORMED, 0),
    ("map", _raw({"t": "ping", "rid": 1}), ErrorCode.MALFORMED, 0),
    ("int", _raw(5), ErrorCode.MALFORMED, 0),
    ("str", _raw("ping"), ErrorCode.MALFORMED, 0),
    ("empty-array", _raw([]), ErrorCode.MALFORMED, 0),
    ("tag-only", _raw(["ping"]), ErrorCode.MALFORMED, 0),
    ("int-tag", _raw([1, 2]), ErrorCode.MALFORMED, 2),
    ("negative-rid", _raw(["ping", -1]), ErrorCode.MALFORMED, 0),
    ("bool-rid", _raw(["ping", True]), ErrorCode.MALFORMED, 0),
    ("str-rid", _raw(["ping", "7"]), ErrorCode.MALFORMED, 0),
    ("missing-field", _raw(["unreg", 5]), ErrorCode.MALFORMED, 5),
    ("wrong-type-registration", _raw(["store", 8, 5, [KEY16], [[1]]]), ErrorCode.MALFORMED, 8),
    ("wrong-type-keys", _raw(["look", 9, [KEY16], 256]), ErrorCode.MALFORMED, 9),
    ("wrong-type-block-ids", _raw(["get", 10, "r", [KEY16], [1, 2]]), ErrorCode.MALFORMED, 10),
    ("negative-block-id", _raw(["store", 7, "r", [KEY16], [[1, -2]]]), ErrorCode.MALFORMED, 7),
    ("negative-skip-tokens", _raw(["get", 11, "r", [KEY16], [[1]], -16]), ErrorCode.MALFORMED, 11),
    ("zero-chunk-size", _raw(["look", 12, [[KEY16]], 0]), ErrorCode.MALFORMED, 12),
    ("key-too-short", _raw(["look", 13, [[b"\x00" * 7]], 256]), ErrorCode.MALFORMED, 13),
    ("key-too-long", _raw(["look", 14, [[b"\x00" * 65]], 256]), ErrorCode.MALFORMED, 14),
    ("name-too-long", _raw(["unreg", 15, "n" * 4097]), ErrorCode.MALFORMED, 15),
    ("bad-storage-kind", encode(Register(rid=16, model="m", shard="s", chunk_size=16, layers=[], groups=[],
                                         storages=[StorageSpec("shm", 1)])).replace(b"\xa3shm", b"\xa3nfs"),
     ErrorCode.MALFORMED, 16),
    ("invalid-utf8-field", b"\x93\xa5unreg\x05\xa1\x80", ErrorCode.MALFORMED, 0),  # msgspec: UnicodeDecodeError
    ("invalid-utf8-tag", b"\x92\xa2\xff\xfe\x05", ErrorCode.MALFORMED, 0),
    ("flush-salt-int", _raw(["flush", 17, "", 3]), ErrorCode.MALFORMED, 17),
    ("reply-tag-ok", encode(OkReply(rid=4)), ErrorCode.UNKNOWN_MESSAGE, 4),
    ("reply-tag-err", error_frame(18, ErrorCode.INTERNAL, "x"), ErrorCode.UNKNOWN_MESSAGE, 18),
    ("reply-tag-pong", encode(Pong(rid=19, boot_id="b")), ErrorCode.UNKNOWN_MESSAGE, 19),
    ("unknown-tag", _raw(["nope", 9]), ErrorCode.UNKNOWN_MESSAGE, 9),
    ("unknown-tag-negative-rid", _raw(["nope", -1]), ErrorCode.UNKNOWN_MESSAGE, 0),
    ("unknown-tag-alone", _raw(["nope"]), ErrorCode.UNKNOWN_MESSAGE, 0),
]


@pytest.mark.parametrize("frame,code,rid", [b[1:] for b in BAD_FRAMES], ids=[b[0] for b in BAD_FRAMES])
def test_decode_request_errors(frame, code, rid):
    with pytest.raises(RequestError) as ei:
        decode_request(frame)
    err = ei.value
    assert err.code is code
    assert type(err.rid) is int and err.rid == rid
    assert err.__cause__ is None and err.__suppress_context__
    # the daemon answers with this; the client must be able to decode it
    assert decode_reply(error_frame(err.rid, err.code, err.message)) == ErrorReply(
        rid=rid, code=int(code), message=err.message)


def test_unknown_tag_error_names_the_tag():
    with pytest.raises(RequestError, match="'nope'"):
        decode_request(_raw(["nope", 1]))


def test_decode_request_accepts_memoryview():
    assert decode_request(memoryview(encode(Ping(rid=3)))) == Ping(rid=3)


def test_oversized_frame_is_refused_before_decoding(monkeypatch):
    frame = encode(Unregister(rid=5, registration="x" * 100))
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", len(frame) - 1)
    with pytest.raises(RequestError) as ei:
        decode_request(frame)
    assert (ei.value.code, ei.value.rid) == (ErrorCode.MALFORMED, 0)
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", len(frame))
    assert decode_request(frame).rid == 5


def test_decode_reply_rejects_garbage():
    with pytest.raises(msgspec.DecodeError):
        decode_reply(b"\xc1")
    with pytest.raises(msgspec.DecodeError):
        decode_reply(encode(Ping(rid=1)))  # a request is not a reply


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_decode_request_never_crashes_on_bytes(frame):
    try:
        msg = decode_request(frame)
    except RequestError as err:
        assert err.code in (ErrorCode.MALFORMED, ErrorCode.UNKNOWN_MESSAGE)
        assert type(err.rid) is int and err.rid >= 0
    else:
        assert isinstance(msg, REQUEST_TYPES)


_leaves = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=70)
# nested lists two levels deep, spelled out: hypothesis's st.recursive sometimes raised a spurious
# HypothesisDeprecationWarning ("doesn't use its argument") for an extend that does
_values = _leaves | st.lists(_leaves | st.lists(_leaves, max_size=4), max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(REQUEST_TAGS) + ["ok", "nope"]), st.integers(-5, 2**64 - 1), st.lists(_values, max_size=8))
def test_decode_request_never_crashes_on_arrays(tag, rid, fields):
    frame = _raw([tag, rid, *fields])
    try:
        msg = decode_request(frame)
    except RequestError as err:
        if tag not in REQUEST_TAGS:
            assert err.code is ErrorCode.UNKNOWN_MESSAGE
        else:
            assert err.code is ErrorCode.MALFORMED
        assert err.rid == (rid if rid >= 0 else 0)
    else:
        assert _tag(type(msg)) == tag and msg.rid == rid


# --------------------------------------------------------------------------- golden frames


def _golden_versions() -> list[int]:
    return sorted(int(p.stem.removeprefix("protocol_v")) for p in GOLDEN_DIR.glob("protocol_v*.json"))


def test_golden_file_of_every_version_up_to_current_exists():
    assert _golden_versions() == list(range(1, PROTOCOL_VERSION + 1)), (
        "run `python tests/golden/make_golden.py` once for a new protocol version (never regenerate old ones)")


@pytest.mark.parametrize("version", _golden_versions())
def test_golden_frames_decode(version):
    expected = _golden_module().MESSAGES[version]()
    frames = json.loads((GOLDEN_DIR / f"protocol_v{version}.json").read_text())
    assert set(frames) == set(expected)
    for name, hexframe in frames.items():
        frame = bytes.fromhex(hexframe)
        cls = type(expected[name])
        assert cls.__name__ == name
        assert msgspec.msgpack.decode(frame)[0] == _tag(cls), f"{name}: tag changed"
        out = _decode(frame, cls)
        assert type(out) is cls and out == expected[name], name


def test_golden_v1_covers_every_v1_message_type():
    names = set(json.loads((GOLDEN_DIR / "protocol_v1.json").read_text()))
    v1_types = {"Hello", "Register", "Unregister", "Lookup", "Store", "Retrieve", "EndRequest", "Describe",
                "Flush", "Ping", "HelloReply", "RegisterReply", "OkReply", "LookupReply", "StoreReply",
                "RetrieveReply", "DescribeReply", "FlushReply", "Pong", "ErrorReply"}
    assert names == v1_types
    # message types are never removed
    assert v1_types <= {t.__name__ for t in (*REQUEST_TYPES, *REPLY_TYPES)}


def test_lookup_sizes_are_bounded_so_the_daemons_counters_cannot_overflow():
    """Found by tests/integration/test_fuzz_daemon.py: two lookups with num_tokens near 2**63
    pushed the daemon's requested-token counter past uint64, and every Describe reply after that
    failed to encode (no reply at all)."""
    keys = [[b"k" * 16]]
    for bad in (dict(chunk_size=(1 << 20) + 1), dict(chunk_size=16, num_tokens=(1 << 32) + 1)):
        with pytest.raises(RequestError) as err:
            decode_request(encode(Lookup(rid=3, keys=keys, **{"num_tokens": 0, **bad})))
        assert err.value.code is ErrorCode.MALFORMED and err.value.rid == 3
    ok = decode_request(encode(Lookup(rid=3, keys=keys, chunk_size=1 << 20, num_tokens=1 << 32)))
    assert ok.chunk_size == 1 << 20
