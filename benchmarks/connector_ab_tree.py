"""A `connector_ab.py` variant that compares two versions of kvdepot's connector code: B is the
code this process imported (the working tree), A the same modules of another checkout, at
``$KVDEPOT_AB_OLD_TREE`` (e.g. ``git archive <rev> kvdepot | tar x -C /tmp/old``).

Each module of `MODULES` is executed again from the old tree's source, as a module of its own;
every function of a class of both versions whose code differs is swapped on the live class
(`on`: the new one, `off`: the old one), a function only the old class has is put on the
live class for `off` and taken off again for `on` (old code may call it), and the connectors'
bound per-step calls are bound again (`KVDepotConnector._bind_step_calls`). Objects already built stay as they are: a change
that needs state only its own ``__init__`` makes works in its arm (the engine was built with the
new code), an old method that reads state the new code no longer makes fails loudly. An old
method that calls ``super()`` without arguments cannot run on the new class: give its
equivalent in `OLD_SUPER`.

    git archive HEAD kvdepot | (mkdir -p /tmp/old && tar x -C /tmp/old)
    KVDEPOT_AB_OLD_TREE=/tmp/old python benchmarks/connector_ab.py benchmarks/connector_ab_tree.py --runs 32
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

MODULES = ("kvdepot.client.client", "kvdepot.client.vllm.scheduler", "kvdepot.client.vllm.worker",
           "kvdepot.client.vllm.mover", "kvdepot.client.vllm.jobs", "kvdepot.client.vllm.connector",
           "kvdepot.client.vllm.stats")
TREE_ENV = "KVDEPOT_AB_OLD_TREE"


def _old_bind_connector_metadata(self, connector_metadata) -> None:
    """`KVDepotConnector.bind_connector_metadata` as it was before it stopped calling super()."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvdepot.client.vllm.plan import KVDepotMetadata

    KVConnectorBase_V1.bind_connector_metadata(self, connector_metadata)
    if self.worker is not None and isinstance(connector_metadata, KVDepotMetadata):
        self.worker.bind(connector_metadata)


OLD_SUPER = {("KVDepotConnector", "bind_connector_metadata"): _old_bind_connector_metadata}

swaps: list[tuple[type, str, object, object]] = []  # (live class, name, new function or None, old function)


def _code(f) -> tuple | None:
    co = getattr(f, "__code__", None)

    def key(c: types.CodeType) -> tuple:
        return c.co_code, c.co_names, tuple(key(x) if isinstance(x, types.CodeType) else x for x in c.co_consts)
    return key(co) if co is not None else None


def load(tree: str | os.PathLike | None = None, modules=MODULES) -> list[str]:
    """Find what differs between the live modules and the old tree's; returns "Class.name" of each.

    Raises:
        RuntimeError: no old tree given; an old method that differs calls super() and has no
            `OLD_SUPER` entry.
    """
    root = Path(tree or os.environ.get(TREE_ENV, ""))
    if not str(root) or not (root / "kvdepot").is_dir():
        raise RuntimeError(f"set ${TREE_ENV} to a directory holding an old kvdepot/ package")
    swaps.clear()
    for name in modules:
        new = importlib.import_module(name)
        path = root / (name.replace(".", "/") + ".py")
        if not path.exists():
            continue
        old = types.ModuleType("kvdepot_ab_old." + name)
        old.__file__, old.__package__ = str(path), new.__package__
        sys.modules[old.__name__] = old  # (dataclasses look their module up)
        exec(compile(path.read_text(), str(path), "exec"), old.__dict__)
        for cname, live in vars(new).items():
            was = getattr(old, cname, None)
            if not (isinstance(live, type) and isinstance(was, type) and live.__module__ == name):
                continue
            for fname, nf in vars(live).items():
                of = vars(was).get(fname)
                if not callable(nf) or not callable(of) or _code(nf) == _code(of) or _code(nf) is None:
                    continue
                if "__class__" in of.__code__.co_freevars:
                    of = OLD_SUPER.get((cname, fname))
                    if of is None:
                        raise RuntimeError(f"old {cname}.{fname} calls super(): give it in OLD_SUPER")
                swaps.append((live, fname, nf, of))
            for fname, of in vars(was).items():  # only in the old class
                if fname not in vars(live) and callable(of) and _code(of) is not None:
                    if "__class__" in of.__code__.co_freevars:
                        raise RuntimeError(f"old {cname}.{fname} calls super(): give it in OLD_SUPER")
                    swaps.append((live, fname, None, of))
    return sorted(f"{c.__name__}.{n}" for c, n, _, _ in swaps)


def _set(engine, use_new: bool) -> None:
    if not swaps:
        print("connector_ab_tree: swapped", ", ".join(load()), flush=True)
    for cls, name, nf, of in swaps:
        if not use_new:
            setattr(cls, name, of)
        elif nf is not None:
            setattr(cls, name, nf)
        elif name in vars(cls):
            delattr(cls, name)
    for conn in (engine.sched_conn, engine.worker_conn):
        for name in [n for n, v in vars(conn).items() if callable(v) and callable(getattr(type(conn), n, None))]:
            delattr(conn, name)  # the other arm's per-step bindings (its STEP_CALLS may name other calls)
        conn._bind_step_calls()


def on(engine) -> None:
    _set(engine, True)


def off(engine) -> None:
    _set(engine, False)
