"""The start-up profile behind dynamic chunking: a few synthetic prefills run through the real
scheduler and stages, one plan at a time, each chunk timed by the stages' busy clocks (summed over
stages), and `balance.fit_chunk_costs` fitted to them. It runs before the engine takes requests."""
from __future__ import annotations

import logging
import random

from .. import envs
from ..graph.policy import decide_verdict
from ..request import Request, SamplingParams
from .balance import DecodeBalancer, DynamicChunkSizer, FixedChunks, fit_chunk_costs

log = logging.getLogger("stagewise.engine")
PROFILE_CHUNKS = 3        # chunks of the full budget per synthetic prompt


def profile_chunks(scheduler, executor, policy, vocab_size: int, max_len: int
                   ) -> tuple[list[tuple[int, int, float]], list[float]]:
    """(start, num_tokens, seconds) of every chunk of two synthetic prompts: PROFILE_CHUNKS chunks of the
    token budget, then the same length in half-budget chunks (two chunk sizes make the fit's terms
    separable). A short warm-up prompt runs first and is not counted. Also returns the stages' busy
    clocks after the profile (the engine's statistics start from there)."""
    base = scheduler.token_budget
    total = min(PROFILE_CHUNKS * base, max_len - 2)
    rng = random.Random(20231)
    samples: list[tuple[int, int, float]] = []
    last, clocks = 0.0, list[float]()
    try:
        for k, (length, budget) in enumerate([(max(1, base // 2), base), (total, base), (total, max(1, base // 2))]):
            scheduler.token_budget = budget
            prompt = [rng.randrange(vocab_size) for _ in range(length)]
            for start, n, clocks in _run_prompt(scheduler, executor, policy, Request(f"profile-{k}", prompt,
                                                SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))):
                if k:        # busy clocks are cumulative: a chunk's cost is the difference
                    samples.append((start, n, sum(clocks) - last))
                last = sum(clocks)
    finally:
        scheduler.token_budget = base
    return samples, list(clocks)


def _run_prompt(scheduler, executor, policy, req: Request) -> list[tuple[int, int, list[float]]]:
    """Run one prompt plan by plan: (start, num_tokens, the stages' cumulative busy seconds after it)."""
    scheduler.add(req)
    out = []
    while req.request_id in scheduler.records:
        plan = scheduler.schedule()
        assert plan is not None and len(plan.seqs) == 1, "the profile runs alone in an idle engine"
        plan.verdict = decide_verdict(policy, plan.num_tokens, False, 1)
        executor.submit(plan)
        result = executor.collect()
        if result.error:
            raise RuntimeError(f"the dynamic-chunking profile failed: {result.error}")
        seq = plan.seqs[0]
        out.append((seq.start, seq.num_tokens, list(result.stage_busy_s)))
        scheduler.update(plan, result)
    return out


def fitted_chunker(scheduler, executor, policy, vocab_size: int, max_len: int):
    """(chunker, the stages' busy clocks after the profile): a DynamicChunkSizer fitted by the profile
    (logged), or FixedChunks when prompts cannot be longer than two chunks (nothing to size)."""
    base = scheduler.token_budget
    if max_len - 2 < 2 * base:
        log.info("dynamic chunking: off (the context, %d tokens, holds fewer than two chunks of %d)", max_len, base)
        return FixedChunks(), []
    samples, clocks = profile_chunks(scheduler, executor, policy, vocab_size, max_len)
    chunker = DynamicChunkSizer(fit_chunk_costs(samples), base)
    log.info("%s (profile: %d synthetic chunks)", chunker.describe(), len(samples))
    return chunker, clocks


def balance_scheduler(scheduler, executor, policy, depth: int, dynamic: bool, vocab_size: int,
                      max_len: int) -> list[float]:
    """Micro-batch balancing over `depth` plans in flight (STAGEWISE_BALANCE_MICRO_BATCHES=0: off) and,
    when `dynamic`, dynamic chunk sizing: its profile runs here, before any request, and leaves the
    prefix-cache counters as they were. Returns the stages' busy clocks after it (empty: nothing ran)."""
    scheduler.balancer = DecodeBalancer(depth if envs.STAGEWISE_BALANCE_MICRO_BATCHES else 1)
    if not dynamic:
        return []
    blocks = scheduler.blocks
    counters = blocks.num_queried_tokens, blocks.num_hit_tokens
    scheduler.chunker, clocks = fitted_chunker(scheduler, executor, policy, vocab_size, max_len)
    blocks.num_queried_tokens, blocks.num_hit_tokens = counters
    return clocks
