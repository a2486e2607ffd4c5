"""Shared fixtures for every test directory (keep them generic).

* ``seed`` / ``torch_rng``: a per-test random seed, printed (shown on failure) and recorded in
  the test's ``user_properties`` (junit XML). Set ``KVDEPOT_TEST_SEED=<int>`` to replay one.
* ``model_kv_shapes``: the real models of ``tests/data/model_kv_shapes.json`` by name (a copy
  of the project's shared ``model_kv_shapes.json``).
* ``model_groups``: `KVGroupShape` lists built from those real shapes.
* ``shm_kv_cache``: a factory of `ShmKVCache` segments that are unlinked at teardown.
* hypothesis: derandomized under ``CI`` (profile ``ci``), random elsewhere.
* the run ends with pytest's summary: once it is printed, the exit handlers run and the
  process exits without the interpreter's teardown, where triton's nanobind bindings (imported
  by torch._dynamo under vLLM) print hundreds of lines of leak warnings.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import pathlib
import random

import pytest
import torch
from hypothesis import settings

# CI (CI=true) replays a fixed set of examples so that a landing never depends on luck; local
# runs draw new ones (that is where fuzzing finds things)
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

from kvdepot.client.kvcache import KVGroupShape, ShmKVCache

DATA_DIR = pathlib.Path(__file__).parent / "data"
SEED_ENV = "KVDEPOT_TEST_SEED"


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """Random seed of this test: ``$KVDEPOT_TEST_SEED`` or a fresh one; printed and recorded."""
    env = os.environ.get(SEED_ENV)
    value = int(env) if env else random.SystemRandom().randrange(2**32)
    print(f"{request.node.nodeid}: {SEED_ENV}={value}")
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture
def torch_rng(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="session")
def model_kv_shapes() -> dict[str, dict]:
    """Real models' KV shapes by name (``"Llama-3.1-8B"`` -> its JSON entry)."""
    with open(DATA_DIR / "model_kv_shapes.json") as f:
        data = json.load(f)
    return {m["name"]: m for m in data["models"]}


@pytest.fixture
def model_groups(model_kv_shapes):
    """Build a model's `KVGroupShape` list from its real shape.

    ``model_groups(name, dtype=torch.bfloat16, tokens_per_block=(16,), num_layers=None)``:
    with one block size all layers form gid 0; with G block sizes the layers are split evenly
    over gids 0..G-1 (hybrid models: e.g. Gemma-2-2B's 13 full + 13 sliding layers).
    MLA entries (``head_dim`` 576, or ``row_bytes`` for byte-packed rows, which force uint8)
    become ``mla=True`` groups (``row_key="indexer_row_bytes"`` picks the indexer's 132 B
    rows). ``num_layers`` overrides the layer count (needed for entries
    that do not list one, e.g. DeepSeek-V4).
    """

    def build(name: str, dtype: torch.dtype = torch.bfloat16, tokens_per_block=(16,),
              num_layers: int | None = None, row_key: str = "row_bytes") -> list[KVGroupShape]:
        m = model_kv_shapes[name]
        layers = num_layers if num_layers is not None else m["layers"]
        if row_key in m:  # byte-packed rows (fp8_ds_mla 656 B, DeepSeek-V4 584 B, indexer 132 B)
            head_dim, heads, dtype, mla = m[row_key], 1, torch.uint8, True
        else:
            head_dim, heads = m["head_dim"], m["kv_heads"]
            mla = m["attention"].startswith("MLA")
        ngroups = len(tokens_per_block)
        assert layers % ngroups == 0, f"{name}: {layers} layers do not split into {ngroups} groups"
        return [
            KVGroupShape(gid=gid, num_layers=layers // ngroups, num_heads=heads, head_dim=head_dim,
                         tokens_per_block=tpb, dtype=dtype, mla=mla)
            for gid, tpb in enumerate(tokens_per_block)
        ]

    return build


@pytest.fixture
def shm_kv_cache():
    """Factory of `ShmKVCache` (same arguments); every segment is unlinked at teardown."""
    made: list[ShmKVCache] = []

    def make(*args, **kwargs) -> ShmKVCache:
        cache = ShmKVCache(*args, **kwargs)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.close()


_exit_status: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After pytest's own teardown (its summary is out): exit handlers, then exit with the
    run's status, skipping the interpreter's teardown (see the module). Not inside a pytest
    run of pytest (``pytester``), whose outer run goes on."""
    if not _exit_status or config.pluginmanager.has_plugin("pytester"):
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status[-1])
