"""A tensor-parallel rank of a harness engine (`vllm_harness.Engine(..., rank_processes=True)`)
in a process of its own, as vLLM's multiprocess executor runs each worker."""

from __future__ import annotations

import multiprocessing
import traceback


def _rank_process_main(pipe, vllm_config, kv_cache_config, groups, rank: int) -> None:
    """A tensor-parallel rank in its own process, as vLLM's multiprocess executor runs each
    worker: it gets every step's SchedulerOutput pickled (with the connector's metadata) and
    answers with its pickled ModelRunnerOutput. Requests' tokens come with each step (a real
    worker samples them itself)."""
    try:
        from vllm_harness import RankWorker, _ReqRun

        runs: dict = {}
        worker = RankWorker(vllm_config, kv_cache_config, groups, rank, runs)
        pipe.send(("ok", worker.conn.registration_id))
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        return
    while True:
        msg = pipe.recv()
        try:
            if msg[0] == "step":
                _, so, tokens = msg
                for r, toks in tokens.items():
                    if r in runs:
                        runs[r].tokens = toks
                    else:
                        runs[r] = _ReqRun(toks, 0, [[] for _ in groups])
                out = worker.execute(so, update_states=True)
                for r in so.finished_req_ids:
                    runs.pop(r, None)
                pipe.send(("ok", out))
            elif msg[0] == "stats":
                pipe.send(("ok", dict(worker.conn.stats)))
            elif msg[0] == "disable":
                worker.conn.registrar.disable(msg[1])
                pipe.send(("ok", None))
            elif msg[0] == "close":
                worker.conn.shutdown()
                pipe.send(("ok", None))
                return
        except BaseException:
            pipe.send(("error", traceback.format_exc()))


class RankProcess:
    """The parent's handle of a `_rank_process_main` process (spawned: CUDA needs it)."""

    def __init__(self, vllm_config, kv_cache_config, groups, rank: int, timeout_s: float = 120.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.rank = rank
        self.timeout_s = timeout_s
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_rank_process_main, args=(child, vllm_config, kv_cache_config, groups, rank),
                                daemon=True)
        self.proc.start()
        child.close()
        self.registration_id = self.reply()

    def reply(self):
        if not self.pipe.poll(self.timeout_s):
            raise AssertionError(f"rank {self.rank} process silent for {self.timeout_s} s")
        kind, value = self.pipe.recv()
        if kind == "error":
            raise AssertionError(f"rank {self.rank} process failed:\n{value}")
        return value

    def call(self, *msg):
        self.pipe.send(msg)
        return self.reply()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("close")
            finally:
                self.proc.join(30)
        self.pipe.close()
