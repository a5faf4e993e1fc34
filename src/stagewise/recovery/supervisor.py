"""The pipeline supervisor: everything that keeps the stages alive, so the engine only drives.

It owns the executor's lifetime: the first start, teardown and rebuild after a stage dies, hangs
or loses a link (new processes and links; across nodes, a new generation on the nodes that rejoin
in time, with the layers and the node of each stage planned over them: placement.py), the warm
process stages fork from, and nodes that join (or wait as standbys) and leave. Beside it
(rules.py): the restart budget, the poison-plan rule (an admission rule of the scheduler) and the recovery counters. The
engine calls `tend` before each step and `lost` when the executor failed, and reports applied
plans and finished requests (they clear suspects); requests change only through the scheduler,
seen here as `LiveRequests`. A pipeline that cannot be healed raises `Unrecoverable`.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Callable, NoReturn, Protocol

from ..cluster.auth import cluster_token, key_of, warn_if_open
from ..cluster.netif import master_ip
from ..cluster.rendezvous import torchrun_env
from ..config import EngineConfig
from ..errors import EngineDeadError
from ..executor import Executor, make_executor
from ..executor.generations import (
    await_nodes,
    end_generations,
    leaving,
    next_generation,
    ready_nodes,
)
from ..executor.spawn import start_warm, stop_warm, warm_ready
from ..plan import StepPlan, StepResult
from ..request import Request
from .placement import layout_line, plan_on
from .rules import RecoveryStats, RestartBudget, Suspects, poison_message

log = logging.getLogger("stagewise.engine")
NODE_CHECK_S = 1.0             # how often a pipeline with a node left out looks for it
# After a rebuild a warm process that had to be started again (it died) starts this long after the new
# pipeline's first token: its start (importing torch) takes seconds of CPU the recompute needs.
SPARES_AFTER_RECOVERY_S = 5.0
NODE_RETURNED = "node_returned"    # the cause of a rebuild that gives a returned node its stages back
NODE_LEAVING = "node_leaving"      # the cause of a rebuild without a node that asked to leave
PLANNED = (NODE_RETURNED, NODE_LEAVING)     # rebuilds on purpose: no restart used, no suspects


class Unrecoverable(Exception):
    """The pipeline cannot be healed (no restarts left, no room, or healing is off): one sentence."""


class LiveRequests(Protocol):
    """What the supervisor needs of the scheduler."""
    running: list[Request]
    waiting: deque[Request]
    admission_rules: list[Callable[[Request], bool]]

    @property
    def requests(self) -> dict[str, Request]: ...     # every unfinished request

    def fail(self, request_ids: list[str], message: str) -> list[Request]: ...
    def restart(self, num_blocks: int) -> int: ...    # requeue all for recompute on a new, empty cache


def start_pipeline(config: EngineConfig, model_dir: str, eos_token_ids: tuple[int, ...],
                   keep_partition: bool = False) -> Executor:
    """The first pipeline (the supervisor heals it from then on). Across nodes: on the nodes ready
    (all --nnodes, or at least --min-nodes within --node-rejoin-timeout-s), over the partition and
    layout their reported memory and speed give (`plan_on`)."""
    c = config
    if c.cluster.nnodes == 1 or torchrun_env() is not None:
        return make_executor(config, model_dir, eos_token_ids)
    assert c.cluster.master_port is not None, "validated: a multi-node pipeline has a fixed --master-port"
    token = cluster_token(c.cluster.cluster_token)
    warn_if_open(token, master_ip(c.cluster.master_addr), True)
    generation = next_generation(c.cluster.master_addr, c.cluster.master_port, key_of(token))
    need = c.cluster.min_nodes or c.cluster.nnodes
    wait_s = c.recovery.node_rejoin_timeout_s if need < c.cluster.nnodes else max(c.cluster.dist_timeout_s, 300.0)
    present = await_nodes(c.cluster.master_addr, c.cluster.master_port, generation, list(range(1, c.cluster.nnodes)),
                          wait_s, first=need - 1)
    if len(present) + 1 < need:
        lower = ", or lower --min-nodes" if c.cluster.min_nodes else ""
        raise EngineDeadError(f"The pipeline failed to start: only {len(present) + 1} of the {need} nodes it needs "
                              f"were ready within {wait_s:.0f} s; start the other nodes' commands (the same "
                              f"--master-addr, --master-port and cluster token){lower}.")
    if len(present) + 1 < c.cluster.nnodes:
        log.warning("the first pipeline runs on node(s) %s of %d; the others join when they start",
                    ", ".join(map(str, [0, *present])), c.cluster.nnodes)
    try:
        c, layout = plan_on(c, model_dir, [0, *present], keep_partition=keep_partition)
    except ValueError as exc:
        raise EngineDeadError(f"The pipeline failed to start: {exc}") from None
    return make_executor(c, model_dir, eos_token_ids, generation=generation, layout=layout)


class PipelineSupervisor:
    """Heals the executor it is given: teardown, rebuild, placement, spares, returning nodes."""

    def __init__(self, config: EngineConfig, model_dir: str, eos_token_ids: tuple[int, ...], executor: Executor,
                 requests: LiveRequests, keep_partition: bool = False):
        self.config, self.model_dir, self.eos_token_ids = config, model_dir, eos_token_ids
        self.keep_partition = keep_partition     # the user gave the layer counts: rebuilds keep them
        self.executor, self.requests = executor, requests
        # NOTE: not under torchrun: its agent, not this process, would have to restart the other ranks
        # (across nodes, the other nodes' `run_headless` rejoins each pipeline this driver builds).
        self.heals = (config.parallel.pp_size > 1 or config.parallel.tp_size > 1) and torchrun_env() is None
        self.restarts = RestartBudget(config.recovery.max_pipeline_restarts, config.recovery.pipeline_restart_window_s)
        self.suspects = Suspects()
        self.recovery = RecoveryStats()
        self._spares_due: float | None = time.monotonic() + config.recovery.pipeline_spares_delay_s
        self._node_check_at = 0.0
        self._rejoin_s = 0.0           # the last rebuild's wait for the other nodes to be ready
        self._no_room = False          # the nodes left cannot hold the model (fatal)
        self.moves: list[dict] = []    # each change of the nodes the pipeline runs on: why, layout, when
        self.standby: set[int] = set()  # ready nodes the current pipeline does not need
        requests.admission_rules.append(self.suspects.may_admit)     # suspects wait their turn

    def die(self, why: str) -> NoReturn:
        raise Unrecoverable(why)

    @property
    def recovering(self) -> str | None:
        """Why the pipeline is being rebuilt, while it is (the next `tend` rebuilds it)."""
        return self.recovery.recovering

    def tend(self) -> bool:
        """Before a step: rebuild a lost pipeline, start spares when due, make room for a node
        that came back. True when it rebuilt the pipeline (its stages count from zero again)."""
        rebuilt = bool(self.recovering)
        if rebuilt:
            self._rebuild()
        self.poll()
        return rebuilt

    def poll(self) -> None:
        """Start spares when due; across nodes, make room for a node that came back."""
        self._start_spares_when_due()
        self._welcome_returned_nodes()

    def lost(self, why: str, inflight: Iterable[StepPlan]) -> list[Request]:
        """The pipeline failed with `inflight` plans in flight: die unless it can be rebuilt; else
        fail the poisoned requests alone and mark it recovering. Returns the failed requests."""
        cause = self.executor.cause or "unknown"
        planned = cause in PLANNED                 # not a failure: no restart used, no suspects
        if not self.heals or self.config.recovery.max_pipeline_restarts == 0:
            self.die(why)
        if not planned and not self.restarts.take():
            self.die(self.restarts.refusal(why))
        unfinished = self.requests.requests
        in_flight = [] if planned else [unfinished[rid] for rid in
                                        dict.fromkeys(s.request_id for p in inflight for s in p.seqs)
                                        if rid in unfinished]
        poisoned = []
        for rid, strikes in self.suspects.crash(in_flight).items():
            poisoned += self.requests.fail([rid], poison_message(strikes))
        live = len(self.requests.requests)
        self.recovery.lost(cause, why, live, len(poisoned))
        log.log(logging.WARNING if planned else logging.ERROR, "pipeline %s: %s Rebuilding it; %d live request(s) "
                "will be recomputed%s.", "stopped" if planned else "failed", why, live,
                f", {len(poisoned)} that crashed it again fails" if poisoned else "")
        return poisoned

    def applied(self, plan: StepPlan, result: StepResult) -> None:
        """A plan came back: its requests are no longer suspects; a token ends a recovery (and the
        spares start a little later)."""
        self.suspects.cleared(s.request_id for s in plan.seqs)
        if result.sampled and self.recovery.recomputing:
            self.recovery.token_applied()
            self._spares_due = time.monotonic() + SPARES_AFTER_RECOVERY_S

    def finished(self, request_id: str) -> None:
        self.suspects.cleared([request_id])

    def _rebuild(self) -> None:
        """Tear the failed pipeline down, start a new one and requeue every live request for
        recompute. A start that fails uses the restart budget too."""
        t0 = time.monotonic()
        self.executor.shutdown()
        teardown_s = time.monotonic() - t0
        while True:
            try:
                self.executor = self._new_executor()
                break
            except EngineDeadError as exc:
                if self._no_room:             # the engine died: the nodes left cannot hold the model
                    raise
                if not self.restarts.take():
                    self.recovery.recovering = None
                    self.die(self.restarts.refusal(str(exc)))
                log.error("%s Trying again.", exc)
        self.suspects.regroup([*self.requests.running, *self.requests.waiting])
        requeued = self.requests.restart(self.executor.num_blocks)
        self._spares_due = None if requeued else time.monotonic()    # after the recompute's first token
        startup = {**self.executor.startup, "rejoin_s": self._rejoin_s}
        self.recovery.rebuilt(teardown_s, startup, requeued)
        log.warning("pipeline rebuilt in %.1f s (teardown %.1f s, %sstart %.1f s, weights %.1f s); recomputing "
                    "%d request(s)", time.monotonic() - t0, teardown_s,
                    f"waiting for nodes {self._rejoin_s:.1f} s, " if self.config.cluster.nnodes > 1 else "",
                    startup.get("spawn_s", 0.0), startup.get("load_s", 0.0), requeued)

    def _new_executor(self) -> Executor:
        """A new pipeline. One node: on a fresh port (the old group's store and links may linger a
        while). Several: a new generation in the same store (executor/generations.py), on the nodes that
        are ready for it within --node-rejoin-timeout-s; the stages of the others run on node 0."""
        c = self.config
        if c.cluster.nnodes == 1:
            return make_executor(c.replace(master_port=None), self.model_dir, self.eos_token_ids)
        addr, port = c.cluster.master_addr, c.cluster.master_port
        assert port is not None and isinstance(c.parallel.pp_layer_partition, tuple), "resolved by the engine"
        generation = next_generation(addr, port)        # the first pipeline serves the store
        t0 = time.monotonic()
        present = await_nodes(addr, port, generation, list(range(1, c.cluster.nnodes)),
                              c.recovery.node_rejoin_timeout_s)
        self._rejoin_s = time.monotonic() - t0
        try:
            c, layout = plan_on(c, self.model_dir, [0, *present], keep_partition=self.keep_partition)
        except ValueError as exc:
            self.recovery.recovering, self._no_room = None, True
            self.die(f"The pipeline cannot be rebuilt on the nodes left: {exc}")
        self.standby = set(present) - set(layout)       # ready but not needed: they wait as standbys
        if layout != self.executor.layout or c.parallel.pp_layer_partition != self.executor.partition:
            self._log_move(c, layout, present)
        return make_executor(c, self.model_dir, self.eos_token_ids, generation=generation,
                             layout=layout)

    def _log_move(self, c: EngineConfig, layout: tuple[int, ...], present: list[int]) -> None:
        """Say where the stages went and why: nodes that left or are gone, nodes that joined."""
        before = set(self.executor.layout)
        assert c.cluster.master_port is not None and isinstance(c.parallel.pp_layer_partition, tuple)
        gone = sorted(before - set(layout))
        left = [n for n in gone if leaving(c.cluster.master_addr, c.cluster.master_port, n)]
        lost = [n for n in gone if n not in left]
        joined = sorted(set(layout) - before)
        why = "; ".join(part for part in (
            f"node {', '.join(map(str, lost))} did not rejoin within {c.recovery.node_rejoin_timeout_s:.0f} s "
            f"(or stopped beating)" if lost else "",
            f"node {', '.join(map(str, left))} left" if left else "",
            f"node {', '.join(map(str, joined))} joined" if joined else "") if part)
        self.moves.append({"why": why, "layout": list(layout), "partition": list(c.parallel.pp_layer_partition),
                           "at": time.time()})
        log.warning("%s; the pipeline runs on: %s", why, layout_line(layout, c.parallel.pp_layer_partition))

    def _welcome_returned_nodes(self) -> None:
        """Across nodes, once a second: a node left out of the pipeline (it did not rejoin in time, or
        it started after the pipeline) that is ready stops the pipeline, and the rebuild gives it
        stages, unless the plan with it is the plan without it (it then waits as a standby, which
        a later rebuild uses); a node of the pipeline that asks to leave stops it too, and the
        rebuild goes on without it."""
        ex, c = self.executor, self.config
        generation = ex.generation
        if generation is None or not self.heals or self.recovering or c.cluster.master_port is None \
                or ex.dead or time.monotonic() < self._node_check_at:
            return
        self._node_check_at = time.monotonic() + NODE_CHECK_S
        going = [n for n in sorted(set(ex.layout) - {0}) if leaving(c.cluster.master_addr, c.cluster.master_port, n)]
        if going:
            ex.stop(f"node {', '.join(map(str, going))} asked to leave.", NODE_LEAVING)
            return
        left_out = sorted(set(range(1, c.cluster.nnodes)) - set(ex.layout) - self.standby)
        back = ready_nodes(c.cluster.master_addr, c.cluster.master_port, generation, left_out) if left_out else []
        back = [n for n in back if not leaving(c.cluster.master_addr, c.cluster.master_port, n)]
        if back and self._changes_plan(back):
            ex.stop(f"node {', '.join(map(str, back))} is back.", NODE_RETURNED)

    def _changes_plan(self, back: list[int]) -> bool:
        """Whether the pipeline would run otherwise with the nodes in `back` (else they are standbys)."""
        ex = self.executor
        try:
            c, layout = plan_on(self.config, self.model_dir, sorted({0, *ex.layout, *back}), measure=False,
                                keep_partition=self.keep_partition)
        except ValueError:
            return True        # (it cannot hold now: a rebuild says so in one sentence)
        if layout != ex.layout or c.parallel.pp_layer_partition != ex.partition:
            return True
        self.standby |= set(back)
        log.warning("node %s joined as a standby: the pipeline is as fast without it; a rebuild will use it",
                    ", ".join(map(str, back)))
        return False

    def _start_spares(self) -> None:
        self._spares_due = None
        if self.heals and self.config.recovery.pipeline_spares and self.config.recovery.max_pipeline_restarts:
            start_warm(self.model_dir)

    def _start_spares_when_due(self) -> None:
        if self._spares_due is not None and time.monotonic() >= self._spares_due:
            self._start_spares()

    def stats(self) -> dict:
        layout, partition = self.executor.layout, self.executor.partition
        return {**self.recovery.snapshot(), "spares_ready": warm_ready() if self.heals else 0,
                "nodes": sorted(set(layout)), "standby": sorted(self.standby), "layout": list(layout),
                "moves": len(self.moves),
                "partition": list(partition),
                "last_move": self.moves[-1] if self.moves else None}

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.config.cluster.nnodes > 1:
            end_generations()
        if self.heals:
            stop_warm()
