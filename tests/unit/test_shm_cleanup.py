"""A CPU engine's named KV-cache segment (``sealed=False``) never outlives its `ShmKVCache` in /dev/shm."""

import gc
import os

import torch

from kvdepot.client.kvcache import KVGroupShape, ShmKVCache
from kvdepot.gpu.shm import shm_path

GROUP = KVGroupShape(0, 2, 1, 64, 16, torch.float16)


def test_segment_unlinked_on_close_and_when_forgotten():
    with ShmKVCache([GROUP], 4, sealed=False) as cache:
        path = shm_path(cache.name)
        assert os.path.exists(path)
    assert not os.path.exists(path)
    cache.close()  # twice is fine

    forgotten = ShmKVCache([GROUP], 4, sealed=False)
    path = shm_path(forgotten.name)
    assert os.path.exists(path)
    del forgotten
    gc.collect()
    assert not os.path.exists(path), "a ShmKVCache dropped without close() left its segment in /dev/shm"
