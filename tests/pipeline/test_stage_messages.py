"""A stage's outgoing message owns its rows: the next replay overwriting graph memory cannot
change a proxy that is still being sent."""
import torch

from stagewise.executor.messages import PlanMsg
from stagewise.executor.stage_proc import _handle
from stagewise.parallel.partition import stage_infos
from stagewise.parallel.proxy import ProxyTensors
from stagewise.plan import ScheduledSeq, StepPlan


class GraphMemoryWorker:
    """Returns views of one static buffer, as a graph runner does."""

    def __init__(self):
        self.buffer = torch.zeros(8, 4)   # [max_tokens, H]
        self.busy_s, self.comm_s, self.device = 0.0, 0.0, torch.device("cpu")

    def execute(self, plan, proxy):
        self.buffer[:3] = float(plan.plan_id + 1)
        return ProxyTensors({"hidden_states": self.buffer[:3]})


def test_sent_proxy_survives_the_next_replay():
    worker, stage = GraphMemoryWorker(), stage_infos(4, 2)[0]
    plan = StepPlan(plan_id=0, seqs=[ScheduledSeq("a", 0, 3, True)])
    first = _handle(worker, stage, PlanMsg(plan))
    _handle(worker, stage, PlanMsg(StepPlan(plan_id=1, seqs=plan.seqs)))   # overwrites the buffer
    assert torch.equal(first.proxy["hidden_states"], torch.ones(3, 4))
    assert first.plan.plan_id == 0 and first.plan.stage_busy_s == [0.0]
