"""Verifying drafts on the last stage (speculative decoding; the driver proposes, see
engine/speculative.py).

A row with k drafts runs k+1 query rows; row i predicts the token after the known tokens plus
drafts[:i]. Each row is sampled exactly as a one-token step would be, by the ordinary sampler,
from a view of the request that already holds drafts[:i] (so penalties, min_tokens, seeds keyed
by output index and logprobs all see the accepted prefix). Drafts are accepted while the sampled
token equals the draft; the first differing sample (or the one after the last draft) is the
step's sampled token. For greedy rows that is "accept while the argmax matches"; for random rows
the draw is an inverse-CDF draw with its own uniform, so a draft is accepted with its target
probability and, when rejected, the token drawn is distributed as the target with the draft
removed and renormalised: the standard rule for a deterministic draft, and the output
distribution (and a seeded request's exact tokens) equal decoding one token at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from ..request import TokenLogprob


@dataclass
class Verified:
    accepted: list[int] = field(default_factory=list)
    accepted_logprobs: list[TokenLogprob] = field(default_factory=list)
    token: int | None = None             # the step's sampled token (after the accepted drafts)
    logprob: TokenLogprob | None = None
    error: str | None = None


def draft_views(state: Any, drafts: list[int]) -> list[Any]:
    """The request as each of its k+1 verified rows sees it: state with drafts[:i] appended."""
    return [state] + [replace(state, token_ids=state.token_ids + drafts[:i]) for i in range(1, len(drafts) + 1)]


def accept(drafts: list[int], draws: Sequence[Any]) -> Verified:
    """The longest prefix of `drafts` the k+1 draws agree with, plus the next draw."""
    out = Verified()
    for i, draw in enumerate(draws):
        if draw.error is not None:
            out.error = draw.error
            return out
        if i < len(drafts) and draw.token == drafts[i]:
            out.accepted.append(draw.token)
            if draw.logprob is not None:
                out.accepted_logprobs.append(draw.logprob)
            continue
        out.token, out.logprob = draw.token, draw.logprob
        return out
    raise AssertionError("k drafts get k + 1 draws")
