"""Continuous batching with chunked prefill, prefix caching, preemption and in-flight tracking.

The scheduler owns every request transition, for one stage and for many: `add` (waiting),
`schedule` (booked into a plan; `num_computed_tokens` advances at schedule time, so with
several plans in flight a request is never booked twice, except for consecutive non-final
prefill chunks, which need no sampled token), `update` (the oldest plan came back: tokens
applied, or the plan or one of its rows failed), `finish` (stopped, length, aborted, failed)
and `_release` (blocks freed: at once, or when the request's last in-flight plan returns).
Preemption (recompute) only picks idle requests.
"""
from __future__ import annotations

from collections import deque

from ..plan import CachedRequestData, NewRequestData, ScheduledSeq, StepPlan, StepResult
from ..request import FinishReason, Request, RequestStatus
from .block_manager import BlockManager


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, token_budget: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.requests: dict[str, Request] = {}      # unfinished requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.inflight: dict[str, int] = {}          # request_id -> plans in flight
        self.awaiting_token: set[str] = set()       # a sampling row of it is in flight
        self.stage_known: set[str] = set()          # requests the stages hold state for
        self.pending_tokens: dict[str, list[int]] = {}   # deltas not yet sent to the stages
        self.pending_blocks: dict[str, list[int]] = {}
        self.to_forget: list[str] = []              # finished ids to drop from stage caches
        self.zombies: dict[str, Request] = {}       # finished while in flight: free later
        self.next_plan_id = 0
        self.num_preemptions = 0

    # queue management
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def is_idle(self, req: Request) -> bool:
        return req.request_id not in self.inflight

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """Mark finished and release its blocks now, or once its in-flight plans return."""
        req.status, req.finish_reason, req.error = RequestStatus.FINISHED, reason, error
        self.requests.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.is_idle(req):
            self._release(req)
        else:
            self.zombies[req.request_id] = req

    def _release(self, req: Request) -> None:
        self.blocks.free_request(req)
        self.pending_tokens.pop(req.request_id, None)
        self.pending_blocks.pop(req.request_id, None)
        if req.request_id in self.stage_known:
            self.stage_known.discard(req.request_id)
            self.to_forget.append(req.request_id)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self._release(victim)
        victim.status, victim.num_computed_tokens = RequestStatus.WAITING, 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    # scheduling
    def schedule(self) -> StepPlan | None:
        budget, plan = self.token_budget, StepPlan(plan_id=self.next_plan_id, seqs=[])
        for req in list(self.running):
            if budget <= 0:
                break
            if req.request_id in self.awaiting_token or req not in self.running:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n > 0 and self._grow_or_preempt(plan, req, n):
                self._book(plan, req, n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not req.block_ids:
                req.num_computed_tokens = req.num_cached_tokens = self.blocks.match_prefix(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new = self.blocks.allocate(req, req.num_computed_tokens + n)
            if new is None:
                if not self.running and not self.inflight and not plan.seqs:
                    self.blocks.free_request(req)
                    raise MemoryError(f"Request {req.request_id} needs more KV blocks than the cache holds.")
                break
            self.waiting.popleft()
            self._zero_tail(plan, new)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._book(plan, req, n)
            budget -= n
        if not plan.seqs:
            return None
        self.next_plan_id += 1
        plan.finished_req_ids, self.to_forget = self.to_forget, []
        return plan

    @staticmethod
    def _zero_tail(plan: StepPlan, new_blocks: list[int]) -> None:
        """The last new block is only partly written by this step, and attention reads whole blocks
        (masked); stages zero it first so stale values there (NaN from a failed request) cannot leak."""
        if new_blocks:
            plan.zero_block_ids.append(new_blocks[-1])

    def _grow_or_preempt(self, plan: StepPlan, req: Request, n: int) -> bool:
        while True:
            new = self.blocks.allocate(req, req.num_computed_tokens + n)
            if new is not None:
                self._zero_tail(plan, new)
                self.pending_blocks.setdefault(req.request_id, []).extend(new)
                return True
            victims = [r for r in reversed(self.running) if r is not req and self.is_idle(r)]
            if not victims:
                return False
            self._preempt(victims[0])

    def _book(self, plan: StepPlan, req: Request, n: int) -> None:
        rid, start = req.request_id, req.num_computed_tokens
        sample = start + n == req.num_tokens
        plan.seqs.append(ScheduledSeq(rid, start, n, sample))
        if rid in self.stage_known:
            plan.cached_reqs.append(CachedRequestData(
                rid, self.pending_tokens.pop(rid, []), self.pending_blocks.pop(rid, [])))
        else:
            self.stage_known.add(rid)
            self.pending_tokens.pop(rid, None)
            self.pending_blocks.pop(rid, None)
            # NOTE: an embedding prompt has no ids; its positions hold placeholder 0s.
            ids = req.all_token_ids if req.input_embeds is None else [0] * req.num_prompt_tokens + req.output_token_ids
            plan.new_reqs.append(NewRequestData(rid, ids, req.num_prompt_tokens, req.params,
                                                list(req.block_ids), req.input_embeds))
        req.num_computed_tokens += n
        self.inflight[rid] = self.inflight.get(rid, 0) + 1
        if sample:
            self.awaiting_token.add(rid)

    # results
    def update(self, plan: StepPlan, result: StepResult) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The oldest plan came back. Returns the requests that got a token and the requests that
        failed with it (the whole plan, or their own row); the caller finishes the failed ones."""
        got_token, failed = [], []
        for seq in plan.seqs:
            req = self._settle(seq)
            if req is None:
                continue
            why = result.error or result.failed.get(seq.request_id)
            if why:
                failed.append((req, why))
                continue
            self.blocks.register_full_blocks(req, seq.start + seq.num_tokens)
            if seq.request_id in result.prompt_logprobs:
                _extend_prompt_logprobs(req, *result.prompt_logprobs[seq.request_id])
            if seq.sample and seq.request_id in result.sampled and req.params.max_tokens == 0:
                got_token.append(req)            # scoring only: the prompt is done, nothing is generated
            elif seq.sample and seq.request_id in result.sampled:
                token = result.sampled[seq.request_id]
                req.output_token_ids.append(token)
                if seq.request_id in result.logprobs:
                    req.output_logprobs.append(result.logprobs[seq.request_id])
                self.pending_tokens.setdefault(seq.request_id, []).append(token)
                got_token.append(req)
        return got_token, failed

    def _settle(self, seq: ScheduledSeq) -> Request | None:
        """One row of a returned plan leaves flight; a request finished meanwhile is released once
        idle. Returns the request if it is still unfinished."""
        rid = seq.request_id
        self.inflight[rid] -= 1
        if self.inflight[rid] == 0:
            del self.inflight[rid]
        if seq.sample:
            self.awaiting_token.discard(rid)
        zombie = self.zombies.get(rid)
        if zombie is not None:
            if self.is_idle(zombie):
                self._release(self.zombies.pop(rid))
            return None
        return self.requests.get(rid)


def _extend_prompt_logprobs(req: Request, first: int, entries: list) -> None:
    """Append the entries for prompt tokens not recorded yet (a preempted request recomputes its
    prompt, and its entries must not repeat)."""
    for k, entry in enumerate(entries):
        if first + k == len(req.prompt_logprobs):
            req.prompt_logprobs.append(entry)
