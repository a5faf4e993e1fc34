"""The bookkeeping behind pipeline recovery, without processes: the sliding-window restart budget,
the poison-plan rule (one request that crashes the pipeline fails alone, whether it arrived alone
or with others) and the scheduler's requeue of every live request after a rebuild."""
from __future__ import annotations

from types import SimpleNamespace

from stagewise.engine.scheduler import Scheduler
from stagewise.kvcache.block_manager import BlockManager
from stagewise.recovery import rules as recovery
from stagewise.recovery.rules import RestartBudget, Suspects
from stagewise.request import Request, RequestStatus, SamplingParams


def _req(rid: str, outputs: int = 0):
    return SimpleNamespace(request_id=rid, output_token_ids=[1] * outputs)


def test_the_restart_budget_slides(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(recovery.time, "monotonic", lambda: now[0])
    budget = RestartBudget(2, 60.0)
    assert budget.take() and budget.take() and not budget.take()
    assert "--max-pipeline-restarts 2" in budget.refusal("stage 1 died.")
    now[0] += 61
    assert budget.take()
    assert not RestartBudget(0, 60.0).take()


def _run(suspects: Suspects, in_flight: list, live: list) -> dict:
    """A crash with `in_flight` requests in flight, then the rebuild's regrouping of the live ones."""
    poisoned = suspects.crash(in_flight)
    suspects.regroup([r for r in live if r.request_id not in poisoned])
    return poisoned


def test_a_poison_request_joining_a_running_batch_fails_at_its_second_crash():
    decoding = [_req(f"d{i}", outputs=5) for i in range(4)]
    poison = _req("p")
    s = Suspects()
    assert _run(s, [*decoding, poison], [*decoding, poison]) == {}
    # the requests that had generated tokens are recomputed first, the new one waits for them
    assert all(s.may_admit(r) for r in decoding) and not s.may_admit(poison)
    s.cleared(r.request_id for r in decoding)            # their recompute plan came back
    assert s.may_admit(poison)
    assert _run(s, [poison, *decoding], [poison, *decoding]) == {"p": 2}     # the only suspect in flight


def test_a_poison_request_that_arrived_with_others_is_isolated_then_fails_alone():
    batch = [_req("p"), _req("a"), _req("b")]
    s = Suspects()
    assert _run(s, batch, batch) == {}
    assert _run(s, batch, batch) == {}                   # three suspects together: not yet known
    assert [s.may_admit(r) for r in batch] == [True, False, False]     # one at a time now
    assert _run(s, [batch[0]], batch) == {"p": 3}
    assert s.may_admit(batch[1]) and not s.may_admit(batch[2])
    s.cleared(["a"])
    assert s.may_admit(batch[2])


def test_restart_requeues_every_live_request_for_recompute():
    blocks = BlockManager(64, 4)
    sched = Scheduler(blocks, max_num_seqs=8, token_budget=64)
    reqs = [Request(f"r{i}", [5, 6, 7, 8, 9], SamplingParams(max_tokens=10)) for i in range(3)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert plan is not None and len(plan.seqs) == 3
    reqs[0].output_token_ids.append(42)
    sched.abort("r2")                                     # finished while its plan was in flight
    old_blocks = sched.blocks
    assert sched.restart(48) == 2
    assert sched.blocks is not old_blocks and sched.blocks.num_blocks == 48
    assert not sched.running and list(sched.waiting) == reqs[:2]
    assert all(r.status is RequestStatus.WAITING and r.num_computed_tokens == 0 and not r.block_ids
               for r in reqs[:2])
    assert "r2" not in sched.records
    again = sched.schedule()
    assert [s.request_id for s in again.seqs] == ["r0", "r1"]
    assert again.new_reqs[0].token_ids == [5, 6, 7, 8, 9, 42]     # prompt + output so far
