"""LocalExecutor: the single stage runs in the driver's process; a plan runs as it is submitted.
Intra-op threads are the stage's business (runtime.setup.intra_op_threads)."""
from __future__ import annotations

from collections import deque

from ..checkpoint.facts import read_facts
from ..kvcache.pages import StagePages, before_plan, finish_result, pages_only
from ..parallel.partition import StageInfo
from ..plan import StepPlan, StepResult
from ..runtime.worker import Worker


class LocalExecutor:
    def __init__(self, config, model_dir: str, eos_token_ids: tuple[int, ...]):
        stage = StageInfo.single(read_facts(model_dir).num_layers)
        self.worker = Worker(config, model_dir, stage, eos_token_ids)
        self.stage = stage
        self.pages = StagePages.open(config, model_dir, stage, self.worker)
        self.memory_plans = [self.worker.memory_plan]
        self.num_blocks = self.worker.num_blocks
        self.results: deque[StepResult] = deque()
        self.dead: str | None = None
        self.cause: str | None = None
        self.startup: dict[str, float] = {}
        self.generation: int | None = None
        self.layout: tuple[int, ...] = (0,)
        self.partition: tuple[int, ...] = (stage.num_layers,)
        from ..kernels.report import announce
        self.kernels = announce(self.worker.model, self.worker.device, 0)     # logged once: which kernels run

    def submit(self, plan: StepPlan) -> None:
        before_plan(self.pages, plan, failed=False)          # the disk tier's page work (kvcache/pages.py)
        result = self.worker.execute(plan, None) if plan.seqs else pages_only(self.worker, self.stage, plan)
        assert isinstance(result, StepResult), "a single stage is the last stage: it returns a StepResult"
        self.results.append(finish_result(result, plan))

    def collect(self) -> StepResult:
        result = self.results.popleft()
        result.stage_busy_s = [self.worker.busy_s]
        return result

    def stop(self, why: str, cause: str) -> None:
        self.dead, self.cause = self.dead or why, self.cause or cause

    def shutdown(self) -> None:
        self.results.clear()
        if self.pages is not None:
            self.pages.flush()
