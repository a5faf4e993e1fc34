"""Executors run step plans on the stages: in this process (one stage) or in stage processes.

Both implement `Executor`. A plan that fails on a stage comes back as a `StepResult` with
`error` set (the worker catches it), so the engine treats one and several stages alike;
`collect` raises `EngineDeadError` only when the executor itself cannot go on.
"""
from __future__ import annotations

from typing import Protocol

from ..plan import StepPlan, StepResult


class Executor(Protocol):
    """Everything the engine and the pipeline supervisor (recovery/) use of an executor."""
    num_blocks: int              # KV blocks every stage can hold (the smallest stage's pool)
    memory_plans: list           # one planning.memory.MemoryPlan per stage
    dead: str | None             # why the executor stopped working, once it has
    cause: str | None            # what kind of fault stopped it: stage_died, timeout, link, ... (recovery counts)
    startup: dict[str, float]    # seconds of its start: spawn_s, load_s, total_s, stage_cpu_s (none for one process)
    generation: int | None       # across nodes, the pipeline's generation in the cluster's store
    layout: tuple[int, ...]      # the node of each stage
    partition: tuple[int, ...]   # the layers of each stage
    kernels: list                # which kernels each stage runs (kernels.report.KernelInfo), from its start

    def submit(self, plan: StepPlan) -> None: ...
    def collect(self) -> StepResult: ...          # the oldest submitted plan's result (FIFO)
    def stop(self, why: str, cause: str) -> None: ...   # end it on purpose; the supervisor rebuilds it
    def shutdown(self) -> None: ...


def make_executor(config, model_dir: str, eos_token_ids: tuple[int, ...], **placement) -> Executor:
    """`placement`: a multi-node pipeline's `generation` and `layout` (MultiprocExecutor)."""
    if config.parallel.tp_size > 1:
        from .tp_ranks import check_tp
        check_tp(config, model_dir)
    if config.parallel.pp_size == 1 and config.parallel.tp_size == 1:
        from .local import LocalExecutor
        return LocalExecutor(config, model_dir, eos_token_ids)
    from .multiproc import MultiprocExecutor
    return MultiprocExecutor(config, model_dir, eos_token_ids, **placement)
