"""A stage process: receive (plan, proxy) from the previous rank, run the worker, pass the
result on. Stages run plans strictly in arrival order; a plan's proxy is cloned before it is
queued to send, so the next replay cannot overwrite rows still being sent. Once loaded it says
so on its control link and beats there (liveness.py).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time

from .. import envs
from ..cluster.auth import cluster_token, key_of
from ..cluster.layout import stage_rank
from ..cluster.links import PipelineLinks, join_pipeline
from ..kvcache.pages import StagePages, before_plan, finish_result, pages_only
from ..parallel.partition import stage_infos
from ..parallel.proxy import ProxyTensors
from ..plan import PlanFailed, StepResult
from ..runtime.threads import configure_threads
from .hygiene import die_with_parent, exit_now, freeze_heap, name_process
from .liveness import start_beating
from .messages import (
    READY_WAIT_S,
    Heartbeat,
    Message,
    PlanFailedMsg,
    PlanMsg,
    ReadyMsg,
    ResultMsg,
    Shutdown,
    recv_message,
    send_message,
)

log = logging.getLogger("stagewise.stage")
# Test hook (never set in normal use): "TOKEN" or "TOKEN@STAGE" makes that stage (default: the last)
# SIGKILL itself when a plan brings it a request whose tokens contain TOKEN, each time it is
# (re)computed: a request that crashes the pipeline, for the recovery tests (README: When a stage fails).
CRASH_HOOK_ENV = "STAGEWISE_TEST_CRASH_TOKEN"


def stage_main(config, model_dir: str, stage_idx: int, addr: str, port: int, eos_ids, spawned: bool = True,
               models: dict | None = None, generation: int | None = None, tp: tuple[int, str] | None = None,
               started=None) -> None:
    """Entry point of one stage (forked from a node's warm process, spawned by the driver or a
    headless node, or started by torchrun; `started` says so to the spawner).
    `models` re-registers the driver's model table (user-registered architectures); `generation`
    is the driver's pipeline number across nodes (executor/generations.py); `tp` (rank, directory)
    this process's tensor-parallel rank of the stage and where its ranks meet (executor/tp_ranks.py)."""
    if spawned:
        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # the driver shuts us down in order
    tp_rank = tp[0] if tp else 0
    name_process(f"stagewise-st{stage_idx}" + (f"r{tp_rank}" if config.parallel.tp_size > 1 else ""))
    if started is not None:
        started.send(True)
        started.close()
    configure_threads(config)
    if models:
        from ..model.registry import register_model
        for arch, cls in models.items():
            register_model(arch, cls)
    where = f"stage {stage_idx}" + (f" rank {tp_rank}" if tp_rank else "")
    logging.basicConfig(level=logging.WARNING, format=f"[{where}] %(message)s")
    code, links = 0, None
    try:
        if tp and tp_rank:       # a follower: it hears plans from its stage's rank 0, not from the ring
            from .tp_ranks import serve_follower
            serve_follower(config, model_dir, _stage_of(config, model_dir, stage_idx), eos_ids, tp[1], tp_rank,
                           _handle)
        else:
            # NOTE: nodes start in any order; like the driver, wait minutes (not one link timeout) for the others.
            cluster = config.cluster
            links = join_pipeline(stage_rank(stage_idx), config.parallel.pp_size + 1, addr, port,
                                  max(cluster.dist_timeout_s, 300.0), key_of(cluster_token(cluster.cluster_token)),
                                  generation, dist_ifname=cluster.dist_ifname)
            _serve(config, model_dir, stage_idx, eos_ids, links, tp[1] if tp else None)
    except Exception as exc:  # noqa: BLE001 (a peer died or timed out: exit and let the cascade reach the driver)
        log.error("%s stopped: %s", where, exc)
        code = 1
    finally:
        if links is not None:
            links.close()
    if spawned:   # NOTE: skip interpreter teardown (seconds with torch loaded); nothing is left to flush
        exit_now(code)
    sys.exit(code)


def _stage_of(config, model_dir: str, stage_idx: int):
    from ..checkpoint.facts import read_facts
    from ..planning.stage_cost import resolve_partition
    facts = read_facts(model_dir)
    partition = resolve_partition(config, facts)      # headless nodes resolve `auto` here (counts are kept)
    return stage_infos(facts.num_layers, config.parallel.pp_size, partition)[stage_idx]


def _serve(config, model_dir: str, stage_idx: int, eos_ids, links: PipelineLinks, tp_dir: str | None) -> None:
    from ..runtime.worker import Worker
    stage = _stage_of(config, model_dir, stage_idx)
    assert links.control is not None, "a stage dials the driver's control link"
    t0 = time.monotonic()
    leader = None
    try:
        if tp_dir is not None:
            from .tp_ranks import Leader
            leader = Leader(tp_dir, config.parallel.tp_size, config.cluster.dist_timeout_s)
        worker = Worker(config, model_dir, stage, eos_ids, tp_group=leader.group if leader else None)
        if leader is not None:
            leader.await_ready(worker.memory_plan)
    except Exception as exc:
        send_message(links.control, ReadyMsg(error=f"stage {stage_idx}: {exc}")).wait()
        if leader is not None:
            leader.close()
        raise
    pages = StagePages.open(config, model_dir, stage, worker)
    freeze_heap()
    from ..kernels.report import announce
    kernels = announce(worker.model, worker.device, stage_idx)      # the INFO line, and the driver's stats
    # NOTE: process_time counts from this process's start: a forked stage's holds no imports
    send_message(links.control, ReadyMsg(worker.memory_plan, time.monotonic() - t0, kernels=kernels,
                                         start_cpu_s=time.process_time())).wait()
    start_beating(links.control, stage_idx, config.cluster.heartbeat_timeout_s)
    pending: list = []
    crash_token = _crash_token(stage)
    wait_s = max(config.cluster.dist_timeout_s, READY_WAIT_S)      # the first message comes once every stage is ready
    while True:
        msg = recv_message(links.prev, wait_s)
        wait_s = config.cluster.dist_timeout_s
        if crash_token is not None and isinstance(msg, PlanMsg):
            _crash_if_asked(msg.plan, crash_token)
        if leader is not None:
            leader.forward(msg, config.cluster.dist_timeout_s)
        out = _handle(worker, stage, msg, pages)
        if leader is not None:
            leader.check_in_step(msg, out)
        for p in pending:        # sends of two messages ago must be done before we reuse anything
            p.wait(config.cluster.dist_timeout_s)
        pending = pending[-1:] + [send_message(links.next, out)]
        if isinstance(msg, Shutdown):
            for p in pending:
                p.wait(config.cluster.dist_timeout_s)
            return


def _crash_token(stage) -> int | None:
    spec = envs.STAGEWISE_TEST_CRASH_TOKEN
    if not spec:
        return None
    token, _, where = spec.partition("@")
    return int(token) if int(where or stage.size - 1) == stage.rank else None


def _crash_if_asked(plan, token: int) -> None:
    if any(token in r.token_ids for r in plan.new_reqs):
        log.error("the %s test hook kills this stage (token %d)", CRASH_HOOK_ENV, token)
        os.kill(os.getpid(), signal.SIGKILL)


def _handle(worker, stage, msg: Message, pages: StagePages | None = None) -> Message:
    """Run a plan (or skip one that failed upstream) after its disk-tier page work (kvcache/pages.py);
    pass anything else along (a Shutdown once this stage's pages are written)."""
    if isinstance(msg, PlanFailedMsg):
        plan = msg.plan
        before_plan(pages, plan, failed=True)
        out = worker.skip(plan, msg.why)
    elif isinstance(msg, PlanMsg):
        plan = msg.plan
        before_plan(pages, plan, failed=False)
        if not plan.seqs:
            out = pages_only(worker, stage, plan)
        else:
            proxy = ProxyTensors({k: t.to(worker.device) for k, t in msg.proxy.items()}) if msg.proxy else None
            out = worker.execute(plan, proxy)
    elif isinstance(msg, (Heartbeat, Shutdown)):
        if isinstance(msg, Shutdown) and pages is not None:
            pages.flush()
        return msg                       # pass along
    else:
        raise TypeError(f"a stage does not take {type(msg).__name__} on the ring")
    busy, comm = plan.stage_busy_s + [worker.busy_s], plan.stage_comm_s + [worker.comm_s]
    if isinstance(out, StepResult):
        out.stage_busy_s, out.stage_comm_s = busy, comm
        return ResultMsg(finish_result(out, plan))
    fwd = plan.without_embeds()
    fwd.stage_busy_s, fwd.stage_comm_s = busy, comm
    if isinstance(out, PlanFailed):
        return PlanFailedMsg(fwd, out.why)
    return PlanMsg(fwd, {k: t.clone() for k, t in out.items()})
