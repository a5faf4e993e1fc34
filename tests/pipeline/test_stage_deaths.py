"""How the driver names a lost stage (no model, no process group): a stage killed by a signal
says which signal; a stage that stopped because its neighbour's link failed is not blamed; a
link that timed out names the stage and node, not gloo's source path."""
from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time

import pytest

from stagewise.cluster.layout import default_layout, stages_of
from stagewise.config import EngineConfig
from stagewise.executor import multiproc
from stagewise.executor.multiproc import MultiprocExecutor


def _executor(procs, nnodes: int = 1) -> MultiprocExecutor:
    ex = MultiprocExecutor.__new__(MultiprocExecutor)
    ex.config = EngineConfig.from_kwargs(pp_size=2, nnodes=nnodes, master_port=29500 if nnodes > 1 else None)
    ex.timeout, ex.procs, ex.dead, ex.closing = 20.0, procs, None, False
    ex.layout = default_layout(2, nnodes)               # the node of each stage
    ex.local_stages = stages_of(ex.layout, 0)
    return ex


def _watch(ex: MultiprocExecutor) -> str:
    thread = threading.Thread(target=ex._monitor, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while ex.dead is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return ex.dead


def test_a_stage_killed_by_a_signal_names_it():
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=time.sleep, args=(30,), name=f"stagewise-stage-{s}", daemon=True) for s in (0, 1)]
    for p in procs:
        p.start()
    ex = _executor(procs)
    procs[1].kill()
    why = _watch(ex)
    procs[0].kill()
    assert why.startswith("stage 1 (node 0) (pid ") and "was killed by SIGKILL" in why and "None" not in why, why


@pytest.mark.slow
def test_a_stage_stopped_by_a_remote_peer_is_not_blamed(monkeypatch):
    monkeypatch.setattr(multiproc, "MONITOR_GRACE_S", 0.0)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=SystemExitCode(1), name="stagewise-stage-0", daemon=True)
    proc.start()
    why = _watch(_executor([proc], nnodes=2))
    assert "died unexpectedly" not in why and "stopped because its link to a neighbouring stage failed" in why
    assert "on another node" in why and "other nodes' logs" in why, why


class SystemExitCode:
    def __init__(self, code: int):
        self.code = code

    def __call__(self):
        raise SystemExit(self.code)


def test_a_link_timeout_says_which_stage_and_keeps_gloo_text_in_the_log(caplog):
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                        "Timed out waiting 20000ms for recv operation to complete")
    with caplog.at_level(logging.ERROR, logger="stagewise.executor"):
        why = _executor([])._link_failure(1, "receiving from", gloo)
    assert why == "no answer from stage 1 (node 0) within 20 s; a stage is stuck or unreachable."
    assert "unbound_buffer.cc" in caplog.text
