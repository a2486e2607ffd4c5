"""`KVDepotConnector` that records every call vLLM makes on it (loaded by vLLM through
``kv_connector_module_path="recording_connector"``, like any external connector)."""

from __future__ import annotations

import functools

from kvdepot.client.vllm import KVDepotConnector

CALLS: list[tuple[str, str, object]] = []  # (role, method, summary of arguments / result)

_METHODS = (
    "on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "update_connector_output", "request_finished", "request_finished_all_groups", "bind_kv_cache_manager",
    "get_mem_pool_context", "register_kv_caches", "handle_preemptions", "bind_connector_metadata",
    "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_transfer_results",
    "get_block_ids_with_load_errors", "clear_connector_metadata",
)


def _summary(name: str, args: tuple, result):
    if name == "get_num_new_matched_tokens":
        return (args[0].request_id, args[1], result)
    if name == "update_state_after_alloc":
        return (args[0].request_id, args[2])
    if name == "build_connector_meta":
        return ([j.req_id for j in result.loads], [j.req_id for j in result.stores], list(result.release))
    if name.startswith("request_finished"):
        return (args[0].request_id, result[0])
    if name == "get_transfer_results":
        return (sorted(result.finished_sending), sorted(result.finished_recving), sorted(result.failed_recving))
    if name == "on_new_request":
        return args[0].request_id
    return None


def _wrap(conn, name: str):
    fn = getattr(conn, name)  # bound: the role class's method

    @functools.wraps(fn)
    def method(*args, **kwargs):
        result = fn(*args, **kwargs)
        CALLS.append((conn.role.name, name, _summary(name, args, result)))
        return result

    return method


class RecordingKVDepotConnector(KVDepotConnector):
    """Every call in `_METHODS` recorded: ``RecordingKVDepotConnector(...)`` is the role's
    `KVDepotConnector` (`WorkerConnector` or `SchedulerConnector`) with its calls wrapped on
    the instance."""

    def __new__(cls, vllm_config, role, kv_cache_config):
        conn = KVDepotConnector(vllm_config, role, kv_cache_config)  # (not of this class: no second __init__)
        for name in _METHODS:
            setattr(conn, name, _wrap(conn, name))
        return conn
