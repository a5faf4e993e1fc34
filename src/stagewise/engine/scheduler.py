"""Continuous batching with chunked prefill, prefix caching, preemption and in-flight tracking.

The scheduler owns every request transition, for one stage and for many: `add` (waiting),
`schedule` (booked into a plan; `num_computed_tokens` advances at schedule time, so with
several plans in flight a request is never booked twice, except for consecutive non-final
prefill chunks, which need no sampled token), `update` (the oldest plan came back: tokens
applied and stop rules checked, or the plan or one of its rows failed), `abort` and `fail_all`.
Every finish (stop, length, abort, error) goes through `_finish`; a request's blocks are freed
at once, or when its last in-flight plan returns. Preemption (recompute) only picks idle requests.

Each request has one `InFlight` record from `add` until its blocks are released. A waiting
request starts only when every admission rule lets it (its grammar is compiled; after a pipeline
rebuild, no earlier suspect is unconfirmed).

With a speculator, a running request's step may carry drafts (booked as extra rows against the
token budget, counted as computed only once accepted); `_apply_tokens` applies the accepted ones
and the sampled one, one token at a time through the stop rule, and the unused draft blocks go back.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..kvcache.block_manager import BlockManager
from ..plan import CachedRequestData, KVPages, NewRequestData, ScheduledSeq, StepPlan, StepResult
from ..request import FinishReason, Request, RequestStatus, TokenLogprob
from .balance import DecodeBalancer, FixedChunks
from .speculative import Proposer

StopRule = Callable[[Request], "FinishReason | None"]     # after a new token: finished, and why?


@dataclass
class InFlight:
    """The scheduler's state of one request beyond the request itself."""
    req: Request
    num_plans: int = 0                    # plans in flight with a row of it
    awaiting_token: bool = False          # a sampling row of it is in flight
    stage_known: bool = False             # the stages hold state for it
    pending_tokens: list[int] = field(default_factory=list)   # deltas not yet sent to the stages
    pending_blocks: list[int] = field(default_factory=list)
    pending_kept_blocks: int | None = None   # the stages drop their table past this many blocks

    @property
    def is_idle(self) -> bool:
        return self.num_plans == 0


def _no_stop(req: Request) -> FinishReason | None:
    return None


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, token_budget: int, stop_rule: StopRule = _no_stop,
                 speculator: Proposer | None = None):
        self.blocks = blocks
        self.speculator = speculator
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.stop_rule = stop_rule
        self.records: dict[str, InFlight] = {}      # every request not yet released, finished ones too
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.to_forget: list[str] = []              # released ids to drop from stage caches
        self.next_plan_id = 0
        self.num_preemptions = 0
        # chunked pipeline prefill: chunks booked while an earlier chunk of their prompt was in flight,
        # and the most plans one request had in flight at once
        self.num_overlapped_chunks = 0
        self.max_plans_per_request = 0
        self.chunker = FixedChunks()                # a prompt's next chunk length (engine.balance)
        self.balancer = DecodeBalancer()            # decode rows per plan (engine.balance)
        # may this waiting request start now? (its grammar is compiled; no earlier suspect is unconfirmed)
        self.admission_rules: list[Callable[[Request], bool]] = []

    @property
    def requests(self) -> dict[str, Request]:
        """Unfinished requests by id."""
        return {rid: r.req for rid, r in self.records.items() if not r.req.is_finished}

    def has_unfinished(self) -> bool:
        """Requests to run, or pages the stages were not yet asked to save (a plan of its own)."""
        return bool(self.waiting or self.running or self.blocks.pending_saves)

    # queue management
    def add(self, req: Request) -> None:
        self.records[req.request_id] = InFlight(req)
        if req.tenant is None:
            self.waiting.append(req)
        else:
            self.waiting.insert(_fair_place(self.waiting, req.tenant), req)

    def abort(self, request_id: str) -> Request | None:
        """Finish an unfinished request as aborted; returns it (None if unknown or finished)."""
        rec = self.records.get(request_id)
        if rec is None or rec.req.is_finished:
            return None
        self._finish(rec, FinishReason.ABORT)
        return rec.req

    def fail_all(self, why: str) -> list[Request]:
        """Finish every unfinished request with an error (the engine cannot go on)."""
        return self.fail(list(self.requests), why)

    def fail(self, request_ids, why: str) -> list[Request]:
        """Finish these unfinished requests with an error (the rest goes on)."""
        failed = [self.records[rid].req for rid in request_ids
                  if rid in self.records and not self.records[rid].req.is_finished]
        for req in failed:
            self._finish(self.records[req.request_id], FinishReason.ERROR, why)
        return failed

    def restart(self, num_blocks: int) -> int:
        """The pipeline was rebuilt: its stages hold no state and no plan is in flight. Every
        unfinished request waits to be recomputed from its tokens (prompt + output so far), as a
        preempted one is, running ones first, on a new empty cache of at most `num_blocks` blocks
        (the prefix-cache counters carry on). Returns how many."""
        blocks = self.blocks.fresh(min(num_blocks, self.blocks.num_blocks))
        live = [*self.running, *self.waiting]
        for rid, rec in list(self.records.items()):
            rec.num_plans, rec.awaiting_token, rec.stage_known = 0, False, False
            rec.pending_tokens, rec.pending_blocks, rec.pending_kept_blocks = [], [], None
            rec.req.block_ids, rec.req.num_registered_blocks = [], 0
            if rec.req.is_finished:
                del self.records[rid]
                if self.speculator is not None:
                    self.speculator.forget(rid)
        for req in live:
            req.status, req.num_computed_tokens = RequestStatus.WAITING, 0
        self.blocks, self.running, self.waiting, self.to_forget = blocks, [], deque(live), []
        return len(live)

    def _finish(self, rec: InFlight, reason: FinishReason, error: str | None = None) -> None:
        """The one place a request finishes. Its blocks go now, or once its in-flight plans return."""
        req = rec.req
        req.status, req.finish_reason, req.error = RequestStatus.FINISHED, reason, error
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if rec.is_idle:
            self._release(rec)

    def _release(self, rec: InFlight) -> None:
        self.blocks.free_request(rec.req)
        rec.pending_tokens, rec.pending_blocks, rec.pending_kept_blocks = [], [], None
        if rec.stage_known:
            rec.stage_known = False
            self.to_forget.append(rec.req.request_id)
        if rec.req.is_finished:
            del self.records[rec.req.request_id]
            if self.speculator is not None:
                self.speculator.forget(rec.req.request_id)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self._release(self.records[victim.request_id])
        victim.status, victim.num_computed_tokens = RequestStatus.WAITING, 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    # scheduling
    def schedule(self) -> StepPlan | None:
        budget, plan = self.token_budget, StepPlan(plan_id=self.next_plan_id, seqs=[])
        decode_cap = self.balancer.decode_cap(self._num_decoding())
        for req in list(self.running):
            if budget <= 0:
                break
            if self.records[req.request_id].awaiting_token or req not in self.running:
                continue
            if decode_cap is not None and req.num_tokens - req.num_computed_tokens == 1:
                if decode_cap == 0:
                    continue                        # a later plan in flight takes it
                decode_cap -= 1
            n = self._chunk_len(req, budget)
            drafts = self._drafts(req, n, budget - n)
            if n > 0 and self._grow_or_preempt(plan, req, n + len(drafts)):
                self._book(plan, req, n, drafts)
                budget -= n + len(drafts)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if self.admission_rules and not self._admissible_first():
                break
            booked = self._admit(plan, self.waiting[0], budget)
            if booked is None:
                break
            budget -= booked
        plan.kv_saves = self.blocks.take_saves()
        if not plan.seqs and not plan.kv_loads and plan.kv_saves is None:
            return None
        self.next_plan_id += 1
        plan.finished_req_ids, self.to_forget = self.to_forget, []
        return plan

    def _admissible_first(self) -> bool:
        """Bring the first waiting request every admission rule lets start to the front; False if none may."""
        for i, req in enumerate(self.waiting):
            if all(rule(req) for rule in self.admission_rules):
                if i:
                    del self.waiting[i]
                    self.waiting.appendleft(req)
                return True
        return False

    def _chunk_len(self, req: Request, budget: int) -> int:
        """Tokens of `req` to book now: its next prompt chunk (the chunker's choice) or its decode row."""
        return self.chunker.chunk_len(req.num_computed_tokens, req.num_tokens - req.num_computed_tokens, budget)

    def fillable_plans(self, min_rows: int) -> int:
        """How many plans the work at hand could fill: decode requests in groups of `min_rows`, one
        plan per prompt chunk still to book, one per waiting request."""
        chunks = sum(-(-(r.num_tokens - r.num_computed_tokens) // self.token_budget) for r in self.running
                     if r.num_tokens - r.num_computed_tokens > 1)
        return self._num_decoding() // min_rows + chunks + len(self.waiting)

    def _num_decoding(self) -> int:
        """Running requests past their prompt: waiting for a token or about to decode."""
        return sum(1 for r in self.running
                   if self.records[r.request_id].awaiting_token or r.num_tokens - r.num_computed_tokens <= 1)

    def _admit(self, plan: StepPlan, req: Request, budget: int) -> int | None:
        """Move the first waiting request into the plan if its blocks fit; the tokens booked (None:
        not admitted; 0: its disk pages are looked up first)."""
        if not req.block_ids:
            req.num_computed_tokens = req.num_cached_tokens = self.blocks.match_prefix(req)
            if (pages := self.blocks.probe_disk(req)) is not None:
                self._probe(plan, req, pages)
                return 0
        n = self._chunk_len(req, budget)
        new = self.blocks.allocate(req, req.num_computed_tokens + n)
        if new is None:
            if not self.running and not any(r.num_plans for r in self.records.values()) and not plan.seqs:
                self.blocks.free_request(req)
                raise MemoryError(f"Request {req.request_id} needs more KV blocks than the cache holds.")
            return None
        self.waiting.popleft()
        if req.scheduled_time is None:
            req.scheduled_time = time.monotonic()
        self._zero_tail(plan, new)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._book(plan, req, n)
        return n

    def _probe(self, plan: StepPlan, req: Request, pages: KVPages) -> None:
        """The request runs once the stages read what they hold of `pages` (the plan has no rows of it)."""
        self.waiting.popleft()
        if req.scheduled_time is None:
            req.scheduled_time = time.monotonic()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        rec = self.records[req.request_id]
        rec.num_plans += 1
        rec.awaiting_token = True                  # nothing else of it is booked until the pages are read
        plan.kv_loads[req.request_id] = pages

    def _settle_loads(self, plan: StepPlan, result: StepResult) -> None:
        """The stages read the first `kv_loaded` pages of each probed request: those count as cached."""
        for rid, pages in plan.kv_loads.items():
            rec = self.records[rid]
            rec.num_plans -= 1
            rec.awaiting_token = False
            if rec.req.is_finished:
                if rec.is_idle:
                    self._release(rec)
                continue
            num_read = 0 if result.error else result.kv_loaded.get(rid, 0)
            cached = self.blocks.loaded(rec.req, len(pages.block_ids), num_read)
            rec.req.num_computed_tokens = rec.req.num_cached_tokens = cached

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
                self.records[req.request_id].pending_blocks.extend(new)
                return True
            victims = [r for r in reversed(self.running) if r is not req and self.records[r.request_id].is_idle]
            if not victims:
                return False
            self._preempt(victims[0])

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """Proposals for a decode row: one that computes the request's newest token, and only it."""
        # NOTE: an embedding request's one-token prompt looks like a decode row, but it samples nothing
        if (self.speculator is None or n != 1 or req.num_computed_tokens + 1 != req.num_tokens
                or req.params.embed):
            return []
        t0 = time.perf_counter()
        drafts = self.speculator.propose(req, budget)
        self.speculator.stats.propose_s += time.perf_counter() - t0
        # NOTE: drafts never preempt anyone: without free blocks for them the row decodes plainly
        if drafts and self.blocks.blocks_needed(req, req.num_tokens + len(drafts)) > len(self.blocks.free):
            return []
        return drafts

    def _book(self, plan: StepPlan, req: Request, n: int, drafts: list[int] | None = None) -> None:
        """Book `n` known tokens (plus drafts, which count as computed only once accepted)."""
        rec, rid, start = self.records[req.request_id], req.request_id, req.num_computed_tokens
        sample = start + n == req.num_tokens
        drafts = drafts or []
        plan.seqs.append(ScheduledSeq(rid, start, n + len(drafts), sample, drafts))
        if rec.stage_known:
            plan.cached_reqs.append(CachedRequestData(rid, rec.pending_tokens, rec.pending_blocks,
                                                      rec.pending_kept_blocks))
            rec.pending_kept_blocks = None
        else:
            rec.stage_known = True
            # NOTE: an embedding prompt has no ids; its positions hold placeholder 0s.
            ids = req.all_token_ids if req.input_embeds is None else [0] * req.num_prompt_tokens + req.output_token_ids
            plan.new_reqs.append(NewRequestData(rid, ids, req.num_prompt_tokens, req.params,
                                                list(req.block_ids), req.input_embeds))
        rec.pending_tokens, rec.pending_blocks = [], []
        req.num_computed_tokens += n
        if rec.num_plans:            # an earlier chunk of this prompt is still in flight (only chunks may be)
            self.num_overlapped_chunks += 1
        rec.num_plans += 1
        self.max_plans_per_request = max(self.max_plans_per_request, rec.num_plans)
        rec.awaiting_token = rec.awaiting_token or sample

    # results
    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """The oldest plan came back: apply each row's token, check the stop rules, finish what is
        done (or failed, with the whole plan or its own row). Returns every request that changed."""
        changed = []
        self.blocks.observe_tier(result.kv_tier)
        if plan.kv_loads:
            self._settle_loads(plan, result)
        for seq in plan.seqs:
            rec = self._settle(seq)
            if rec is None:
                continue
            why = result.error or result.failed.get(seq.request_id)
            if why:
                self._finish(rec, FinishReason.ERROR, why)
                changed.append(rec.req)
                continue
            if seq.draft_token_ids:
                if seq.request_id in result.sampled:
                    self._apply_tokens(rec, result, seq)
                    changed.append(rec.req)
                continue
            self.blocks.register_full_blocks(rec.req, seq.start + seq.num_tokens)
            if seq.request_id in result.prompt_logprobs:
                _extend_prompt_logprobs(rec.req, *result.prompt_logprobs[seq.request_id])
            if seq.sample and seq.request_id in result.sampled:
                self._apply_token(rec, result, seq.request_id)
                changed.append(rec.req)
            elif seq.sample and seq.request_id in result.embeddings:    # an embedding: the prompt was all
                rec.req.embedding = result.embeddings[seq.request_id]
                rec.req.first_token_time = time.monotonic()
                self._finish(rec, FinishReason.STOP)
                changed.append(rec.req)
        return changed

    def _apply_token(self, rec: InFlight, result: StepResult, rid: str) -> None:
        req = rec.req
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if req.params.max_tokens == 0:            # scoring only: the prompt is done, nothing is generated
            self._finish(rec, FinishReason.LENGTH)
            return
        token = result.sampled[rid]
        req.output_token_ids.append(token)
        if rid in result.logprobs:
            req.output_logprobs.append(result.logprobs[rid])
        rec.pending_tokens.append(token)
        reason = self.stop_rule(req)
        if reason is not None:
            self._finish(rec, reason)

    def _apply_tokens(self, rec: InFlight, result: StepResult, seq: ScheduledSeq) -> None:
        """A verified row: its accepted drafts, then its sampled token, one at a time through the stop
        rule (a stop, EOS or max_tokens inside the run ends it there). Accepted drafts become computed
        tokens; the prefix cache sees only those; blocks held for the rest go back."""
        req, rid = rec.req, seq.request_id
        accepted = result.accepted.get(rid, [])
        # logprobs come for every token or none (the worker fills them when the request asks)
        given = result.accepted_logprobs.get(rid)
        lps: list[TokenLogprob | None] = [*(given if given else [None] * len(accepted)), result.logprobs.get(rid)]
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        reason, num_applied = None, 0
        for token, lp in zip([*accepted, result.sampled[rid]], lps):
            req.output_token_ids.append(token)
            if lp is not None:
                req.output_logprobs.append(lp)
            rec.pending_tokens.append(token)
            num_applied += 1
            reason = self.stop_rule(req)
            if reason is not None:
                break
        if self.speculator is not None:
            self.speculator.record(rid, len(seq.draft_token_ids), len(accepted))
        req.num_computed_tokens += min(num_applied, len(accepted))
        self.blocks.register_full_blocks(req, req.num_computed_tokens)
        if reason is not None:
            self._finish(rec, reason)
            return
        kept = self.blocks.trim(req, req.num_tokens)
        if kept is not None:
            rec.pending_kept_blocks = kept

    def _settle(self, seq: ScheduledSeq) -> InFlight | None:
        """One row of a returned plan leaves flight; a request finished meanwhile is released once
        idle. Returns the record if the request is still unfinished."""
        rec = self.records[seq.request_id]
        rec.num_plans -= 1
        if seq.sample:
            rec.awaiting_token = False
        if rec.req.is_finished:
            if rec.is_idle:
                self._release(rec)
            return None
        return rec


def _extend_prompt_logprobs(req: Request, first: int, entries: list) -> None:
    """Append the entries for prompt tokens not recorded yet (a preempted request recomputes its
    prompt, and its entries must not repeat)."""
    for k, entry in enumerate(entries):
        if first + k == len(req.prompt_logprobs):
            req.prompt_logprobs.append(entry)


def _fair_place(waiting: deque[Request], tenant: int) -> int:
    """Where a tenant's new request joins the waiting queue so tenants with waiting work alternate:
    its k-th waiting request (counting from 0) goes after every tenant's k-th, so one tenant's burst
    (or its `n` choices) cannot stand in front of another tenant's first request. Requests without a
    tenant count as one tenant of their own."""
    rank = sum(1 for r in waiting if r.tenant == tenant)
    seen: dict[int | None, int] = {}
    for i, r in enumerate(waiting):
        seen[r.tenant] = seen.get(r.tenant, 0) + 1
        if seen[r.tenant] > rank + 1:
            return i
    return len(waiting)

