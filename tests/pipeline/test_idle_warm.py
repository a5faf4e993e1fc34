"""A node's warm process imports at idle priority (SCHED_IDLE: its seconds of imports take no CPU a
running stage wants) and is back at normal priority, every thread of it, before it forks stages."""
import multiprocessing as mp
import os
import signal
import threading

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


def _warm(parent: int) -> list[int]:
    kids = [int(k) for t in os.listdir(f"/proc/{parent}/task")
            for k in open(f"/proc/{parent}/task/{t}/children").read().split()]
    return [k for k in kids if open(f"/proc/{k}/comm").read().strip() == "stagewise-warm"]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="leaving SCHED_IDLE needs CAP_SYS_NICE")
def test_the_warm_process_and_a_rebuilt_stage_run_at_normal_priority(llama_dir):
    with LLM(model=str(llama_dir), pp_size=2, max_pipeline_restarts=1) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY,
                                                             use_tqdm=False)]
        warm = _warm(os.getpid())
        assert len(warm) == 1 and _policies(warm[0]) == {os.SCHED_OTHER}
        os.kill(llm.engine.executor.procs[1].pid, signal.SIGKILL)
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY,
                                                            use_tqdm=False)]
        assert got == want and llm.stats()["recovery"]["rebuilds"] == {"stage_died": 1}
        assert all(_policies(p.pid) == {os.SCHED_OTHER} for p in llm.engine.executor.procs)
