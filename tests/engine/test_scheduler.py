"""Scheduler and block manager without a model: booking rules, prefix cache, preemption,
and the in-flight invariant under random pipeline delays."""
import random

from stagewise.engine.scheduler import Scheduler
from stagewise.kvcache.block_manager import BlockManager
from stagewise.plan import StepResult
from stagewise.request import FinishReason, Request, SamplingParams


def make_req(rid, n_prompt, max_tokens=4, start=0):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0))


def fake_result(plan, token=7):
    return StepResult(plan.plan_id, sampled={s.request_id: token for s in plan.seqs if s.sample})


def test_block_zero_is_reserved_and_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    r = make_req("a", 10)
    assert bm.allocate(r, 10) == [1, 2, 3]
    r2 = make_req("b", 2)
    assert bm.allocate(r2, 2) is None and r2.block_ids == []
    bm.free_request(r)
    assert len(bm.free) == 3


def test_prefix_cache_hits_only_after_registration_and_leaves_one_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_req("a", 8)
    bm.allocate(a, 8)
    b = make_req("b", 8)
    assert bm.match_prefix(b) == 0          # nothing registered yet
    bm.register_full_blocks(a, 8)
    c = make_req("c", 8)
    assert bm.match_prefix(c) == 4          # 8 tokens: the last block is recomputed (one token must run)
    assert c.block_ids == a.block_ids[:1]
    d = make_req("d", 9)
    assert bm.match_prefix(d) == 8
    bm.free_request(a)
    bm.free_request(c)
    bm.free_request(d)
    e = make_req("e", 9)
    assert bm.match_prefix(e) == 8          # freed blocks stay findable until reused


def test_chunked_prefill_then_decode_and_budget():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, token_budget=5)
    s.add(make_req("a", 12))
    reqs = {"a": s.waiting[0]}
    starts = []
    while True:
        plan = s.schedule()
        if plan is None:
            break
        assert plan.num_tokens <= 5
        starts.append((plan.seqs[0].start, plan.seqs[0].num_tokens, plan.seqs[0].sample))
        s.update(plan, fake_result(plan))
        if len(reqs["a"].output_token_ids) == 2:
            break
    assert starts[:4] == [(0, 5, False), (5, 5, False), (10, 2, True), (12, 1, True)]


def test_preemption_picks_idle_requests_and_resumes_from_scratch():
    s = Scheduler(BlockManager(5, 4), max_num_seqs=4, token_budget=64)   # 4 usable blocks
    a, b = make_req("a", 7, max_tokens=8), make_req("b", 7, max_tokens=8, start=100)
    s.add(a), s.add(b)
    for _ in range(12):
        plan = s.schedule()
        if plan is None:
            break
        s.update(plan, fake_result(plan))
    assert s.num_preemptions >= 1
    assert any(r.num_preemptions for r in (a, b))


def test_no_double_booking_with_random_pipeline_delays():
    rng = random.Random(0)
    s = Scheduler(BlockManager(40, 4), max_num_seqs=6, token_budget=9, stop_rule=_length)
    reqs = {}
    for i in range(10):
        r = make_req(f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 6), start=i * 50)
        reqs[r.request_id] = r
        s.add(r)
    inflight = []
    for _ in range(2000):
        while len(inflight) < 3 and (plan := s.schedule()) is not None:
            _check_invariant(inflight + [plan])
            inflight.append(plan)
        if not inflight:
            break
        if rng.random() < 0.5 and len(inflight) < 3 and (s.waiting or s.running):
            continue
        plan = inflight.pop(0)
        for req in s.update(plan, fake_result(plan, rng.randrange(1000))):
            if req.is_finished:
                del reqs[req.request_id]
    assert not reqs and not s.records and len(s.blocks.free) == 39


def _length(req):
    return FinishReason.LENGTH if len(req.output_token_ids) >= req.params.max_tokens else None


def _check_invariant(plans):
    """A request may be in several in-flight plans only as consecutive non-final chunks."""
    seen = {}
    for plan in plans:
        for seq in plan.seqs:
            prev = seen.get(seq.request_id)
            if prev is not None:
                assert not prev.sample, f"{seq.request_id} booked again while its token is in flight"
                assert seq.start == prev.start + prev.num_tokens
            seen[seq.request_id] = seq


def test_abort_in_flight_defers_block_free():
    s = Scheduler(BlockManager(8, 4), max_num_seqs=4, token_budget=64)
    a = make_req("a", 8)
    s.add(a)
    plan = s.schedule()
    held = list(a.block_ids)
    assert s.abort("a") is a and a.finish_reason is FinishReason.ABORT
    assert a.block_ids == held and len(s.blocks.free) == 7 - len(held)   # still owned by the plan
    b = make_req("b", 20, start=500)
    s.add(b)
    plan_b = s.schedule()
    assert not set(b.block_ids) & set(held)
    assert s.update(plan, fake_result(plan)) == []                            # late result discarded
    assert a.block_ids == [] and plan_b is not None


def test_every_finish_happens_in_update_and_frees_the_record():
    """Stop rule, a failed row and an abort all finish through the scheduler; finished requests
    leave no record behind once idle."""
    s = Scheduler(BlockManager(32, 4), max_num_seqs=4, token_budget=64,
                  stop_rule=lambda r: FinishReason.STOP if r.output_token_ids[-1] == 9 else None)
    a, b, c = make_req("a", 5), make_req("b", 5, start=100), make_req("c", 5, start=200)
    for r in (a, b, c):
        s.add(r)
    plan = s.schedule()
    result = StepResult(plan.plan_id, sampled={"a": 9, "b": 7, "c": 7}, failed={"b": "row b failed"})
    changed = s.update(plan, result)
    assert {r.request_id for r in changed} == {"a", "b", "c"}
    assert (a.finish_reason, b.finish_reason, b.error) == (FinishReason.STOP, FinishReason.ERROR, "row b failed")
    assert not c.is_finished and s.abort("c") is c and s.abort("c") is None
    assert s.records == {} and len(s.blocks.free) == 31 and s.requests == {}
