"""The warm process stages fork from (executor/zygote.py), on one machine: a PP=2 pipeline's stages
are its children and got ready without imports; killing it takes its stages down (as their driver
would) and the pipeline heals with a new one, tokens unchanged; a variable that libraries read as
they load, changed after it started, retires it; nothing outlives the LLM. The fork-safety check
counts threads that outlive a fork (a Python thread) and not those that stop at one (OpenBLAS's)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stagewise import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[5 + i, 6, 7 + i, 8] for i in range(4)]
THREADS = """
import threading, time
import numpy                      # OpenBLAS starts its thread pool here; it stops at a fork
from stagewise.executor.zygote import _threads_after_fork
print(_threads_after_fork())
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
print(_threads_after_fork())
"""


def test_only_threads_that_outlive_a_fork_make_a_warm_process_cold():
    out = subprocess.run([sys.executable, "-c", THREADS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "2"]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _running(pid: int) -> bool:
    """Not gone and not a zombie (dead, waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(pids: list[int], timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(_running(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.slow
def test_stages_fork_from_one_warm_process_that_heals_and_leaves_nothing(llama_dir, monkeypatch):
    with LLM(model=str(llama_dir)) as one:
        reference = [o.outputs[0].token_ids for o in one.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                                                   use_tqdm=False)]
    with LLM(model=str(llama_dir), pp_size=2, max_pipeline_restarts=5) as llm:
        ex = llm.engine.executor
        stages = [p.pid for p in ex.procs]
        (warm,) = {_parent(pid) for pid in stages}
        assert _comm(warm) == "stagewise-warm" and _parent(warm) == os.getpid()
        assert 0 < ex.startup["stage_cpu_s"] < 1.0, ex.startup       # a spawned stage imports for seconds
        assert llm.stats()["recovery"]["spares_ready"] == 1

        os.kill(warm, signal.SIGKILL)                 # its stages die with it; the rebuild starts another
        got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == reference
        assert _gone(stages)
        rebuilt = [p.pid for p in llm.engine.executor.procs]
        (warm2,) = {_parent(pid) for pid in rebuilt}
        assert warm2 != warm and _comm(warm2) == "stagewise-warm"
        assert llm.stats()["recovery"]["rebuilds"] == {"stage_died": 1}

        monkeypatch.setenv("OMP_DYNAMIC", "false")    # read as OpenMP loads: warm2 cannot give it to a stage
        os.kill(rebuilt[1], signal.SIGKILL)
        got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == reference
        (warm3,) = {_parent(p.pid) for p in llm.engine.executor.procs}
        assert warm3 not in (warm, warm2) and _comm(warm3) == "stagewise-warm"
        everything = [warm2, warm3, *(p.pid for p in llm.engine.executor.procs)]
    assert _gone(everything)
