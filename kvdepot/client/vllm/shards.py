"""Which chunk keys each tensor-parallel rank uses, and which ranks store them (`TPShards`).

A rank's KV is keyed by its *shard* (`kvdepot.client.hashing.shard_mask`). Ranks that hold
identical KV share one shard, so a chunk is stored once and every one of them loads it:

* **Replicated** (every stored layer's vLLM spec has ``max_tp_shards == 1``: MLA's latent KV,
  which vLLM's ``MLAAttentionSpec`` keeps whole on every rank): one shard, ``"replicated"``, at
  every TP size, TP1 included, so engines of one MLA model at different TP sizes share chunks.
  One key chain per request; rank 0 stores, every rank loads.
* **Partly replicated** (``max_tp_shards = S`` with ``1 < S < tp``: each KV head shard held by
  ``tp / S`` consecutive ranks, vLLM's ``kv_cache_groups_tp_replicas``): ``S`` shards named as a
  TP=S engine's (``"tp{r // (tp/S)}of{S}"``), the first rank of each replica set storing.
* **Sharded** (everything else, ``max_tp_shards`` unset): ``"tp{r}of{tp}"``, each rank storing
  its own.

Models whose stored groups mix replicated and sharded layers (an MLA group beside a dense or
sliding-window group) take the greatest common replica count of their layers (vLLM's rule):
with one sharded layer every rank keys and stores its own chunks, the MLA layers' bytes then
stored once per rank. A chunk object holds every stored group's layers, so no finer split is
possible without splitting the object.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from kvdepot.client.hashing import shard_name

REPLICATED = "replicated"  # the shard of KV identical on every rank (`kvdepot.protocol.messages.Register.shard`)


@dataclasses.dataclass(frozen=True, slots=True)
class TPShards:
    """The shards of one engine's tensor-parallel ranks.

    names: the distinct shards, in rank order (what a lookup asks for: one key chain each).
    replicas: consecutive ranks holding each shard (``tp_size == len(names) * replicas``).
    """

    names: tuple[str, ...]
    replicas: int

    def of(self, tp_rank: int) -> str:
        """The shard of rank ``tp_rank``."""
        return self.names[tp_rank // self.replicas]

    def stores(self, tp_rank: int) -> bool:
        """Whether rank ``tp_rank`` stores its shard's chunks (the first rank of its replicas)."""
        return tp_rank % self.replicas == 0


def tp_shards(layer_specs: Sequence, tp_size: int) -> TPShards:
    """The shards of ``tp_size`` ranks holding KV of ``layer_specs`` (vLLM ``KVCacheSpec`` per
    stored layer; ``max_tp_shards`` read where the spec has it)."""
    limits = [getattr(s, "max_tp_shards", None) for s in layer_specs]
    if limits and all(lim == 1 for lim in limits):
        return TPShards((REPLICATED,), tp_size)
    replicas = tp_size if limits else 1
    for lim in limits:
        replicas = math.gcd(replicas, 1 if lim is None else max(1, tp_size // lim))
    return TPShards(tuple(shard_name(r, tp_size // replicas) for r in range(tp_size // replicas)), replicas)


def stored_layer_specs(kv_cache_config, groups) -> list:
    """The vLLM spec of every layer of ``groups`` (`kvdepot.client.vllm.layout.TransferGroup`)."""
    from vllm.v1.kv_cache_interface import iter_layer_specs

    return [s for g in groups for s in iter_layer_specs(kv_cache_config.kv_cache_groups[g.vllm_gid].kv_cache_spec)]
