"""The driver's guards against a pipeline that answers wrongly: results must come back in plan
order, and a plan that failed on a stage fails only its own requests."""
from collections import deque

import pytest

from stagewise import LLM, SamplingParams
from stagewise.errors import EngineDeadError


class SwappingExecutor:
    """Wraps the real executor; hands back the second result before the first."""

    def __init__(self, inner):
        self.inner, self.held = inner, deque()
        self.memory_plans, self.num_blocks = inner.memory_plans, inner.num_blocks

    def __getattr__(self, name):          # the rest of the executor's surface: the real one's
        return getattr(self.inner, name)

    def submit(self, plan):
        self.inner.submit(plan)

    def collect(self):
        while len(self.held) < 2 and self.inner.results:
            self.held.append(self.inner.collect())
        return self.held.pop() if len(self.held) == 2 else self.held.popleft()

    def shutdown(self):
        self.inner.shutdown()


def test_out_of_order_results_are_fatal_not_misapplied(llama_dir):
    llm = LLM(model=str(llama_dir), pp_depth=2, chunked_prefill_size=3)   # one prompt per plan
    llm.engine.supervisor.executor = SwappingExecutor(llm.engine.executor)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with pytest.raises(EngineDeadError, match="out of order") as info:
        llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9, 10]], sampling_params=params, use_tqdm=False)
    assert {o.outputs[0].finish_reason for o in info.value.outputs} == {"error"}
    assert all(not o.outputs[0].token_ids for o in info.value.outputs)   # no token went to a wrong request


def test_failed_plan_fails_only_its_requests(llama_dir, monkeypatch):
    llm = LLM(model=str(llama_dir), max_num_seqs=1)      # one request per plan
    worker = llm.engine.executor.worker
    real = worker.execute

    def flaky(plan, proxy):
        result = real(plan, proxy)
        if any(s.request_id == llm_bad[0] for s in plan.seqs):
            result.sampled.clear()
            result.error = "stage 0 failed: injected"
        return result

    llm_bad = []
    monkeypatch.setattr(worker, "execute", flaky)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    bad = llm.engine.add_request(prompt_token_ids=[1, 2, 3], params=params)
    llm_bad.append(bad.request_id)
    outs = llm.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=params, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3
    assert bad.finish_reason.value == "error" and "injected" in bad.error
