"""Speculative decoding on the driver: the proposers (n-gram prompt lookup, and a small draft
model of the same tokenizer), their per-request state, adaptive back-off, and the counters
`stats()` reports.

The n-gram proposer looks for the latest earlier occurrence of the sequence's last `prompt_lookup_max`
(down to `prompt_lookup_min`) tokens and proposes the tokens that followed it. Each request keeps
its own index of n-gram -> end position, extended incrementally as its tokens grow, so one
proposal costs O(max n) dictionary lookups plus O(max n) insertions per new token; no state is
shared between requests. The draft-model proposer runs a one-process engine of the draft model
beside the driver and asks it for k greedy tokens; its prefix cache keeps each request's context,
so a proposal computes only the tokens accepted since the last one, plus k decode steps.
Verification happens on the last stage (runtime/speculative.py); the scheduler books drafts as
extra rows and applies what came back: one pass through the pipeline yields up to k + 1 tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import EngineConfig, SpeculativeConfig
from ..request import Request, SamplingParams


@dataclass
class _State:
    """One request's proposer index and acceptance history."""
    index: dict[tuple[int, ...], int] = field(default_factory=dict)   # n-gram -> latest end position
    num_indexed: int = 0                  # n-grams ending at positions < this are in `index`
    recent: deque = field(default_factory=deque)   # (proposed, accepted) of its latest verify steps
    recent_proposed: int = 0
    recent_accepted: int = 0
    paused_steps: int = 0                 # steps left without proposals (back-off)
    num_backoffs: int = 0                 # each back-off of this request pauses twice as long (up to 8x)
    max_drafts: int = 0                   # adaptive draft length (0: not set yet)


class SpeculationStats:
    def __init__(self) -> None:
        self.num_verify_rows = 0          # request-steps that carried drafts
        self.num_proposed = 0             # draft tokens proposed
        self.num_accepted = 0             # draft tokens accepted
        self.num_backoffs = 0
        self.propose_s = 0.0              # driver time spent proposing

    def snapshot(self) -> dict:
        n = self.num_verify_rows
        return {"proposed": self.num_proposed, "accepted": self.num_accepted, "verify_steps": n,
                "acceptance_rate": self.num_accepted / self.num_proposed if self.num_proposed else 0.0,
                # tokens a verify step yields: its accepted drafts plus the one sampled token (vLLM's definition)
                "mean_accepted_length": 1.0 + self.num_accepted / n if n else 0.0,
                "backoffs": self.num_backoffs, "propose_s": self.propose_s}


class Proposer:
    """What every proposer shares: the draft budget, back-off and acceptance bookkeeping per request."""

    def __init__(self, config: SpeculativeConfig, max_len: int):
        self.config = config
        self.max_len = max_len            # the engine's context: no draft may reach past it
        self.states: dict[str, _State] = {}
        self.stats = SpeculationStats()

    def max_drafts(self, req: Request, budget: int) -> int:
        """How many drafts this request may carry now: the configured k, bounded by the step's token
        budget, the tokens it may still generate (the step yields drafts + 1) and the context end."""
        left = req.params.max_tokens - len(req.output_token_ids) - 1
        room = self.max_len - req.num_tokens - 1
        return max(0, min(self.config.num_speculative_tokens, budget, left, room))

    def propose(self, req: Request, budget: int) -> list[int]:
        """Drafts for a request whose next step computes its newest token (empty: none)."""
        k = self.max_drafts(req, budget)
        if k == 0 or not can_speculate(req):
            return []
        st = self.states.setdefault(req.request_id, _State())
        if st.paused_steps:
            st.paused_steps -= 1
            return []
        if self.config.adaptive_draft_length and st.max_drafts:
            k = min(k, st.max_drafts)
        return self._draft(req, st, k)

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verify step came back: count it, and back off if this request's recent acceptance is low."""
        s = self.stats
        s.num_verify_rows += 1
        s.num_proposed += num_proposed
        s.num_accepted += num_accepted
        st = self.states.get(request_id)
        if st is None:
            return
        cfg = self.config
        full = num_accepted == num_proposed
        st.max_drafts = min(cfg.num_speculative_tokens, 2 * num_proposed if full else num_accepted + 1)
        st.recent.append((num_proposed, num_accepted))
        st.recent_proposed += num_proposed
        st.recent_accepted += num_accepted
        while st.recent and st.recent_proposed - st.recent[0][0] >= cfg.backoff_window:
            p, a = st.recent.popleft()
            st.recent_proposed -= p
            st.recent_accepted -= a
        low = st.recent_accepted < cfg.backoff_min_acceptance * st.recent_proposed
        if st.recent_proposed >= cfg.backoff_window and low:
            st.paused_steps = cfg.backoff_steps << min(st.num_backoffs, 3)
            st.num_backoffs += 1
            st.recent.clear()
            st.recent_proposed = st.recent_accepted = 0
            s.num_backoffs += int(cfg.backoff_steps > 0)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def _draft(self, req: Request, st: _State, k: int) -> list[int]:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release what the proposer runs on (a draft model's engine)."""


class NgramProposer(Proposer):
    def _draft(self, req: Request, st: _State, k: int) -> list[int]:
        tokens = req.all_token_ids
        self._index(st, tokens)
        n_total = len(tokens)
        for n in range(min(self.config.prompt_lookup_max, n_total - 1), self.config.prompt_lookup_min - 1, -1):
            end = st.index.get(tuple(tokens[n_total - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []

    def _index(self, st: _State, tokens: list[int]) -> None:
        """Add every n-gram ending before the last token (the suffix itself must match an earlier
        occurrence, whose continuation is then known)."""
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        for end in range(max(st.num_indexed, lo), len(tokens)):
            for n in range(lo, min(hi, end) + 1):
                st.index[tuple(tokens[end - n:end])] = end
        st.num_indexed = max(st.num_indexed, len(tokens))


class DraftModelProposer(Proposer):
    """k greedy tokens of a draft model per request, from a one-process engine of its own.

    NOTE: the draft runs on the driver's thread between steps; its prefix cache keeps each
    request's blocks, so a proposal recomputes only the partial last block and the tokens accepted
    since the last one. Draft ids outside the target's vocabulary end the drafts (never verified)."""

    def __init__(self, config: SpeculativeConfig, max_len: int, draft, vocab_size: int):
        super().__init__(config, max_len)
        self.draft, self.vocab_size = draft, vocab_size

    def _draft(self, req: Request, st: _State, k: int) -> list[int]:
        tokens = req.all_token_ids
        if len(tokens) + k > self.draft.max_len:
            return []
        params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
        mine = self.draft.add_request(prompt_token_ids=list(tokens), params=params)
        ids: list[int] = []
        for out in self.draft.run_until_done():
            if out.request_id == mine.request_id and out.finished:
                ids = list(out.outputs[0].token_ids)
        cut = next((i for i, t in enumerate(ids) if t >= self.vocab_size), len(ids))
        return ids[:min(k, cut)]

    def shutdown(self) -> None:
        self.draft.shutdown()


def draft_config(target: EngineConfig, spec: SpeculativeConfig) -> EngineConfig:
    """The draft engine's options: one eager stage in this process, a small KV cache, the target's
    dtype, device, seed and batch size."""
    return EngineConfig().replace(
        model=spec.model, dtype=target.load.dtype, device=target.load.device, seed=target.load.seed,
        kv_cache_memory=spec.draft_kv_cache_memory, max_num_seqs=target.scheduler.max_num_seqs,
        max_model_len=None, prefill_graph="off")


def make_proposer(spec: SpeculativeConfig | None, max_len: int, target: EngineConfig, tok,
                  engine_of: Callable[[EngineConfig], Any]) -> Proposer | None:
    """The proposer `spec` names (None: no speculation). `engine_of` builds the draft model's
    engine (the Engine class: passed in, so this module does not import the engine)."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec, max_len)
    try:
        draft = engine_of(draft_config(target, spec))
    except (ValueError, OSError) as exc:
        raise ValueError(f"speculative_config model {spec.model!r} could not be started: {exc}") from None
    mismatch = vocabulary_mismatch(tok.tokenizer.get_vocab(), draft.tok.tokenizer.get_vocab())
    if mismatch:
        raise ValueError(f"speculative_config model {spec.model!r} has another tokenizer ({mismatch}); a draft model "
                         f"must share the served model's tokenizer.")
    return DraftModelProposer(spec, max_len, draft, tok.vocab_size)


def vocabulary_mismatch(target: dict[str, int], draft: dict[str, int]) -> str:
    """Why two vocabularies differ on the ids both have ('' when they agree)."""
    common = min(len(target), len(draft))
    t = {i: w for w, i in target.items() if i < common}
    d = {i: w for w, i in draft.items() if i < common}
    wrong = next((i for i in sorted(t) if d.get(i) != t[i]), None)
    if wrong is None:
        return ""
    return f"token {wrong} is {t[wrong]!r} for the served model, {d.get(wrong)!r} for the draft"


def can_speculate(req: Request) -> bool:
    """Rows whose sampling needs per-request state beyond its tokens (a grammar matcher) are
    never speculated: their rule could not be applied at every draft position."""
    p = req.params
    return not any(getattr(p, name, None) for name in ("structured_outputs", "guided_decoding", "response_format"))
