"""StepPlan and StepResult: the only objects that cross processes.

The driver sends a plan per step; every stage applies it to its own per-request cache.
Running requests travel as deltas (tokens sampled since the stage last saw them, new
blocks); a new or resumed request travels whole once. The last stage answers a StepResult.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .request import SamplingParams, TokenLogprob


@dataclass
class NewRequestData:
    """A request a stage has not seen (or must forget and restart: preemption)."""

    request_id: str
    token_ids: list[int]                # every known token (prompt, plus outputs when resumed)
    num_prompt_tokens: int              # the original prompt length (penalties, seeds)
    params: SamplingParams
    block_ids: list[int]
    input_embeds: Any = None            # torch.Tensor [P, H] for embedding prompts; first stage only


@dataclass
class CachedRequestData:
    """A delta for a request the stages already hold."""

    request_id: str
    new_token_ids: list[int]            # sampled since this request's last plan
    new_block_ids: list[int]
    num_kept_blocks: int | None = None  # drop the table past this many blocks first (unused draft blocks)


@dataclass
class ScheduledSeq:
    """One request's share of a step: `num_tokens` tokens starting at position `start`."""

    request_id: str
    start: int
    num_tokens: int                     # drafts included
    sample: bool                        # False for non-final prefill chunks
    # proposed tokens after the known ones: the last len+1 rows are verified (engine/speculative.py)
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class TokenBitmask:
    """Allowed next tokens of the constrained sampling rows of a plan, filled by the driver: row i of
    `bits` (int32 `[k, ceil(V/32)]`, bit t set = token t allowed) belongs to `request_ids[i]`.
    Rows without a grammar have no entry: they pay nothing."""

    request_ids: list[str]
    bits: Any


@dataclass
class KVPages:
    """KV blocks and the prefix-cache digests (hex) of the full blocks they hold: pages the stages
    copy to their disk tier, or read from it into these blocks (docs/kv-cache.md)."""

    block_ids: list[int] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)


@dataclass
class StepPlan:
    plan_id: int
    seqs: list[ScheduledSeq]
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    zero_block_ids: list[int] = field(default_factory=list)   # KV blocks stages zero before this step
    verdict: Any = None                 # graph.policy.GraphVerdict, decided once by the driver
    stage_busy_s: list[float] = field(default_factory=list)   # filled in by stages on the way
    stage_comm_s: list[float] = field(default_factory=list)   # likewise: tensor-parallel collective seconds
    token_bitmask: TokenBitmask | None = None     # constrained rows (structured outputs); the sampling stage reads it
    # the prefix cache's disk tier: blocks each stage copies out to its pages before this step runs,
    # and per request the pages to read into its blocks first (the request has no rows in this plan)
    kv_saves: KVPages | None = None
    kv_loads: dict[str, KVPages] = field(default_factory=dict)
    kv_loaded: dict[str, int] = field(default_factory=dict)   # filled by stages: pages every stage read, per request
    kv_tier: list[list[int]] = field(default_factory=list)     # filled by stages: each one's tier counters
    # the LoRA adapters ({name: path}) every stage holds from this plan on, when they changed (runtime
    # loads and unloads, a rebuilt pipeline); None: as before. Before this plan's rows run
    loras: dict[str, str] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def without_embeds(self) -> "StepPlan":
        """The plan as later stages need it: input embeddings are the first stage's business."""
        if not any(r.input_embeds is not None for r in self.new_reqs):
            return self
        # NOTE: an empty tensor keeps "this prompt was embeddings" visible to later stages.
        reqs = [NewRequestData(r.request_id, r.token_ids, r.num_prompt_tokens, r.params, r.block_ids,
                               None if r.input_embeds is None else r.input_embeds[:0])
                for r in self.new_reqs]
        return replace(self, new_reqs=reqs)


@dataclass
class PlanFailed:
    """A non-last stage's answer to a plan that failed there or upstream: later stages only
    apply its deltas, and the last stage answers `StepResult(error=why)`."""
    why: str


@dataclass
class StepResult:
    plan_id: int
    sampled: dict[str, int] = field(default_factory=dict)          # request_id -> token id
    # request_id -> accepted drafts, which come before its sampled token (speculative rows only)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)           # request_id -> why (that request only)
    # request_id -> (index of the first prompt token covered, its logprobs and the next ones')
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # request_id -> its prompt's pooled, normalised last hidden state (SamplingParams.embed, its final chunk)
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    error: str | None = None                                       # a stage failed the whole plan
    stage_busy_s: list[float] = field(default_factory=list)        # compute seconds per stage
    stage_comm_s: list[float] = field(default_factory=list)        # of which in tensor-parallel collectives
    kv_loaded: dict[str, int] = field(default_factory=dict)        # the plan's: pages every stage read, per request
    kv_tier: list[list[int]] = field(default_factory=list)         # each stage's disk-tier counters
