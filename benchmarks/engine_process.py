"""One offline engine (`stagewise.LLM`) in a process of its own, driven over a pipe.

A process holds one torch.distributed group, so two pipeline engines cannot share one; separate
processes also let a benchmark keep several engines up and interleave their rounds, so load drift
on a shared machine hits each alike. `env` sets environment variables in the engine's process
before it starts (benchmark levers such as `STAGEWISE_BALANCE_MICRO_BATCHES=0`).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback

from .common import random_workload, timed

WARMUP_VOCAB = 8192          # warm-up prompts draw ids below this (every benchmark model has more)


def run(llm, prompts, out_lens) -> tuple[float, list[float], list[list[int]]]:
    """Generate the batch greedily: wall seconds, the busy seconds each stage spent on it, the tokens."""
    from stagewise import SamplingParams
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in out_lens]
    before = llm.stats()["stage_busy_s"]
    wall, outs = timed(llm.generate, prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    after = llm.stats()["stage_busy_s"]
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(out_lens)
    before = before or [0.0] * len(after)
    return wall, [a - b for a, b in zip(after, before)], [o.outputs[0].token_ids for o in outs]


class EngineProcess:
    """`LLM(model=model_dir, **opts)` in a spawned process (None: the default model); `run` as above,
    in that process."""

    def __init__(self, model_dir, opts: dict, env: dict | None = None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        model = None if model_dir is None else str(model_dir)
        self.proc = ctx.Process(target=_serve_engine, args=(child, model, opts, env or {}), daemon=False)
        self.proc.start()

    def _answer(self):
        reply = self.conn.recv()
        if isinstance(reply, str):
            raise RuntimeError(reply)
        return reply

    def ready(self) -> None:
        self._answer()

    def run(self, prompts, out_lens) -> tuple[float, list[float], list[list[int]]]:
        self.conn.send((prompts, out_lens))
        return self._answer()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()


def _serve_engine(conn, model_dir: str | None, opts: dict, env: dict) -> None:
    os.environ.update(env)
    from stagewise import LLM
    try:
        # no prefix caching: every round replays the same prompts
        defaults = dict(dtype="float32", device="cpu", max_num_seqs=64, kv_cache_memory="256MiB",
                        enable_prefix_caching=False, compile_in_background=False)
        llm = LLM(model=model_dir, **{**defaults, **opts})
    except Exception:   # noqa: BLE001  (any start-up failure goes back to the parent as its traceback)
        conn.send(traceback.format_exc())
        return
    try:
        run(llm, *random_workload(4, (8, 16), (2, 4), WARMUP_VOCAB, seed=99))
        conn.send(b"ready")
        while (job := conn.recv()) is not None:
            try:
                conn.send(run(llm, *job))
            except Exception:   # noqa: BLE001  (as at start-up: the parent raises it)
                conn.send(traceback.format_exc())
    finally:
        llm.shutdown()
