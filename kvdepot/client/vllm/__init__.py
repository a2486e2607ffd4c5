"""kvdepot's vLLM KV connector (vLLM >= 0.33).

``--kv-transfer-config '{"kv_connector": "KVDepotConnector", "kv_connector_module_path":
"kvdepot.client.vllm", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
"kv_connector_extra_config": {"endpoint": "ipc:///run/kvdepot.sock"}}'`` (keys:
`kvdepot.client.vllm.config`). Importing this package imports vLLM. vLLM's
``KVDepotConnector(vllm_config, role, kv_cache_config)`` gives the role's class:
`WorkerConnector` or `SchedulerConnector`.
"""

from kvdepot.client.vllm.connector import KVDepotConnector
from kvdepot.client.vllm.layout import register_shm_segment, unregister_shm_segment
from kvdepot.client.vllm.scheduler import SchedulerConnector
from kvdepot.client.vllm.worker import WorkerConnector

__all__ = ["KVDepotConnector", "SchedulerConnector", "WorkerConnector", "register_shm_segment",
           "unregister_shm_segment"]
