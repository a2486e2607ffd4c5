"""Empty stand-ins for vLLM's compiled extension modules that are absent.

The GPU test machine gets vLLM 0.33's Python files only (its wheel is built for another torch
and is too large to carry there): every ``*.so`` that vLLM's own ``RECORD`` lists and that is not
on disk becomes an empty module, so that ``import vllm...`` of the Python code the connector
tests drive (config, scheduler, KV-cache planning, connector factory, model-runner mixin) works.
Nothing else is replaced, and where the compiled files are installed nothing is stubbed.
Calling into a stub (a compiled kernel) fails with AttributeError: the tests never do.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path


def install() -> list[str]:
    """Register an empty module for each compiled vLLM module whose file is missing; returns
    their names (empty where vLLM is complete or not installed)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return []
    site = Path(next(iter(spec.submodule_search_locations))).parent
    records = sorted(site.glob("vllm-*.dist-info/RECORD"))
    if not records:
        return []
    stubbed = []
    for line in records[-1].read_text().splitlines():
        path = line.split(",", 1)[0]
        if not (path.startswith("vllm/") and path.endswith(".so")) or (site / path).exists():
            continue
        name = path[:-3].split(".", 1)[0].replace("/", ".")  # vllm/x/_C.abi3.so -> vllm.x._C
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name, "stub: compiled vLLM module absent on this machine")
            stubbed.append(name)
    return stubbed


STUBBED = install()
