"""Offline `LLM(pp_size=2)` heals: a stage SIGKILLed (or SIGSTOPped: found by its heartbeats) in the
middle of `generate` is replaced, every request is recomputed from its tokens and the call returns
every output, equal to the fault-free run; a request that crashes the pipeline each time it runs
exhausts --max-pipeline-restarts and then fails everything with one sentence (the limit). Real stage
processes, real signals; the crash comes from the stage test hook (STAGEWISE_TEST_CRASH_TOKEN,
executor/stage_proc.py)."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from stagewise import LLM, SamplingParams
from stagewise.errors import EngineDeadError

pytestmark = pytest.mark.slow

CRASH_TOKEN = 997
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPTS = [[5 + i, 6, 7 + i, 8, 9 + 2 * i] for i in range(6)]
DIST_TIMEOUT_S = 60           # no fault here may wait for it: deaths close links, hangs miss heartbeats
HANG_FOUND_S = 30             # a stopped stage is declared lost after ~5 s of silence; generous on a busy box


@pytest.fixture(scope="module")
def reference(healing_llm):
    """The fault-free run (PP=2 equals the one-stage run: test_pipeline.py)."""
    outs = healing_llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def healing_llm(llama_dir):
    """A PP=2 LLM whose stages (those it starts later too) crash on CRASH_TOKEN, forked from its
    warm process (which took the variable from this process when it forked them)."""
    old = os.environ.get("STAGEWISE_TEST_CRASH_TOKEN")
    os.environ["STAGEWISE_TEST_CRASH_TOKEN"] = str(CRASH_TOKEN)      # the stages inherit it
    try:
        llm = LLM(model=str(llama_dir), pp_size=2, dist_timeout_s=DIST_TIMEOUT_S, max_pipeline_restarts=1,
                  pipeline_spares_delay_s=0)
        _wait_spares(llm)
        yield llm
        llm.shutdown()
    finally:
        if old is None:
            del os.environ["STAGEWISE_TEST_CRASH_TOKEN"]
        else:
            os.environ["STAGEWISE_TEST_CRASH_TOKEN"] = old


def _wait_spares(llm, timeout_s: float = 60) -> None:
    llm.engine.step()
    deadline = time.monotonic() + timeout_s
    while llm.stats()["recovery"]["spares_ready"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert llm.stats()["recovery"]["spares_ready"] == 1      # the warm process that forked the stages


def _kill_after(llm, steps: int, stage: int, signum: int = signal.SIGKILL, sent: dict | None = None) \
        -> threading.Thread:
    """SIGKILL (or `signum`) `stage` once the engine has collected `steps` more plans; `sent["at"]`: when."""
    target = llm.engine.stats_.num_steps + steps

    def kill():
        deadline = time.monotonic() + 60
        while llm.engine.stats_.num_steps < target and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(llm.engine.executor.procs[stage].pid, signum)
        if sent is not None:
            sent["at"] = time.monotonic()
    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_a_stage_killed_during_generate_loses_no_request(healing_llm, reference):
    llm = healing_llm
    llm.engine.supervisor.restarts.times.clear()
    old_pids = [p.pid for p in llm.engine.executor.procs]
    killer = _kill_after(llm, 12, stage=1)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    killer.join(5)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * len(PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert not {p.pid for p in llm.engine.executor.procs} & set(old_pids)      # new stage processes
    rec = llm.stats()["recovery"]
    assert rec["rebuilds"] == {"stage_died": 1} and rec["recovered_requests"] == len(PROMPTS), rec
    assert rec["recovering"] is None and rec["recovery_s"] > 0 and rec["last"]["recompute_s"] >= 0, rec
    assert llm.engine.fault() is None
    # the rebuilt pipeline serves on, and reuses nothing of the old stages' KV
    again = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference[:2]


def test_a_stage_that_stops_answering_is_found_by_its_heartbeats(healing_llm, reference):
    """SIGSTOP: no heartbeat for --heartbeat-timeout-s (5 s), far below --dist-timeout-s; then healed as a
    dead stage is, nothing lost."""
    llm = healing_llm
    llm.engine.supervisor.restarts.times.clear()
    sent: dict = {}
    stopper = _kill_after(llm, 12, stage=1, signum=signal.SIGSTOP, sent=sent)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    stopper.join(5)
    assert [o.outputs[0].token_ids for o in outs] == reference
    last = llm.engine.supervisor.recovery.last
    assert last["cause"] == "timeout" and "stage 1 (node 0) stopped answering: no heartbeat for" in last["why"], last
    assert last["detected_at"] - sent["at"] < HANG_FOUND_S < DIST_TIMEOUT_S
    assert llm.engine.fault() is None


def test_a_crash_loop_fails_after_the_restart_limit(healing_llm):
    """A request that kills stage 1 whenever it runs: one rebuild (the limit here), and the second
    failure ends the engine as a failure without recovery does."""
    llm = healing_llm
    llm.engine.supervisor.restarts.times.clear()
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError) as info:
        llm.generate(prompt_token_ids=[[3, 4, CRASH_TOKEN, 5], *PROMPTS[:3]], sampling_params=GREEDY,
                     use_tqdm=False)
    why = str(info.value)
    assert why.startswith("stage 1 (node 0)") and "killed by SIGKILL" in why, why
    assert "not rebuilt again" in why and "--max-pipeline-restarts 1" in why, why
    assert [o.outputs[0].finish_reason for o in info.value.outputs] == ["error"] * 4
    assert llm.engine.fault() == why
    assert time.monotonic() - t0 < 60
