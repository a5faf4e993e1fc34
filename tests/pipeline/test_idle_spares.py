"""Spare stage processes warm up at idle priority (SCHED_IDLE: their seconds of imports take no CPU
a running stage wants) and run at normal priority once given a stage, every thread of them."""
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from stagewise import LLM, SamplingParams
from stagewise.executor.idle_priority import back_to_normal, warm_at_idle_priority

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _policies(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def _child(out) -> None:
    idle = warm_at_idle_priority()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)       # started while idle: it inherits the policy
    thread.start()
    during = _policies(os.getpid())
    back_to_normal()
    out.send((idle, during, _policies(os.getpid())))
    stop.set()
    thread.join()


def test_idle_while_warming_then_normal_in_every_thread():
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(there,))
    p.start()
    idle, during, after = here.recv()
    p.join(30)
    may = os.geteuid() == 0        # root may leave SCHED_IDLE (CAP_SYS_NICE); elsewhere it never enters it
    assert idle == may
    assert during == ({os.SCHED_IDLE} if may else {os.SCHED_OTHER})
    assert after == {os.SCHED_OTHER}


def _spares(parent: int) -> list[int]:
    kids = [int(k) for t in os.listdir(f"/proc/{parent}/task")
            for k in open(f"/proc/{parent}/task/{t}/children").read().split()]
    return [k for k in kids if open(f"/proc/{k}/comm").read().strip() == "stagewise-spare"]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="leaving SCHED_IDLE needs CAP_SYS_NICE")
def test_spares_wait_idle_and_a_rebuilt_stage_runs_at_normal_priority(llama_dir):
    with LLM(model=str(llama_dir), pp_size=2, pipeline_spares_delay_s=0, max_pipeline_restarts=1) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY,
                                                             use_tqdm=False)]
        deadline = time.monotonic() + 60
        while llm.stats()["recovery"]["spares_ready"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        spares = _spares(os.getpid())
        assert len(spares) == 2 and all(_policies(pid) == {os.SCHED_IDLE} for pid in spares)
        os.kill(llm.engine.executor.procs[1].pid, signal.SIGKILL)
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY,
                                                            use_tqdm=False)]
        assert got == want and llm.stats()["recovery"]["rebuilds"] == {"stage_died": 1}
        stages = [p.pid for p in llm.engine.executor.procs]
        assert set(stages) <= set(spares)          # the rebuilt pipeline runs on the spares
        assert all(_policies(pid) == {os.SCHED_OTHER} for pid in stages)
