"""Settings of the vLLM connector: the keys of ``--kv-transfer-config``'s
``kv_connector_extra_config`` (all optional).

======================  ===========  ==================================================================
key                     default      meaning
======================  ===========  ==================================================================
``endpoint``            see below    daemon address; default ``$KVDEPOT_ENDPOINT``, else
                                     ``ipc://<tmpdir>/kvdepot-<uid>.sock`` (what ``kvdepot serve`` binds)
``chunk_size``          256          tokens per cached chunk; a multiple of the least common multiple of
                                     every KV-cache group's tokens per block
``model_id``            derived      which weights these are, in chunk keys (default: model name or
                                     path and revision; quantization, dtypes and ``--hf-overrides``
                                     are added either way: `connector.model_identity`); set it when
                                     engines load the same weights from different paths
``store``               true         store computed chunks into the daemon
``load``                true         load cached chunks from the daemon
``store_generated``     false        also store whole chunks of generated (decode) tokens, not only of
                                     the prompt
``lookup_timeout_s``    1.0          scheduler: how long a request waits for its lookup answer before
                                     it is scheduled without cached KV
``rpc_timeout_s``       5.0          worker: reply timeout of a register / store / retrieve
``retry_interval_s``    1.0          after a failure: how often the daemon is probed (ping) until it
                                     answers again
``hold_max_s``          30.0         worker: longest time a request's blocks are kept after a store or
                                     retrieve timed out, waiting for the daemon's late answer
``key_source``          auto         where chunk keys come from: ``vllm``: vLLM's own prefix-cache block
                                     hashes (no token hashed again; needs ``prefix_caching_hash_algo``
                                     sha256 or sha256_cbor, vLLM >= 0.33, and a chunk_size that is a
                                     multiple of vLLM's hash block size); ``tokens``: kvdepot hashes
                                     the prompt's tokens itself (the keys of every other kvdepot
                                     client); ``auto``: ``vllm`` where possible, else ``tokens``.
                                     Engines share cached KV only with engines of the same source
``staging_bytes``       0 (auto)     CUDA worker: bytes of the device staging ring (GPU memory beside
                                     vLLM's KV cache); stores and loads move through it in pieces.
                                     0: `auto_staging_bytes` (256 MiB; more for sliding-window models)
``load_staging_bytes``  0 (auto)     CUDA worker: bytes of a second ring, for loads alone, so that a
                                     prefix hit's load never waits for room behind stores still being
                                     copied out. 0: 256 MiB (none where ``load`` is false); -1: loads
                                     share the staging ring (less GPU memory; a load may then wait)
======================  ===========  ==================================================================
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from kvdepot.client.hashing import VLLM_BLOCK_HASH_SOURCE
from kvdepot.client.staging import DEFAULT_STAGING_BYTES
from kvdepot.protocol.transport import default_endpoint

EXTRA_CONFIG = "kv_connector_extra_config"  # where these keys live in --kv-transfer-config
KEY_SOURCES = ("auto", "vllm", "tokens")


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Validated ``kv_connector_extra_config``."""

    endpoint: str
    chunk_size: int = 256
    model_id: str = ""
    store: bool = True
    load: bool = True
    store_generated: bool = False
    lookup_timeout_s: float = 1.0
    rpc_timeout_s: float = 5.0
    retry_interval_s: float = 1.0
    hold_max_s: float = 30.0
    staging_bytes: int = 0  # 0: auto_staging_bytes
    load_staging_bytes: int = 0  # 0: auto (`load_ring_bytes`); -1: loads share the staging ring
    key_source: str = "auto"  # KEY_SOURCES

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``.

        Raises:
            ValueError: an unknown key or a value of the wrong type or range (naming the key).
        """
        extra = dict(extra or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ValueError(f"{EXTRA_CONFIG}: unknown key(s) {unknown}; known keys: {sorted(fields)}")
        values: dict[str, Any] = {"endpoint": extra.pop("endpoint", None) or default_endpoint()}
        for name, raw in extra.items():
            default = fields[name].default
            try:
                if isinstance(default, bool):
                    if not isinstance(raw, bool):
                        raise TypeError
                    value = raw
                elif isinstance(default, int):
                    if isinstance(raw, bool) or int(raw) != raw:
                        raise TypeError
                    value = int(raw)
                elif isinstance(default, float):
                    value = float(raw)
                else:
                    value = str(raw)
            except (TypeError, ValueError):
                raise ValueError(f"{EXTRA_CONFIG}.{name}: {raw!r} is not a {type(default).__name__}") from None
            values[name] = value
        cfg = cls(**values)
        if not cfg.endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"{EXTRA_CONFIG}.endpoint: {cfg.endpoint!r}; use ipc://PATH or tcp://HOST:PORT "
                             "(the address `kvdepot serve --endpoint` binds)")
        if cfg.chunk_size <= 0:
            raise ValueError(f"{EXTRA_CONFIG}.chunk_size: {cfg.chunk_size} must be > 0")
        if cfg.staging_bytes and cfg.staging_bytes < (1 << 20):
            raise ValueError(f"{EXTRA_CONFIG}.staging_bytes: {cfg.staging_bytes} must be 0 (auto) or >= 1 MiB "
                             "(1048576)")
        if cfg.load_staging_bytes not in (0, -1) and cfg.load_staging_bytes < (1 << 20):
            raise ValueError(f"{EXTRA_CONFIG}.load_staging_bytes: {cfg.load_staging_bytes} must be 0 (auto), -1 "
                             "(loads share the staging ring) or >= 1 MiB (1048576)")
        if cfg.key_source not in KEY_SOURCES:
            raise ValueError(f"{EXTRA_CONFIG}.key_source: {cfg.key_source!r}; one of {list(KEY_SOURCES)}")
        for name in ("lookup_timeout_s", "rpc_timeout_s", "retry_interval_s", "hold_max_s"):
            if getattr(cfg, name) <= 0:
                raise ValueError(f"{EXTRA_CONFIG}.{name}: must be > 0")
        return cfg


def check_chunk_size(chunk_size: int, block_sizes: Sequence[int]) -> None:
    """Refuse a chunk size that is not a multiple of every group's tokens per block.

    Raises:
        ValueError: naming ``kv_connector_extra_config.chunk_size`` and the nearest valid values.
    """
    if not block_sizes:
        return
    lcm = math.lcm(*block_sizes)
    if chunk_size % lcm:
        lower = chunk_size // lcm * lcm
        upper = lower + lcm
        options = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"{EXTRA_CONFIG}.chunk_size={chunk_size} is not a multiple of {lcm}, the least common multiple of "
            f"the KV-cache groups' tokens per block {sorted(set(block_sizes))}; set "
            f"\"chunk_size\": {options} in --kv-transfer-config's {EXTRA_CONFIG}")


STAGING_MIN_BYTES = DEFAULT_STAGING_BYTES  # the client's default ring, 256 MiB
STAGING_MAX_BYTES = 4 << 30


def auto_staging_bytes(chunk_bytes: int, chunk_size: int, max_step_tokens: int, sliding_window: bool) -> int:
    """The staging ring's size when ``staging_bytes`` is 0: 256 MiB, or for a model with a
    sliding-window KV-cache group room for two steps' stores, between 256 MiB and 4 GiB.

    Why two steps: with a sliding-window group vLLM hands a running request's blocks that left
    the window to other requests at once, so a step's stores are gathered into the ring in that
    step or skipped (`stores_skipped_ring_full`); they leave it once the daemon copied them, and
    the engine's CPU runs up to a step ahead of its GPU. Full-attention models' stores wait for
    room instead (their blocks stay with the request), so the ring only sets how much of a
    step's KV goes out during the next forward.

    Args:
        chunk_bytes: bytes of one chunk of this worker's KV (every layer, one TP shard).
        chunk_size: tokens per chunk.
        max_step_tokens: vLLM's ``scheduler_config.max_num_batched_tokens``.
        sliding_window: whether any KV-cache group frees blocks of running requests.
    """
    if not sliding_window:
        return STAGING_MIN_BYTES
    step_chunks = -(-max_step_tokens // chunk_size)
    return max(STAGING_MIN_BYTES, min(STAGING_MAX_BYTES, 2 * step_chunks * chunk_bytes))


def load_ring_bytes(cfg: ConnectorConfig) -> int:
    """The bytes of the loads' own staging ring (`kvdepot.client.staging.EngineStaging`'s
    ``load_ring_bytes``; 0: loads share the store ring): ``load_staging_bytes``, or where that
    is 0 (auto) 256 MiB, none for an engine that does not load.

    Why a ring of their own: a ring frees its regions first in, first out, so in a shared one
    a load waits until the stores queued before it were copied out. Measured on an H200
    (`benchmarks/vllm_connector.py --hits 16`, Llama-3.1-8B, a 16-chunk hit while prompts'
    stores fill the link): with one 256 MiB ring its pieces waited 13 ms for room, and its
    load took 30 ms against 11 alone."""
    if cfg.load_staging_bytes == -1 or not cfg.load:
        return 0
    return cfg.load_staging_bytes or STAGING_MIN_BYTES


_REPRODUCIBLE_BLOCK_HASHES = ("sha256", "sha256_cbor")  # collision resistant: vLLM seeds them with a fixed value


def block_hash_chains(cfg: ConnectorConfig, vllm_config, kv_cache_config) -> tuple[int, str]:
    """Whether chunk keys come from vLLM's block hashes (`chain_from_block_hashes`):
    (hash blocks per chunk, the namespace's ``chain_source``), or (0, why not).

    They do where ``key_source`` is ``vllm`` or ``auto`` and vLLM's hashes are the same on every
    process and host and cannot be collided: ``prefix_caching_hash_algo`` sha256 or sha256_cbor
    (vLLM >= 0.33 starts their chain from a fixed seed, ``PYTHONHASHSEED`` where set; older
    vLLM from a random one unless it is set), and chunks end on hash blocks (``chunk_size`` a
    multiple of ``kv_cache_config.hash_block_size``).

    Raises:
        ValueError: ``key_source`` is ``vllm`` and they cannot be used (naming why).
    """
    if cfg.key_source == "tokens":
        return 0, "key_source is tokens"
    algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None)
    hbs = getattr(kv_cache_config, "hash_block_size", None)
    try:
        from vllm.v1.core import kv_cache_utils
    except ImportError:  # pragma: no cover - the connector needs vLLM anyway
        kv_cache_utils = None
    fixed_seed = hasattr(kv_cache_utils, "resolve_none_hash_seed") or os.getenv("PYTHONHASHSEED") is not None
    why = ""
    if algo not in _REPRODUCIBLE_BLOCK_HASHES:
        why = f"prefix_caching_hash_algo {algo!r} is not one of {list(_REPRODUCIBLE_BLOCK_HASHES)}"
    elif not fixed_seed:
        why = "this vLLM starts its block hashes from a random seed per process unless PYTHONHASHSEED is set"
    elif not hbs:
        why = "vLLM gave no hash_block_size"
    elif cfg.chunk_size % hbs:
        why = f"chunk_size {cfg.chunk_size} is not a multiple of vLLM's hash block size {hbs}"
    if why:
        if cfg.key_source == "vllm":
            raise ValueError(f"{EXTRA_CONFIG}.key_source is vllm, but {why}")
        return 0, why
    return cfg.chunk_size // hbs, VLLM_BLOCK_HASH_SOURCE.format(algo=algo)
