"""What the scheduler asks before it books tokens: how long a prompt's next chunk is (`FixedChunks`,
or `DynamicChunkSizer`: later chunks shrink so each costs about the first's) and how many decode
rows one plan may carry (`DecodeBalancer`: about running / depth, so every plan in flight is full).

The chunk cost model t(L, x) = c0 + c1·x + c2·x·(L + x/2) (x tokens after a prefix of L: weights
per token, attention over the prefix and within the chunk) is fitted by `fit_chunk_costs` from a
start-up profile of a few synthetic prefills (`engine.profile.profile_chunks`). Sizes never exceed
the step's token budget, and chunking never changes outputs: only where a prompt is cut.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


class FixedChunks:
    """The plain rule: as many tokens as the step's budget allows."""

    def chunk_len(self, start: int, remaining: int, budget: int) -> int:
        return min(remaining, budget)

    def describe(self) -> str:
        return "fixed chunks (the step's token budget)"


@dataclass(frozen=True)
class ChunkCosts:
    """Fitted seconds of a chunk of x tokens after a prefix of L: c0 + c1·x + c2·x·(L + x/2)."""
    c0: float
    c1: float
    c2: float

    def seconds(self, start: int, num_tokens: int) -> float:
        x = num_tokens
        return self.c0 + self.c1 * x + self.c2 * x * (start + x / 2)


def fit_chunk_costs(samples: list[tuple[int, int, float]]) -> ChunkCosts:
    """Least squares over (start, num_tokens, seconds) samples; c1 and c2 are kept non-negative
    (a noisy profile may otherwise predict chunks that grow)."""
    import torch
    a = torch.tensor([[1.0, x, x * (s + x / 2)] for s, x, _ in samples], dtype=torch.float64)
    b = torch.tensor([[t] for _, _, t in samples], dtype=torch.float64)
    c0, c1, c2 = torch.linalg.lstsq(a, b).solution.flatten().tolist()
    if c2 < 0 or c1 < 0:
        # refit without the term that went negative
        keep = [0, 1] if c2 < 0 else [0, 2]
        sol = torch.linalg.lstsq(a[:, keep], b).solution.flatten().tolist()
        full = [0.0, 0.0, 0.0]
        for k, v in zip(keep, sol):
            full[k] = max(v, 0.0) if k else v
        c0, c1, c2 = full
    return ChunkCosts(c0, c1, c2)


class DynamicChunkSizer:
    """Chunk lengths that keep every chunk's cost near a first chunk's (`base` tokens from position 0):
    solves c1·x + c2·x·(L + x/2) = c1·base + c2·base²/2, rounded down to `align` tokens, at least
    `min_len`, never above the budget. A remainder shorter than `min_len` joins the chunk."""

    def __init__(self, costs: ChunkCosts, base: int, align: int | None = None):
        self.costs, self.base = costs, base
        self.align = align or (64 if base >= 512 else max(1, base // 8))
        self.min_len = max(self.align, (base // 4) // self.align * self.align)
        self.target = costs.c1 * base + costs.c2 * base * base / 2     # the first chunk's variable cost

    def ideal_len(self, start: int) -> int:
        c1, c2 = self.costs.c1, self.costs.c2
        if c2 <= 0:
            return self.base
        b = c1 + c2 * start                       # (c2/2)x² + b·x − target = 0
        x = (-b + math.sqrt(b * b + 2 * c2 * self.target)) / c2
        return max(self.min_len, int(x) // self.align * self.align)

    def chunk_len(self, start: int, remaining: int, budget: int) -> int:
        n = min(remaining, budget, self.ideal_len(start))
        if remaining - n < self.min_len and remaining <= budget:
            n = remaining
        return max(1, n)

    def describe(self) -> str:
        c = self.costs
        lens = ", ".join(f"{self.ideal_len(s)} after {s}" for s in (0, 4 * self.base, 8 * self.base))
        return (f"dynamic chunks: fitted t(L, x) = {c.c0 * 1e3:.2f} ms + {c.c1 * 1e6:.2f} us·x + "
                f"{c.c2 * 1e9:.3f} ns·x·(L + x/2); chunk lengths {lens} tokens")


class DecodeBalancer:
    """Caps the decode rows of one plan at ceil(decoding / depth), so a burst of requests spreads over
    every plan in flight instead of filling the first; prefill chunks are never capped (and a decode
    row left out goes into the next plan). `depth` 1 means no cap."""

    def __init__(self, depth: int = 1):
        self.depth = depth

    def decode_cap(self, num_decoding: int) -> int | None:
        if self.depth <= 1:
            return None
        return max(1, -(-num_decoding // self.depth))


class LinkDepth:
    """Plans in flight when `--pp-depth` is unset: the stage count to begin with, one more after each
    `window` collected plans in which (a) the busiest stage computed less than `busy_target` of the
    time plans were in flight and (b) a plan's round trip held more than one stage step of waiting
    that neither compute nor queueing behind the other plans explains (links, the driver), up to
    `limit`. On one machine (b) never holds, so plans keep their size; over a slow link each added
    plan hides part of the link. It grows only while the work at hand fills one more plan
    (`fillable`: decode requests in groups of `MIN_ROWS`, plus prompt chunks still to book), and
    never shrinks: a link's round trip does not get shorter while the pipeline runs."""
    MIN_ROWS = 2

    def __init__(self, start: int, limit: int, window: int = 16, busy_target: float = 0.85):
        self.start, self.depth, self.limit = start, start, max(start, limit)
        self.window, self.busy_target = window, busy_target
        self.sent_at: dict[int, float] = {}
        self._busy0: list[float] | None = None
        self._active0, self._round_trips = 0.0, [0.0, 0]

    def sent(self, plan_id: int, now: float) -> None:
        self.sent_at[plan_id] = now

    def observe(self, plan_id: int, now: float, stage_busy_s: list[float], active_s: float, fillable: int) -> int:
        """After each collected plan: its id, the time, the stages' busy clocks, the wall time plans
        have been in flight so far, and how many plans the work at hand could fill. Returns the depth."""
        sent = self.sent_at.pop(plan_id, None)
        if not stage_busy_s or self.depth >= self.limit:
            self.sent_at.clear()
            return self.depth
        if self._busy0 is None or len(self._busy0) != len(stage_busy_s) or sent is None:   # first, or rebuilt
            self._busy0, self._active0, self._round_trips = list(stage_busy_s), active_s, [0.0, 0]
            self.sent_at = {k: v for k, v in self.sent_at.items() if k > plan_id}
            return self.depth
        self._round_trips[0] += now - sent
        self._round_trips[1] += 1
        if self._round_trips[1] < self.window:
            return self.depth
        plans = self._round_trips[1]
        steps = [(b - b0) / plans for b, b0 in zip(stage_busy_s, self._busy0)]
        busiest, round_trip = max(steps), self._round_trips[0] / plans
        unexplained = round_trip - sum(steps) - (self.depth - self.start) * busiest
        idle = (active_s - self._active0) * self.busy_target > busiest * plans
        if idle and unexplained > busiest and fillable > self.depth:
            self.depth += 1
        self._busy0, self._active0, self._round_trips = list(stage_busy_s), active_s, [0.0, 0]
        return self.depth
