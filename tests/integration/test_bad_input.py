"""Bad input never crashes or silences the daemon: every bad frame and every bad request gets an
`ErrorReply` with the right `ErrorCode`, and afterwards the same daemon still serves a new
client bit-exact. All tests of this module share one daemon, and the last test checks it. It
accepts named /dev/shm segments (``--allow-shm-names``), so that their checks are covered too.
"""

from __future__ import annotations

import dataclasses
import os

import msgspec
import pytest
import torch
import zmq

import kv_engine as ke
from conftest import start_daemon
from kvdepot.client import KVDepotClient
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.codec import MAX_FRAME_BYTES
from kvdepot.protocol.errors import ErrorCode, KVDepotError

KEY = b"k" * 16
_pack = msgspec.msgpack.encode


@pytest.fixture(scope="module")
def module_daemon(tmp_path_factory):
    """The module's daemon, accepting named segments."""
    d = start_daemon(tmp_path_factory.mktemp("daemon"), "--allow-shm-names")
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def raw(module_daemon):
    """A bare DEALER socket connected to the module's daemon."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(module_daemon.endpoint)
    yield sock
    sock.close(0)
    ctx.term()


def ask(sock: zmq.Socket, frames: list[bytes], timeout_s: float = 10.0) -> m.Msg:
    """Send one message (``frames``), return the one reply, and check that no second one comes."""
    sock.send_multipart(frames)
    assert sock.poll(int(timeout_s * 1000)), f"no reply to {frames[0][:40]!r}"
    reply = sock.recv_multipart()
    assert len(reply) == 1, f"reply of {len(reply)} frames"
    assert not sock.poll(50), "more than one reply"
    return codec.decode_reply(reply[0])


BAD_FRAMES = [
    # (id, frames, code, rid echoed)
    ("garbage", [b"\xc1\xff\x00 this is not msgpack"], ErrorCode.MALFORMED, 0),
    ("empty-frame", [b""], ErrorCode.MALFORMED, 0),
    ("truncated", [codec.encode(m.Ping(rid=9))[:-1]], ErrorCode.MALFORMED, 0),
    ("msgpack-scalar", [_pack(42)], ErrorCode.MALFORMED, 0),
    ("msgpack-map", [_pack({"t": "ping", "rid": 1})], ErrorCode.MALFORMED, 0),
    ("empty-array", [_pack([])], ErrorCode.MALFORMED, 0),
    ("multi-frame", [codec.encode(m.Ping(rid=3)), b"extra frame"], ErrorCode.MALFORMED, 0),
    ("req-style-envelope", [b"", codec.encode(m.Ping(rid=4))], ErrorCode.MALFORMED, 0),
    ("unknown-tag", [_pack(["frobnicate", 11])], ErrorCode.UNKNOWN_MESSAGE, 11),
    ("reply-as-request-pong", [codec.encode(m.Pong(rid=12, boot_id="x"))], ErrorCode.UNKNOWN_MESSAGE, 12),
    ("reply-as-request-error", [codec.encode(m.ErrorReply(rid=13, code=1, message="x"))],
     ErrorCode.UNKNOWN_MESSAGE, 13),
    ("reply-as-request-store", [codec.encode(m.StoreReply(rid=14, stored=1, present=0, skipped=0))],
     ErrorCode.UNKNOWN_MESSAGE, 14),
    ("tag-not-string", [_pack([7, 15])], ErrorCode.MALFORMED, 15),
    ("rid-string", [_pack(["ping", "one"])], ErrorCode.MALFORMED, 0),
    ("rid-float", [_pack(["ping", 1.5])], ErrorCode.MALFORMED, 0),
    ("lookup-keys-not-list", [_pack(["look", 16, "keys", 16])], ErrorCode.MALFORMED, 16),
    ("lookup-key-not-bytes", [_pack(["look", 17, [["abcdefghijklmnop"]], 16])], ErrorCode.MALFORMED, 17),
    ("lookup-key-too-short", [_pack(["look", 18, [[b"abc"]], 16])], ErrorCode.MALFORMED, 18),
    ("store-registration-int", [_pack(["store", 19, 123, [KEY], [[0]]])], ErrorCode.MALFORMED, 19),
    ("store-missing-fields", [_pack(["store", 20])], ErrorCode.MALFORMED, 20),
    ("ping-extra-trailing-fields", [_pack(["ping", 21, "x", "y", 1, 2, 3, 4, 5])], None, 21),
    ("hello-version-string", [_pack(["hello", 22, "1"])], ErrorCode.MALFORMED, 22),
    ("register-storage-kind", [_pack(["reg", 23, "m", "tp0of1", 16, [["file", 4096, "x"]], [], []])],
     ErrorCode.MALFORMED, 23),
    ("flush-salt-int", [_pack(["flush", 24, "", 5])], ErrorCode.MALFORMED, 24),
    ("negative-rid", [_pack(["ping", -1])], ErrorCode.MALFORMED, 0),
    ("negative-chunk-size", [_pack(["look", 25, [[KEY]], -16])], ErrorCode.MALFORMED, 25),
    ("zero-chunk-size", [_pack(["look", 26, [[KEY]], 0])], ErrorCode.MALFORMED, 26),
    ("negative-num-tokens", [_pack(["look", 27, [[KEY]], 16, -1])], ErrorCode.MALFORMED, 27),
    ("negative-block-id", [_pack(["store", 28, "r", [KEY], [[-1]]])], ErrorCode.MALFORMED, 28),
    ("negative-skip-tokens", [_pack(["get", 29, "r", [KEY], [[0]], -16])], ErrorCode.MALFORMED, 29),
    ("negative-layer-offset",
     [_pack(["reg", 30, "m", "tp0of1", 16, [["shm", 4096, "x"]],
             [["l0", 0, -8, [1, 1, 16, 4], [64, 64, 4, 1], "int8", "bfloat16", 0, "vllm"]], [[0, 16]]])],
     ErrorCode.MALFORMED, 30),
    ("deeply-nested", [b"\x91" * 200_000 + b"\x01"], ErrorCode.MALFORMED, 0),
    ("deeply-nested-in-lookup", [b"\x93\xa4look\x21" + b"\x91" * 200_000 + b"\x01"], ErrorCode.MALFORMED, 0),
    ("tag-not-utf8", [b"\x92\xa2\xff\xfe\x05"], ErrorCode.MALFORMED, 0),
    ("field-not-utf8", [b"\x94\xa5hello\x22\x01\xa2\xff\xfe"], ErrorCode.MALFORMED, 0),
    ("array-length-past-end", [b"\xdd\xff\xff\xff\xff"], ErrorCode.MALFORMED, 0),
    ("rid-ext-type", [b"\x92\xa4ping\xd6\xff\x00\x00\x00\x01"], ErrorCode.MALFORMED, 0),
    ("version-mismatch", [codec.encode(m.Hello(rid=31, protocol_version=m.PROTOCOL_VERSION + 99))],
     ErrorCode.VERSION_MISMATCH, 31),
    ("store-parent-too-long", [_pack(["store", 32, "r", [KEY], [[0]], b"p" * 65])], ErrorCode.MALFORMED, 32),
]


@pytest.mark.parametrize("frames,code,rid", [c[1:] for c in BAD_FRAMES], ids=[c[0] for c in BAD_FRAMES])
def test_bad_frame_gets_typed_error_reply(raw, module_daemon, frames, code, rid):
    reply = ask(raw, frames)
    if code is None:  # trailing fields a newer client appended are ignored (append-only schema evolution)
        assert isinstance(reply, m.Pong) and reply.rid == rid, reply
        return
    assert isinstance(reply, m.ErrorReply), reply
    assert (ErrorCode(reply.code), reply.rid) == (code, rid), reply
    assert reply.message
    # the same socket keeps working
    assert isinstance(ask(raw, [codec.encode(m.Ping(rid=99))]), m.Pong)
    assert module_daemon.alive


def test_oversized_frame_is_refused(raw, module_daemon):
    frame = codec.encode(m.Ping(rid=5)) + b"\x00" * (MAX_FRAME_BYTES + 1)
    reply = ask(raw, [frame])
    assert isinstance(reply, m.ErrorReply) and reply.code == ErrorCode.MALFORMED, reply
    assert isinstance(ask(raw, [codec.encode(m.Ping(rid=6))]), m.Pong)


def test_many_bad_frames_in_a_burst(raw, module_daemon):
    """No reply is lost or merged when bad and good frames arrive back to back."""
    for i in range(200):
        raw.send(b"\xc1" if i % 2 else codec.encode(m.Ping(rid=i + 1)))
    kinds = []
    for _ in range(200):
        assert raw.poll(10_000)
        kinds.append(type(codec.decode_reply(raw.recv())).__name__)
    assert kinds.count("Pong") == 100 and kinds.count("ErrorReply") == 100


# ------------------------------------------------------------------------ client-level errors


@pytest.fixture
def engine(module_daemon):
    """A registered SmolLM2-135M engine (1 gid, 16 tokens per block, 16-token chunks, 8 blocks)."""
    spec = ke.EngineSpec(module_daemon.endpoint, ke.SMOLLM2, "LBNHC", (16,), (8,), 16, 4000, model_id="bad-input",
                         sealed=False)
    with ke.Engine(spec) as eng:
        yield eng
    assert module_daemon.alive


def expect(code: ErrorCode, fn, *args, **kwargs) -> KVDepotError:
    with pytest.raises(KVDepotError) as ei:
        fn(*args, **kwargs)
    assert ei.value.code is code, ei.value
    return ei.value


def test_store_and_retrieve_argument_errors(engine):
    c, reg = engine.client, engine.reg
    keys = engine.keys(ke.prompt_tokens(4000, 3 * 16))
    bad_block_ids = {
        "out-of-range": [[0, 1, 8]],
        "far-out-of-range": [[0, 1, 2**62]],
        "too-few": [[0, 1]],
        "too-many": [[0, 1, 2, 3]],
        "no-gids": [],
        "two-gids": [[0, 1, 2], [3, 4, 5]],
    }
    for name, ids in bad_block_ids.items():
        e = expect(ErrorCode.INVALID_ARGUMENT, c.store, reg, keys, ids)
        assert "block id" in e.message or "group" in e.message, (name, e)
        expect(ErrorCode.INVALID_ARGUMENT, c.retrieve, reg, keys, ids)
    assert c.lookup(keys, 16) == 0, "a rejected store must not leave chunks behind"
    assert c.store(reg, keys, [[0, 1, 2]]).stored == 3
    for skip in (8, 1, 15, 48, 64):  # not block aligned, or not less than the chunks' tokens
        expect(ErrorCode.INVALID_ARGUMENT, c.retrieve, reg, keys, [[3, 4, 5]], skip_tokens=skip)
    before = [engine.cache.read_tokens(layer, [3, 4], as_bytes=True) for layer in (0, 29)]
    assert c.retrieve(reg, keys, [[3, 4, 5]], skip_tokens=32) == 3
    for i, layer in enumerate((0, 29)):  # blocks 3, 4 skipped; block 5 gets chunk 2 (from block 2)
        assert torch.equal(engine.cache.read_tokens(layer, [3, 4], as_bytes=True), before[i])
        assert torch.equal(engine.cache.read_tokens(layer, [5], as_bytes=True),
                              engine.cache.read_tokens(layer, [2], as_bytes=True))
    expect(ErrorCode.INVALID_ARGUMENT, c.flush, tier="l9")
    # a staging offset needs an engine-side staging buffer, which a CPU registration never has
    fresh = engine.keys(ke.prompt_tokens(4002, 16))
    for op in (m.Store, m.Retrieve):
        e = expect(ErrorCode.INVALID_ARGUMENT, c.call, op(rid=0, registration=reg.id, keys=fresh, block_ids=[[6]],
                                                          staging_offset=0))
        assert "staging" in e.message
    assert c.lookup(fresh, 16) == 0


def test_unknown_registration(engine):
    c = engine.client
    keys = engine.keys(ke.prompt_tokens(4001, 16))
    ghost = dataclasses.replace(engine.reg, id="no-such-registration")
    expect(ErrorCode.UNKNOWN_REGISTRATION, c.store, ghost, keys, [[0]])
    expect(ErrorCode.UNKNOWN_REGISTRATION, c.retrieve, ghost, keys, [[0]])
    expect(ErrorCode.UNKNOWN_REGISTRATION, c.unregister, ghost)


def test_bad_registrations(engine):
    c, cache = engine.client, engine.cache
    st = cache.storage_specs()[0]
    layers = cache.layer_specs()
    n_before = len(c.describe().engines)

    def reg(storages=None, layers_=None, groups=None, chunk_size=16, device="cpu"):
        return c.register("bad-register", "tp0of1", chunk_size,
                          cache.storage_specs() if storages is None else storages,
                          layers if layers_ is None else layers_,
                          cache.group_specs() if groups is None else groups, device=device)

    def storage(**kw):
        return [msgspec.structs.replace(st, **kw)]

    def layer(i: int, **kw):
        out = list(layers)
        out[i] = msgspec.structs.replace(out[i], **kw)
        return out

    cases = [
        # views beyond the registered size of the segment
        (ErrorCode.LAYOUT, dict(storages=storage(size_bytes=st.size_bytes // 2))),
        (ErrorCode.LAYOUT, dict(layers_=layer(0, offset_bytes=st.size_bytes - 64))),
        (ErrorCode.LAYOUT, dict(layers_=layer(-1, shape=[layers[-1].shape[0] + 1, *layers[-1].shape[1:]]))),
        # registered size larger than the segment really is
        (ErrorCode.ENGINE_MEMORY, dict(storages=storage(size_bytes=st.size_bytes * 4))),
        # a missing segment, and names that are paths or empty
        (ErrorCode.ENGINE_MEMORY, dict(storages=storage(name="kvdepot-test-no-such-segment"))),
        (ErrorCode.ENGINE_MEMORY, dict(storages=storage(name="../../etc/passwd"))),
        (ErrorCode.ENGINE_MEMORY, dict(storages=storage(name=f"sub/{st.name}"))),
        (ErrorCode.ENGINE_MEMORY, dict(storages=storage(name=f"/dev/shm/{st.name}"))),
        (ErrorCode.ENGINE_MEMORY, dict(storages=storage(name=".."))),
        (ErrorCode.ENGINE_MEMORY, dict(storages=storage(name=""))),
        # chunk size not a multiple of the block size
        (ErrorCode.LAYOUT, dict(chunk_size=24)),
        (ErrorCode.LAYOUT, dict(chunk_size=8)),
        # layouts the daemon cannot describe
        (ErrorCode.LAYOUT, dict(layers_=[])),
        (ErrorCode.LAYOUT, dict(layers_=layer(0, layout="paged_nonsense"))),
        (ErrorCode.LAYOUT, dict(layers_=layer(0, dtype="complex128"))),
        (ErrorCode.LAYOUT, dict(layers_=layer(0, kv_dtype="float128"))),
        (ErrorCode.LAYOUT, dict(layers_=layer(0, shape=layers[0].shape[:3], strides=layers[0].strides[:3]))),
        (ErrorCode.LAYOUT, dict(layers_=layer(0, strides=[*layers[0].strides[:3], 2]))),
        (ErrorCode.LAYOUT, dict(layers_=layer(0, gid=1))),
        (ErrorCode.LAYOUT, dict(layers_=layer(0, storage=1))),
        (ErrorCode.LAYOUT, dict(groups=[m.KVGroupSpec(gid=0, tokens_per_block=32)], chunk_size=32)),
        (ErrorCode.LAYOUT, dict(groups=[m.KVGroupSpec(gid=1, tokens_per_block=16)])),
        (ErrorCode.LAYOUT, dict(groups=[*cache.group_specs(), *cache.group_specs()])),
        # a cuda_ipc storage in a CPU registration is a contradiction; a CUDA registration to a
        # daemon that sees no GPU is a valid request this daemon cannot serve
        (ErrorCode.INVALID_ARGUMENT, dict(storages=storage(kind="cuda_ipc", handle=b"\0" * 64))),
        (ErrorCode.UNSUPPORTED if not torch.cuda.is_available() else ErrorCode.ENGINE_MEMORY,
         dict(storages=storage(kind="cuda_ipc", handle=b"\0" * 64, device_uuid="GPU-none"), device="cuda")),
    ]
    for code, kw in cases:
        e = expect(code, reg, **kw)
        assert e.message, kw
    assert len(c.describe().engines) == n_before, "a failed registration must not be kept"
    c.unregister(reg())  # the unmodified registration is accepted


def test_wrong_number_of_gids_for_hybrid_registration(module_daemon):
    spec = ke.EngineSpec(module_daemon.endpoint, ke.GPT_OSS_20B, "LBHNC", (16, 32), (8, 4), 32, 4100,
                         model_id="bad-input-hybrid")
    with ke.Engine(spec) as eng:
        c, reg = eng.client, eng.reg
        keys = eng.keys(ke.prompt_tokens(4100, 64))  # 2 chunks: 2 blocks of gid 0 and 1 of gid 1 each
        expect(ErrorCode.INVALID_ARGUMENT, c.store, reg, keys, [[0, 1, 2, 3]])
        expect(ErrorCode.INVALID_ARGUMENT, c.store, reg, keys, [[0, 1, 2, 3], [0, 1], [0, 1]])
        expect(ErrorCode.INVALID_ARGUMENT, c.store, reg, keys, [[0, 1], [0, 1]])  # gid 0 needs 4
        expect(ErrorCode.INVALID_ARGUMENT, c.store, reg, keys, [[0, 1, 2, 3], [0, 1, 2, 3]])  # gid 1 needs 2
        expect(ErrorCode.INVALID_ARGUMENT, c.store, reg, keys, [[0, 1, 2, 3], [0, 4]])  # gid 1 has 4 blocks
        expect(ErrorCode.INVALID_ARGUMENT, c.retrieve, reg, keys, [[0, 1, 2, 3], [0, 1]], skip_tokens=16)
        assert c.store(reg, keys, [[0, 1, 2, 3], [0, 1]]).stored == 2
        assert c.retrieve(reg, keys, [[4, 5, 6, 7], [3, 2]], skip_tokens=32) == 2


def test_engine_that_shrinks_its_segment_gets_engine_memory_error(module_daemon):
    """Touching a mapping beyond the end of its file is SIGBUS: the daemon must check first."""
    spec = ke.EngineSpec(module_daemon.endpoint, ke.SMOLLM2, "LBNHC", (16,), (8,), 16, 4050, model_id="shrink",
                         sealed=False)
    with ke.Engine(spec) as eng:
        keys = eng.keys(ke.prompt_tokens(4050, 32))
        assert eng.client.store(eng.reg, keys[:1], [[0]]).stored == 1
        os.truncate(f"/dev/shm/{eng.cache.name}", eng.cache.size_bytes // 2)
        expect(ErrorCode.ENGINE_MEMORY, eng.client.store, eng.reg, keys[1:], [[1]], parent=keys[0])
        expect(ErrorCode.ENGINE_MEMORY, eng.client.retrieve, eng.reg, keys, [[2, 3]])
        assert eng.client.lookup(keys, 16) == 1
        assert module_daemon.alive


def test_daemon_still_serves_after_bad_input(module_daemon, tmp_path):
    """A new client on the same daemon: store in one layout, retrieve into another, bit-exact."""
    assert module_daemon.alive
    a = ke.EngineSpec(module_daemon.endpoint, ke.QWEN_7B, "LBNHC", (16,), (12,), 32, 4200)
    b = ke.EngineSpec(module_daemon.endpoint, ke.QWEN_7B, "flash_attn_hnd", (16,), (14,), 32, 4201)
    tokens = ke.prompt_tokens(4200, 4 * 32 + 3)
    a_ids, b_ids = ke.rotated_block_ids(a, 4), ke.shuffled_block_ids(b, 4, 1)
    r = ke.store_job(ke.StoreJob(a, tuple(tokens), tuple(map(tuple, a_ids)), first_batch=2))
    assert r["replies"] == [[2, 0, 0], [2, 0, 0]] and r["hit"] == 4
    r = ke.retrieve_job(ke.RetrieveJob(b, a, tuple(map(tuple, a_ids)), tuple(tokens), tuple(map(tuple, b_ids))))
    assert r["retrieved"] == 4 and r["problems"] == [], r
    with KVDepotClient(module_daemon.endpoint) as c:
        info = c.describe()
        assert c.ping() == info.boot_id
    assert module_daemon.alive
    assert "Traceback" not in module_daemon.log()
