"""The text report of `vllm_connector.py` (the vLLM connector benchmark): one shape's result, as
printed after each shape's run (the JSON holds every field)."""

from __future__ import annotations

from connector_bench.model import CHUNKS_PER_STEP


def _forwards_waiting(r: dict) -> str:
    """Sliding-window models: forwards that waited for an earlier store's gathers, and saves
    gathered by the engine thread before a forward (`WorkerConnector.bind_connector_metadata`)."""
    st = r.get("store_stats", {})
    n, here = st.get("forwards_waiting_for_gathers", 0), st.get("saves_gathered_by_bind", 0)
    return (f"; {n} forwards waited for a store's gathers" if n else "") + (
        f"; {here} saves gathered by bind (the engine thread)" if here else "")


def _gc(r: dict, op: str) -> str:
    g = r.get(f"{op}_gc_in_steps")
    if not g or not g["collections"]:
        return ""
    return (f"; garbage collections in {g['steps_with_one']} of the measured steps, {g['us_total']:.0f} us"
            f" (longest {g['us_max']:.0f}), {g['in_connector_calls_us_total']:.0f} of them inside the connector's calls"
            f" and not counted above (p99 with them {g['step_us_p99_with_them']:.0f})")


def _admission(r: dict, op: str) -> str:
    """The bound counting vLLM's own scheduler in the steps without a forward too, where there was any."""
    extra = r.get(f"{op}_no_forward_sched_s", 0.0)
    if extra < 1e-4 or f"{op}_vs_bound_with_admission" not in r:
        return ""
    return (f", {100 * r[f'{op}_vs_bound_with_admission']:.1f}% counting vLLM's own scheduler in the steps"
            f" without a forward ({1e3 * extra:.1f} ms) as the engine's")


def report(r: dict) -> str:
    calls = lambda op: ", ".join(f"{k} {v:.0f}" for k, v in sorted(r[f"{op}_per_call_us_median"].items(),  # noqa: E731
                                                                   key=lambda kv: -kv[1]) if v >= 1)
    loads = r.get("load_staging_bytes", 0)
    return (f"{r['shape']:<24} chunk {r['chunk_tokens']:>3}, ring {r['staging_bytes'] >> 20} MiB"
            f"{f' + {loads >> 20} MiB for loads' if loads else ' (loads too)'}, "
            f"{r['requests']} prompts of {r['prompt_chunks']} chunks:\n"
            f"  store: {r['store_gbps']:.1f} GB/s = {100 * r['store_vs_roofline']:.1f}% of {r['roofline_d2h_gbps']:.1f}"
            f" (direct {r['direct_store_gbps']:.1f} = {100 * r['direct_store_vs_roofline']:.1f}%); wall"
            f" {1e3 * r['store_wall_s']:.0f} ms = {100 * r['store_vs_bound']:.1f}% of max(link {1e3 * r['store_link_s']:.0f},"
            f" engine's own steps {1e3 * r['store_engine_s']:.0f} ms){_admission(r, 'store')}; per step"
            f" +{r['store_step_us_median']:.0f} us median, {r['store_step_us_p99']:.0f} p99 (waiting"
            f" {_us(r['store_step_wait_us_median'])} of it; scheduler"
            f" {r['store_sched_us_median']:.0f}, worker {r['store_worker_us_median']:.0f}; {calls('store')};"
            f" vLLM's own scheduler {r['store_vllm_sched_us_median']:.0f} beside it);"
            f" +{r['store_step_with_new_requests_us_median']:.0f} us with the step's"
            f" {CHUNKS_PER_STEP // r['prompt_chunks']} new prompt(s)' on_new_request"
            f" ({r['store_on_new_request_us_per_request']:.0f} us each: keys, lookup sent);"
            f" transfer thread {r['store_thread_cpu_us_per_step']:.0f} us CPU per forward step{_gc(r, 'store')}"
            f"{_forwards_waiting(r)}\n"
            f"  load:  {r['load_gbps']:.1f} GB/s = {100 * r['load_vs_roofline']:.1f}% of {r['roofline_h2d_gbps']:.1f}"
            f" (direct {r['direct_retrieve_gbps']:.1f} = {100 * r['direct_retrieve_vs_roofline']:.1f}%); wall"
            f" {1e3 * r['load_wall_s']:.0f} ms = {100 * r['load_vs_bound']:.1f}% of max(link {1e3 * r['load_link_s']:.0f},"
            f" engine's own steps {1e3 * r['load_engine_s']:.0f} ms){_admission(r, 'load')}; per step"
            f" +{r['load_step_us_median']:.0f} us median over {r['load_steps_measured']} steps (waiting"
            f" {_us(r['load_step_wait_us_median'])} of it; scheduler"
            f" {r['load_sched_us_median']:.0f}, worker {r['load_worker_us_median']:.0f}; {calls('load')};"
            f" vLLM's own scheduler {r['load_vllm_sched_us_median']:.0f} beside it);"
            f" transfer thread {r['load_thread_cpu_us_per_step']:.0f} us CPU per forward step{_gc(r, 'load')}\n"
            f"  decode step (8 requests, nothing moved): +{r['decode_step_us_median']:.0f} us median,"
            f" {r['decode_step_us_p99']:.0f} p99, waiting {_us(r['decode_step_wait_us_median'])} (the timer's own {r['timer_overhead_us_per_call']:.2f} us per call"
            f" inside its window taken off every figure, {r['timer_in_layer_extra_us_per_call']:.2f} more per"
            f" per-layer call; its whole cost {r['timer_wrapper_us_per_call']:.2f} us per call)\n"
            f"  on_new_request (keys of {r['prompt_chunks'] * r['chunk_tokens']} tokens, lookup sent) "
            f"{r['load_on_new_request_us_per_request']:.0f} us per request;"
            f" chunks stored {r['stored_chunks']}, loaded {r['loaded_chunks']}, direct {r['direct_store_chunks']}/"
            f"{r['direct_retrieve_chunks']}" + "".join(_stages_line(r, op) + _timeline_line(r, op)
                                                        for op in ("store", "load")) + _floor_line(r))


def _floor_line(r: dict) -> str:
    """``--floor``: the same steps with a connector that does nothing (`connector_bench.floor`)."""
    if "floor_step_us_median" not in r:
        return ""
    calls = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["floor_per_call_us_median"].items(), key=lambda kv: -kv[1])
                      if v >= 0.5)
    return (f"\n  floor (a connector that does nothing, same steps): prefill step +{r['floor_step_us_median']:.0f} us"
            f" median, {r['floor_step_us_p99']:.0f} p99 over {r['floor_steps_measured']} steps (scheduler"
            f" {r['floor_sched_us_median']:.0f}, worker {r['floor_worker_us_median']:.0f}; {calls}); decode step"
            f" +{r['floor_decode_step_us_median']:.0f} us median, {r['floor_decode_step_us_p99']:.0f} p99;"
            f" kvdepot's store step {r['store_step_us_median'] - r['floor_step_us_median']:+.0f} us above it,"
            f" decode step {r['decode_step_us_median'] - r['floor_decode_step_us_median']:+.0f}")


def _us(v) -> str:
    """A figure in whole microseconds, or "n/a" (not measured: ``--no-cpu-clock``)."""
    return "n/a" if v is None else f"{v:.0f}"


def _timeline_line(r: dict, op: str) -> str:
    t = r.get(f"{op}_timeline")
    if not t:
        return ""
    return (f"\n  {op} timeline: lead-in {t['lead_in_ms']:.1f} ms (earlier steps {t['lead_in_steps_before_ms']:.1f},"
            f" the step until its post {t['lead_in_step_to_post_ms']:.1f}, post to send {t['lead_in_post_to_send_ms']:.1f}), >= 1 at the daemon {t['busy_ms']:.1f} ms"
            f" ({t['busy_gbps']:.1f} GB/s), none at the daemon {t['client_idle_ms']:.1f} ms, tail {t['tail_ms']:.1f} ms"
            f" (until the last finished request reached the engine {t.get('tail_to_reported_ms', float('nan')):.1f},"
            f" vLLM's steps after it {t.get('tail_after_reported_ms', float('nan')):.1f});"
            f" {t['requests']} requests, {t['depth_at_send_median']:.0f} at the daemon at a send (median);"
            f" forward steps {t['forward_steps_ms']:.1f} ms, {t['idle_steps']} steps without a forward;"
            f" a posted command taken by the transfer thread after {t['post_to_take_us_median'] or 0:.0f} us median,"
            f" {t['post_to_take_us_p99'] or 0:.0f} p99, {t['post_to_take_us_max'] or 0:.0f} max")


def _stages_line(r: dict, op: str) -> str:
    st = r.get(f"{op}_stages")
    if not st:
        return ""
    parts = sorted(st.items(), key=lambda kv: -kv[1]["calls"] * kv[1]["us_per_call"])
    return f"\n  {op} stages (calls x us): " + ", ".join(f"{k} {v['calls']}x{v['us_per_call']:.1f}" for k, v in parts)
