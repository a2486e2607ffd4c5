"""The floor of `vllm_connector.py`'s per-step figures: what vLLM's calls into a connector cost
a step when every call returns at once (``--floor``).

`FloorConnector` implements each call vLLM 0.33 makes of a connector per step, as cheaply as a
Python connector can: a constant, or the argument kept (``bind_connector_metadata``, vLLM's
own). It moves nothing, so vLLM's scheduler and the engine run the same prefills and decodes
as with kvdepot, minus the transfers. The same `CallTimer` wraps the same calls, so the
figures compare one to one: kvdepot's store step against this floor's prefill step (the step
that prefills one new prompt), kvdepot's decode step against this floor's. The difference is
the work kvdepot does in those calls; the floor itself is the cost of being called: each
call runs with CPU caches that vLLM's own work between the calls left cold.
"""

from __future__ import annotations

import contextlib
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorTransferResults, SupportsHMA)

MODULE = "connector_bench.floor"  # this module's name, as vLLM imports it (benchmarks/ on sys.path)
NAME = "FloorConnector"


class _NoWork(KVConnectorMetadata):
    """The one metadata every step gets: nothing to load or store."""

    stores = ()
    loads = ()


_META = _NoWork()
_NOTHING = frozenset()
_NO_RESULTS = KVConnectorTransferResults(finished_sending=_NOTHING, finished_recving=_NOTHING,
                                         failed_recving=_NOTHING)


class FloorConnector(KVConnectorBase_V1, SupportsHMA):
    """A connector that does nothing, each call in the fewest steps Python allows (see module
    docstring). Hybrid models too (``SupportsHMA``), as kvdepot's connector."""

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return _META

    def update_connector_output(self, connector_output) -> None:
        return None

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def get_kv_connector_stats(self):
        return None

    # ---------------------------------------------------------------- worker side

    def get_mem_pool_context(self):
        # the harness's CPU workers want a context (kvdepot's: shared memory); nothing reads these
        dev = getattr(self._vllm_config.device_config, "device_type", "cuda")
        return contextlib.nullcontext() if dev == "cpu" else None

    def register_kv_caches(self, kv_caches) -> None:
        return None

    def handle_preemptions(self, kv_connector_metadata) -> None:
        return None

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def has_connector_metadata(self) -> bool:
        return False  # no per-layer calls, as kvdepot's connector

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return _NO_RESULTS

    def get_block_ids_with_load_errors(self) -> set[int]:
        return _NOTHING

    def build_connector_worker_meta(self):
        return None


def is_prefill_step(so) -> bool:
    """A step that schedules a new prompt: with one prompt of 16 chunks per step, the step in
    which kvdepot's connector stores 16 chunks (`vllm_connector.drive`'s store steps)."""
    return bool(so.scheduled_new_reqs)
