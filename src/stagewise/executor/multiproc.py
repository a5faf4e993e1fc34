"""MultiprocExecutor: the driver's side of a pipeline of stage processes.

It spawns this node's stage processes (other nodes run `run_headless`), joins the pipeline as
rank 0 (links.py), sends plans into the ring and receives results from the last stage. A
monitor thread watches the local stage processes, a watch thread every stage's heartbeats
(liveness.py), and a heartbeat thread keeps idle links alive; any death, silence, timeout or IO
error is fatal to this executor: every stage is stopped and EngineDeadError carries the reason
(`cause` says which kind). The engine then builds a new executor (fresh processes and links: on a
new port, or across nodes a new generation of the driver's store, executor/generations.py) or
fails, engine/engine.py decides.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from collections import deque
from dataclasses import replace
from multiprocessing.connection import wait as wait_sentinels
from typing import NoReturn

from ..cluster.auth import cluster_token, key_of, new_token, warn_if_open
from ..cluster.layout import DRIVER_RANK, default_layout, stages_of
from ..cluster.links import PipelineLinks, join_pipeline
from ..cluster.netif import master_ip
from ..cluster.node_options import shipped_options
from ..cluster.rendezvous import abandon_when, free_port, torchrun_env
from ..errors import EngineDeadError, describe_exit
from ..kernels.report import KernelInfo, describe
from ..plan import StepPlan, StepResult
from ..planning.resolved import Resolved
from .generations import control_store, next_generation, nodes_gone, publish_layout
from .liveness import Watch
from .messages import (
    CONTROL,
    READY_WAIT_S,
    Heartbeat,
    Message,
    PlanMsg,
    ReadyMsg,
    ResultMsg,
    Shutdown,
    recv_message,
    send_message,
)
from .spawn import spawn_stages

log = logging.getLogger("stagewise.executor")
MONITOR_GRACE_S = 2.0
REAP_WAIT_S = 1.0             # a stage's pipe closed: time for its exit status to become known


class MultiprocExecutor:
    cause: str | None = None              # once dead: stage_died, timeout, link, interrupted or a stop's
    kernels: list[KernelInfo] = []        # which kernels each stage runs, from its ReadyMsg (kernels/report.py)

    def __init__(self, config, model_dir: str, eos_token_ids: tuple[int, ...], generation: int | None = None,
                 layout: tuple[int, ...] | None = None):
        """Across nodes, `generation` is the pipeline's number if the caller opened it already
        (generations.next_generation), and `layout` the node of each stage (default: the command line's)."""
        self.config, self.timeout = config, config.cluster.dist_timeout_s
        self.layout = layout or default_layout(config.parallel.pp_size, config.cluster.nnodes)
        self.local_stages = stages_of(self.layout, 0)
        # NOTE: resolved by the engine before any stage starts (a tuple), unless a caller passed a mode
        self.partition: tuple[int, ...] = tuple(config.parallel.pp_layer_partition) \
            if isinstance(config.parallel.pp_layer_partition, tuple) else ()
        self.procs: list[mp.Process] = []
        self.lock = threading.Lock()          # one user of the links at a time
        self.pending: deque = deque()         # sends not yet known complete
        self.num_inflight = 0
        self.last_traffic = time.monotonic()
        self.dead: str | None = None
        self.startup: dict[str, float] = {}   # seconds: spawn (processes, imports, rendezvous), load (weights)
        self.closing = False
        t0 = time.monotonic()
        from ..model.registry import registered_models
        models = registered_models()      # NOTE: spawned stages import user classes by reference
        env = torchrun_env()
        addr = env["addr"] if env else config.cluster.master_addr
        port = env["port"] if env else (config.cluster.master_port or free_port())
        token = cluster_token(config.cluster.cluster_token)
        warn_if_open(token, master_ip(addr), config.cluster.nnodes > 1 or env is not None)
        if not token and config.cluster.nnodes == 1 and not env:
            token = new_token()           # every process of this pipeline starts here: they inherit it
        wait_s = max(self.timeout, 300.0)
        self.links: PipelineLinks | None = None
        try:
            # NOTE: across nodes every pipeline is a new generation of the same store (generations.py)
            self.generation = None
            if config.cluster.nnodes > 1 and not env:
                self.generation = generation or next_generation(addr, port, key_of(token))
                publish_layout(addr, port, self.generation, self.layout, self.partition or None,
                               shipped_options(config))
            if not env:
                self.procs = spawn_stages(Resolved(cluster_token=token).launch_config(config), model_dir, 0, addr, port,
                                          eos_token_ids, models, generation=self.generation,
                                          stages=self.local_stages)
            remote = sorted(set(self.layout) - {0}) if self.generation else []
            with abandon_when(nodes_gone(addr, port, remote)):     # a node gone meanwhile: retry without it
                self.links = join_pipeline(DRIVER_RANK, config.parallel.pp_size + 1, addr, port, wait_s, key_of(token),
                                           self.generation, control_store(addr, port) if self.generation else None,
                                           config.cluster.dist_ifname)
            self.memory_plans, load_s, self.kernels, cpu_s = self._await_ready()
        except Exception as exc:     # noqa: BLE001  (any start-up failure: one sentence, nothing left running)
            self._kill_all()
            if self.links is not None:
                self.links.close()
            raise EngineDeadError(f"The pipeline failed to start: {exc}") from None
        self.num_blocks = min(p.num_blocks for p in self.memory_plans)
        total = time.monotonic() - t0
        self.startup = {"spawn_s": max(0.0, total - load_s), "load_s": load_s, "total_s": total,
                        "stage_cpu_s": cpu_s}
        self.watch = Watch(self.links.controls, config.cluster.heartbeat_timeout_s, self._silent)
        threading.Thread(target=self._monitor, daemon=True, name="stagewise-monitor").start()
        threading.Thread(target=self._heartbeat, daemon=True, name="stagewise-heartbeat").start()

    def _await_ready(self) -> tuple[list, float, list[KernelInfo], float]:
        """Every stage's memory plan, the longest weight load (the stages load in parallel), which
        kernels each stage runs (tagged with its stage), and the most CPU seconds a stage process
        took to get ready (imports included where it was not forked from a warm process)."""
        assert self.links is not None, "joined"
        plans, load_s, kernels, cpu_s = [], 0.0, [], 0.0
        for stage, link in enumerate(self.links.controls):
            msg = recv_message(link, max(self.timeout, READY_WAIT_S), CONTROL)
            assert isinstance(msg, ReadyMsg), "a stage's first control message says it is ready"
            if msg.error is not None or msg.memory_plan is None:
                raise RuntimeError(msg.error)
            plans.append(msg.memory_plan)
            load_s, cpu_s = max(load_s, msg.load_s), max(cpu_s, msg.start_cpu_s)
            kernels += [replace(k, stage=stage) for k in msg.kernels]
            # the stage logged it too, but stage processes log warnings only: the driver says it
            log.info("stage %d kernels: %s", stage, describe(msg.kernels))
        return plans, load_s, kernels, cpu_s

    # the links
    def submit(self, plan: StepPlan) -> None:
        self._check()
        with self.lock:
            self._send(PlanMsg(plan))
            self.num_inflight += 1

    def collect(self) -> StepResult:
        self._check()
        with self.lock:
            msg = self._recv()
            self.num_inflight -= 1
        if not isinstance(msg, ResultMsg):
            self._fail(f"the last stage answered a plan with {type(msg).__name__}, not a result.")
        return msg.result

    def _send(self, msg: Message) -> None:
        try:
            while len(self.pending) > 2 * self.config.parallel.pp_size:
                self.pending.popleft().wait(self.timeout)
            assert self.links is not None, "joined"
            self.pending.append(send_message(self.links.next, msg))
        except Exception as exc:     # noqa: BLE001  (timed out, closed or broke: the link is gone)
            self._fail(self.dead or self._link_failure(0, "sending to", exc))
        except BaseException:
            self._interrupted()
            raise
        self.last_traffic = time.monotonic()

    def _recv(self) -> Message:
        last = self.config.parallel.pp_size - 1
        try:
            assert self.links is not None, "joined"
            msg = recv_message(self.links.prev, self.timeout)
        except Exception as exc:     # noqa: BLE001  (as in _send)
            time.sleep(0.2)          # let the monitor name a stage that was killed here first
            self._fail(self.dead or self._link_failure(last, "receiving from", exc))
        except BaseException:
            self._interrupted()
            raise
        self.last_traffic = time.monotonic()
        return msg

    def _where(self, stage: int) -> str:
        return f"stage {stage} (node {self.layout[stage]})"

    def _link_failure(self, stage: int, doing: str, exc: Exception) -> str:
        """Why a link failed, naming the stage behind it and its node: a timeout, or a closed link.
        NOTE: the link's own text goes to the log, not to people."""
        where = self._where(stage)
        log.error("%s %s failed: %s", doing, where, exc)
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            self.cause = self.cause or "timeout"
            return f"no answer from {where} within {self.timeout:.0f} s; a stage is stuck or unreachable."
        self.cause = self.cause or "link"
        return f"{doing} {where} failed: the link closed; a stage process died or lost its connection{self._hint()}."

    def _hint(self) -> str:
        return " (see the other nodes' logs)" if self.config.cluster.nnodes > 1 else ""

    def _death_message(self, p) -> str:
        """Why a local stage process ended. Exit code 1 is a stage that stopped because a link to a
        neighbour failed: the cause is that neighbour (on another node, when there are several)."""
        index = self.procs.index(p)
        where = self._where(self.local_stages[index // self.config.parallel.tp_size])
        if self.config.parallel.tp_size > 1:
            where += f" tensor-parallel rank {index % self.config.parallel.tp_size}"
        if p.exitcode == 1:
            elsewhere = "on another node " if self.config.cluster.nnodes > 1 else ""
            return (f"{where} stopped because its link to a neighbouring stage failed; a stage "
                    f"{elsewhere}died or became unreachable{self._hint()}.")
        return f"{where} (pid {p.pid}) died unexpectedly: it {describe_exit(p.exitcode)}."

    def _interrupted(self) -> None:
        """Ctrl-C (or another exception) mid-transfer: the links hold half a message, never reuse them."""
        self.dead = self.dead or "The pipeline was interrupted in the middle of a transfer."
        self.cause = self.cause or "interrupted"
        self._kill_all()

    # faults and liveness
    def _check(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)

    def stop(self, why: str, cause: str) -> None:
        """End this pipeline on purpose (the engine rebuilds it): its stages die as in a failure."""
        self.dead, self.cause = self.dead or why, self.cause or cause
        log.warning("stopping the pipeline: %s", why)
        self._kill_all()

    def _fail(self, why: str) -> NoReturn:
        self.dead = self.dead or why
        self._kill_all()
        raise EngineDeadError(self.dead)

    def _monitor(self) -> None:
        alive: dict = {p.sentinel: p for p in self.procs}
        while alive and not self.closing:
            for sentinel in wait_sentinels(list(alive), timeout=1.0):
                p = alive.pop(sentinel)
                p.join(REAP_WAIT_S)     # NOTE: the sentinel can fire before the exit status is reapable
                if p.exitcode == 1 and not self.closing:
                    # NOTE: exit code 1 is a stage stopping because a peer's link failed; give the link
                    # error (which names the stage behind it) a moment to be the reported cause.
                    time.sleep(MONITOR_GRACE_S)
                if not self.closing and not self.dead:
                    self.dead, self.cause = self._death_message(p), "stage_died"
                    log.error(self.dead)
                    self._kill_all()

    def _silent(self, stage: int, silent_s: float) -> None:
        """The watch found a stage silent: it is stopped, frozen or cut off. Stop the pipeline and wake
        the ring's receive (the engine rebuilds it as after a death)."""
        if self.closing or self.dead:
            return
        self.dead = (f"{self._where(stage)} stopped answering: no heartbeat for {silent_s:.1f} s "
                     f"(--heartbeat-timeout-s {self.config.cluster.heartbeat_timeout_s:g}); it is stopped, frozen "
                     f"or cut off from the network{self._hint()}.")
        self.cause = "timeout"
        log.error(self.dead)
        self._kill_all()
        if self.links is not None:
            self.links.abort()

    def _heartbeat(self) -> None:
        """An idle driver sends a heartbeat around the ring every timeout/4, so an idle link never
        hits the group timeout."""
        period = self.timeout / 4
        while not self.closing and not self.dead:
            time.sleep(min(period, 1.0))
            if time.monotonic() - self.last_traffic < period or not self.lock.acquire(blocking=False):
                continue
            try:
                if self.num_inflight == 0 and not self.closing and not self.dead:
                    self._send(Heartbeat())
                    self._recv()
            except EngineDeadError:
                return
            finally:
                self.lock.release()

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def shutdown(self) -> None:
        """Stop every stage in order (or, once dead, kill them) and close the links."""
        if self.closing:
            return
        self.closing = True
        if self.dead:
            self._kill_all()        # NOTE: a stopped (SIGSTOP) or stuck stage never exits by itself
        if not self.dead:
            with self.lock:
                try:
                    self._send(Shutdown())
                    while not isinstance(self._recv(), Shutdown):   # results of abandoned plans
                        pass
                    while self.pending:
                        self.pending.popleft().wait(self.timeout)
                except EngineDeadError:
                    pass
        if getattr(self, "watch", None) is not None:
            self.watch.stop()
        if self.links is not None:
            self.links.close()
        for p in self.procs:
            p.join(timeout=10)
        self._kill_all()
