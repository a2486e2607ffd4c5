"""Write the golden encodings of one protocol version: ``protocol_v{N}.json``.

``python tests/golden/make_golden.py`` encodes one instance of every wire message of the
current ``PROTOCOL_VERSION`` (`messages_v1` below) and writes them as hex strings keyed by
message class name. Run it once per released protocol version and commit the file; never
regenerate an existing version's file (the script refuses to overwrite one without
``--force``): ``tests/unit/test_protocol.py`` checks that every frame of every released
version still decodes to the message listed here, so later versions stay able to read
frames of older clients and daemons.

When a later version appends fields (with defaults), keep `messages_v1` unchanged: the
decoder fills the new fields from their defaults, and the v1 instances built here get the
same defaults, so the comparison still holds. Add a ``messages_v2`` for the next version.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from kvdepot.protocol import codec
from kvdepot.protocol.messages import (
    PROTOCOL_VERSION, DaemonInfo, Describe, DescribeReply, EndRequest, EngineInfo, ErrorReply,
    Flush, FlushReply, Hello, HelloReply, KVGroupSpec, LayerGroupInfo, LayerSpec, Lookup,
    LookupReply, OkReply, Ping, Pong, Register, RegisterReply, Retrieve, RetrieveReply,
    StorageSpec, Store, StoreReply, TierInfo, Unregister,
)

HERE = pathlib.Path(__file__).parent

# Two 16-byte chunk keys (as kvdepot.client.hashing makes them) and the chain's parent.
_K0 = bytes(range(16))
_K1 = bytes(range(16, 32))
_PARENT = bytes(range(100, 116))


def messages_v1() -> dict:
    """One instance of every protocol-v1 message, keyed by class name."""
    layer_group = LayerGroupInfo(
        gid=0, layout="vllm", dtype="int8", kv_dtype="bfloat16", num_layers=32, num_blocks=1024,
        tokens_per_block=16, num_heads=8, num_kv=2, row_bytes=256, bytes_per_token=131072)
    engine = EngineInfo(
        registration="r-1", model="meta-llama/Llama-3.1-8B", shard="tp0of1", pid=4242, device="cpu",
        chunk_size=256, object_bytes=33554432, layout_fingerprint="0123456789abcdef0123456789abcdef",
        groups=[layer_group], stored_chunks=7, retrieved_chunks=3)
    info = DaemonInfo(
        boot_id="boot-1", version="0.1.0", protocol_version=1, endpoints=["ipc:///tmp/kvdepot.sock"],
        metrics_port=9400, uptime_s=12.5, tiers=[TierInfo("l1", 1 << 30, 1 << 25, 1)], engines=[engine],
        lookup_requested_tokens=1024, lookup_hit_tokens=512, stored_chunks=7, retrieved_chunks=3,
        evicted_chunks=1, transfer_engine="cpu-torch", pinned_requests=0)
    return {
        # requests
        "Hello": Hello(rid=1, protocol_version=1, client="vllm-worker", pid=4242),
        "Register": Register(
            rid=2, model="meta-llama/Llama-3.1-8B", shard="tp0of1", chunk_size=256,
            storages=[StorageSpec(kind="shm", size_bytes=1 << 20, name="kvdepot-4242-0"),
                      StorageSpec(kind="cuda_ipc", size_bytes=1 << 21, handle=b"\x01" * 64, device_uuid="GPU-0")],
            layers=[LayerSpec(name="model.layers.0.self_attn", storage=0, offset_bytes=4096,
                              shape=[64, 8, 16, 512], strides=[65536, 512, 4096, 1], dtype="int8",
                              kv_dtype="bfloat16", gid=0, layout="vllm")],
            groups=[KVGroupSpec(gid=0, tokens_per_block=16)], pid=4242, device="cpu"),
        "Unregister": Unregister(rid=3, registration="r-1"),
        "Lookup": Lookup(rid=4, keys=[[_K0, _K1]], chunk_size=256, num_tokens=600,
                         model="meta-llama/Llama-3.1-8B", pin_request="req-1"),
        "Store": Store(rid=5, registration="r-1", keys=[_K1], block_ids=[[16, 17, 18, 19]], parent=_PARENT,
                       cache_salt="tenant-a", request="req-1", event=b"\x02" * 64),
        "Retrieve": Retrieve(rid=6, registration="r-1", keys=[_K0, _K1], block_ids=[[3, 4, 9, 1]],
                             skip_tokens=16, request="req-1"),
        "EndRequest": EndRequest(rid=7, request="req-1"),
        "Describe": Describe(rid=8),
        "Flush": Flush(rid=9, model="meta-llama/Llama-3.1-8B", cache_salt="", tier="l1"),
        "Ping": Ping(rid=10),
        # replies
        "HelloReply": HelloReply(rid=1, protocol_version=1, boot_id="boot-1", version="0.1.0"),
        "RegisterReply": RegisterReply(rid=2, registration="r-1", layout_fingerprint="0123456789abcdef",
                                       object_bytes=33554432, boot_id="boot-1"),
        "OkReply": OkReply(rid=7),
        "LookupReply": LookupReply(rid=4, hit_chunks=2),
        "StoreReply": StoreReply(rid=5, stored=1, present=0, skipped=0),
        "RetrieveReply": RetrieveReply(rid=6, retrieved=2, event=b"\x03" * 64),
        "DescribeReply": DescribeReply(rid=8, info=info),
        "FlushReply": FlushReply(rid=9, objects=3, bytes=3 << 25),
        "Pong": Pong(rid=10, boot_id="boot-1"),
        "ErrorReply": ErrorReply(rid=11, code=6, message="chunk_size 48 is not a multiple of 32"),
    }


MESSAGES = {1: messages_v1}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="overwrite an existing golden file (never for a released version)")
    args = ap.parse_args(argv)
    path = HERE / f"protocol_v{PROTOCOL_VERSION}.json"
    if path.exists() and not args.force:
        print(f"{path} exists; golden files of released versions are frozen (--force to overwrite)", file=sys.stderr)
        return 1
    frames = {name: codec.encode(msg).hex() for name, msg in MESSAGES[PROTOCOL_VERSION]().items()}
    path.write_text(json.dumps(frames, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(frames)} frames to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
