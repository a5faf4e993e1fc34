"""MultiprocExecutor: the driver's side of a pipeline of stage processes.

It spawns this node's stage processes (other nodes run `run_headless`), joins the process
group as rank 0, sends plans into the ring and receives results from the last stage. A
monitor thread watches the local stage processes and a heartbeat thread keeps idle links
alive; any death, timeout or IO error is fatal to this executor: every stage is stopped and
EngineDeadError carries the reason (`cause` says which kind). The engine then builds a new
executor (fresh processes, a fresh group: on a new port, or across nodes a new generation of the
driver's store, executor/generations.py) or fails, engine/engine.py decides.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from collections import deque
from multiprocessing.connection import wait as wait_sentinels

from ..errors import EngineDeadError, describe_exit
from ..parallel.transport import Message, recv_message, send_message
from ..plan import StepPlan, StepResult
from .generations import control_store, next_generation, publish_layout
from .launch import (
    DRIVER_RANK,
    default_layout,
    destroy_group,
    free_port,
    init_group,
    spawn_stages,
    stage_rank,
    stages_of,
    torchrun_env,
)

log = logging.getLogger("stagewise.executor")
MONITOR_GRACE_S = 2.0
REAP_WAIT_S = 1.0             # a stage's pipe closed: time for its exit status to become known


class MultiprocExecutor:
    cause: str | None = None              # once dead: stage_died, timeout, link, interrupted or a stop's

    def __init__(self, config, model_dir: str, eos_token_ids: tuple[int, ...], generation: int | None = None,
                 layout: tuple[int, ...] | None = None):
        """Across nodes, `generation` is the pipeline's number if the caller opened it already
        (generations.next_generation), and `layout` the node of each stage (default: the command line's)."""
        self.config, self.timeout = config, config.dist_timeout_s
        self.layout = layout or default_layout(config.pp_size, config.nnodes)
        self.local_stages = stages_of(self.layout, 0)
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
        addr = env["addr"] if env else config.master_addr
        port = env["port"] if env else (config.master_port or free_port())
        wait_s = max(self.timeout, 300.0)
        try:
            # NOTE: across nodes every pipeline is a new generation of the same store (generations.py)
            self.generation = None
            if config.nnodes > 1 and not env:
                self.generation = generation or next_generation(addr, port, config.pp_size + 1, wait_s)
                publish_layout(addr, port, self.generation, self.layout)
            if not env:
                self.procs = spawn_stages(config, model_dir, 0, addr, port, eos_token_ids, models,
                                          generation=self.generation, stages=self.local_stages)
            init_group(DRIVER_RANK, config.pp_size + 1, addr, port, wait_s, self.generation,
                       control_store(addr, port) if self.generation else None)
            self.memory_plans, load_s = self._await_ready()
        except Exception as exc:     # noqa: BLE001  (any start-up failure: one sentence, nothing left running)
            self._kill_all()
            destroy_group()
            raise EngineDeadError(f"The pipeline failed to start: {exc}") from None
        self.num_blocks = min(p.num_blocks for p in self.memory_plans)
        total = time.monotonic() - t0
        self.startup = {"spawn_s": max(0.0, total - load_s), "load_s": load_s, "total_s": total}
        threading.Thread(target=self._monitor, daemon=True, name="stagewise-monitor").start()
        threading.Thread(target=self._heartbeat, daemon=True, name="stagewise-heartbeat").start()

    def _await_ready(self) -> tuple[list, float]:
        """Every stage's memory plan, and the longest weight load (the stages load in parallel)."""
        plans, load_s = [], 0.0
        for s in range(self.config.pp_size):
            # NOTE: polled, so Ctrl-C reaches a user's script while the stages load their weights.
            msg = recv_message(stage_rank(s), max(self.timeout, 600.0), poll_s=0.05)
            if "error" in msg.obj:
                raise RuntimeError(msg.obj["error"])
            plans.append(msg.obj["memory_plan"])
            load_s = max(load_s, msg.obj.get("load_s", 0.0))
        return plans, load_s

    # the links
    def submit(self, plan: StepPlan) -> None:
        self._check()
        with self.lock:
            self._send(Message("plan", plan))
            self.num_inflight += 1

    def collect(self) -> StepResult:
        self._check()
        with self.lock:
            msg = self._recv()
            self.num_inflight -= 1
        return msg.obj

    def _send(self, msg: Message) -> None:
        try:
            while len(self.pending) > 2 * self.config.pp_size:
                self.pending.popleft().wait(self.timeout)
            self.pending.append(send_message(msg, stage_rank(0)))
        except Exception as exc:     # noqa: BLE001  (gloo raises RuntimeError for anything: the link is gone)
            self._fail(self.dead or self._link_failure(0, "sending to", exc))
        except BaseException:
            self._interrupted()
            raise
        self.last_traffic = time.monotonic()

    def _recv(self) -> Message:
        last = self.config.pp_size - 1
        try:
            msg = recv_message(stage_rank(last), self.timeout)
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
        NOTE: gloo's own text (a source path inside the torch build) goes to the log, not to people."""
        where = self._where(stage)
        log.error("%s %s failed: %s", doing, where, exc)
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            self.cause = self.cause or "timeout"
            return f"no answer from {where} within {self.timeout:.0f} s; a stage is stuck or unreachable."
        self.cause = self.cause or "link"
        return f"{doing} {where} failed: the link closed; a stage process died or lost its connection{self._hint()}."

    def _hint(self) -> str:
        return " (see the other nodes' logs)" if self.config.nnodes > 1 else ""

    def _death_message(self, p) -> str:
        """Why a local stage process ended. Exit code 1 is a stage that stopped because a link to a
        neighbour failed: the cause is that neighbour (on another node, when there are several)."""
        where = self._where(self.local_stages[self.procs.index(p)])
        if p.exitcode == 1:
            return (f"{where} stopped because its link to a neighbouring stage failed; a stage "
                    f"{'on another node ' if self.config.nnodes > 1 else ''}died or became unreachable{self._hint()}.")
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

    def _fail(self, why: str):
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
                    self._send(Message("heartbeat"))
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
        """Stop every stage in order (or, once dead, kill them) and leave the process group."""
        if self.closing:
            return
        self.closing = True
        if self.dead:
            self._kill_all()        # NOTE: a stopped (SIGSTOP) or stuck stage never exits by itself
        if not self.dead:
            with self.lock:
                try:
                    self._send(Message("shutdown"))
                    while self._recv().kind != "shutdown":   # results of abandoned plans
                        pass
                    while self.pending:
                        self.pending.popleft().wait(self.timeout)
                except EngineDeadError:
                    pass
        destroy_group()
        for p in self.procs:
            p.join(timeout=10)
        self._kill_all()
