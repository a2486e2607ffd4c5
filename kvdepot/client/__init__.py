"""Engine-side library: the daemon client, chunk hashing and shared-memory KV caches."""

from kvdepot.client.client import KVDepotClient
from kvdepot.client.hashing import chunk_keys, namespace_seed, shard_name
from kvdepot.client.many import RetrieveItem, StoreItem
from kvdepot.client.registration import Registration
from kvdepot.protocol.errors import ErrorCode, KVDepotError

__all__ = ["KVDepotClient", "Registration", "StoreItem", "RetrieveItem", "chunk_keys", "namespace_seed", "shard_name",
           "ErrorCode", "KVDepotError"]
