"""`connector_ab.py` variant: vLLM's per-step calls bound straight to the scheduler and worker
sides' methods on the two connector instances (one Python call less each), as the connector did
before the composition refactor (its ``_bind_step_calls``, 2cb71df); ``build_connector_worker_meta``
of a model without a sliding-window group returns None without a call into the worker, and
``get_kv_connector_stats`` is the `StatsTaker`'s ``take``. ``request_finished`` is left alone
(its signature differs from the side's; called once per request, not per step)."""
SCHED = {"get_num_new_matched_tokens": "get_num_new_matched_tokens", "update_state_after_alloc": "update_state_after_alloc",
         "build_connector_meta": "build_connector_meta", "update_connector_output": "update_connector_output",
         "on_new_request": "on_new_request"}
WORK = {"handle_preemptions": "handle_preemptions", "bind_connector_metadata": "bind", "start_load_kv": "start_load_kv",
        "wait_for_save": "wait_for_save", "get_transfer_results": "get_transfer_results",
        "get_block_ids_with_load_errors": "get_block_ids_with_load_errors", "build_connector_worker_meta": "worker_meta"}
NAMES = set(SCHED) | set(WORK) | {"get_kv_connector_stats"}


def _none():
    return None


def on(engine) -> None:
    """Bind the sides' methods on the instances (after `off`)."""
    off(engine)
    sc, wc = engine.sched_conn, engine.worker_conn
    for name, target in SCHED.items():
        setattr(sc, name, getattr(sc.scheduler, target))
    for name, target in WORK.items():
        setattr(wc, name, getattr(wc.worker, target))
    if not any(g.has_null_blocks for g in wc.worker.groups):
        wc.build_connector_worker_meta = _none
    sc.get_kv_connector_stats = sc._stats.take
    wc.get_kv_connector_stats = wc._stats.take


def off(engine) -> None:
    """Back to the connector class's own methods (a timer's wrappers on the instance go too)."""
    for c in (engine.sched_conn, engine.worker_conn):
        for name in NAMES:
            c.__dict__.pop(name, None)
