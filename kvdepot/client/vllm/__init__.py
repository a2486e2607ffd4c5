"""kvdepot's vLLM KV connector (vLLM >= 0.33).

``--kv-transfer-config '{"kv_connector": "KVDepotConnector", "kv_connector_module_path":
"kvdepot.client.vllm", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
"kv_connector_extra_config": {"endpoint": "ipc:///run/kvdepot.sock"}}'`` (keys:
`kvdepot.client.vllm.config`). Importing this package imports vLLM.
"""

from kvdepot.client.vllm.connector import KVDepotConnector
from kvdepot.client.vllm.layout import register_shm_segment, unregister_shm_segment

__all__ = ["KVDepotConnector", "register_shm_segment", "unregister_shm_segment"]
