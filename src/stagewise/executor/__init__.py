"""Executors run step plans on the stages: in this process (one stage) or in stage processes.

Both implement `Executor`. A plan that fails on a stage comes back as a `StepResult` with
`error` set (the worker catches it), so the engine treats one and several stages alike;
`collect` raises `EngineDeadError` only when the executor itself cannot go on.
"""
from __future__ import annotations

from typing import Protocol

from ..plan import StepPlan, StepResult


class Executor(Protocol):
    num_blocks: int              # KV blocks every stage can hold (the smallest stage's pool)
    memory_plans: list           # one runtime.memory.MemoryPlan per stage
    dead: str | None             # why the executor stopped working, once it has

    def submit(self, plan: StepPlan) -> None: ...
    def collect(self) -> StepResult: ...          # the oldest submitted plan's result (FIFO)
    def shutdown(self) -> None: ...


def make_executor(config, model_dir: str, eos_token_ids: tuple[int, ...], **placement) -> Executor:
    """`placement`: a multi-node pipeline's `generation` and `layout` (MultiprocExecutor)."""
    if config.tp_size > 1:
        from .tp_ranks import check_tp
        check_tp(config, model_dir)
    if config.pp_size == 1 and config.tp_size == 1:
        from .local import LocalExecutor
        return LocalExecutor(config, model_dir, eos_token_ids)
    from .multiproc import MultiprocExecutor
    return MultiprocExecutor(config, model_dir, eos_token_ids, **placement)
