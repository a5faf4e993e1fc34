"""Sampling on the last stage: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

Seeded requests draw each token from a generator keyed by (seed, output index), so the
same request gives the same tokens whatever it is batched with, and after preemption.
"""
from __future__ import annotations

import torch

from ..request import SamplingParams, TokenLogprob


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """logits `[V]` in place. Repetition (HF style) covers prompt + output; presence and
    frequency (OpenAI style) cover the output only."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        ids, counts = torch.tensor(output_ids, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masking on one row `[V]`."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p   # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def _is_plain_greedy(params: SamplingParams, num_outputs: int, eos_ids: tuple[int, ...]) -> bool:
    """Greedy with nothing that changes a row before its argmax (no penalties, eos block or logprobs)."""
    return (params.is_greedy and params.logprobs is None and params.repetition_penalty == 1.0
            and not params.presence_penalty and not params.frequency_penalty
            and not (eos_ids and num_outputs < params.min_tokens))


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)   # unseeded requests

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]],
               output_ids: list[list[int]], eos_ids: list[tuple[int, ...]] | None = None
               ) -> list[tuple[int, TokenLogprob | None]]:
        """A batch of rows: logits float32 `[R, V]` (not modified), per-row params and histories.

        Plain greedy rows take one argmax over all of them; the rest go through `sample_row`, so
        every row gets exactly the token `sample_row` would give it.
        """
        eos_ids = eos_ids if eos_ids is not None else [()] * len(params)
        results: list[tuple[int, TokenLogprob | None] | None] = [None] * len(params)
        fast = [i for i, (p, out, eos) in enumerate(zip(params, output_ids, eos_ids))
                if _is_plain_greedy(p, len(out), eos)]
        if fast:
            rows = logits if len(fast) == len(params) else logits[fast]
            for i, token in zip(fast, rows.argmax(-1).tolist()):
                results[i] = (token, None)
        for i, done in enumerate(results):
            if done is None:
                results[i] = self.sample_row(logits[i].clone(), params[i], prompt_ids[i], output_ids[i], eos_ids[i])
        return results

    def sample_row(self, logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                   output_ids: list[int], eos_ids: tuple[int, ...] = ()) -> tuple[int, TokenLogprob | None]:
        """logits: one float32 row `[V]` (a private copy: modified in place)."""
        raw_logprobs = logits.log_softmax(-1) if params.logprobs is not None else None
        apply_penalties(logits, params, prompt_ids, output_ids)
        if len(output_ids) < params.min_tokens and eos_ids:
            logits[list(eos_ids)] = float("-inf")
        if params.is_greedy:
            token = int(torch.argmax(logits))
        else:
            probs = filter_logits(logits, params).softmax(-1)
            gen = self.generator
            if params.seed is not None:
                gen = torch.Generator().manual_seed(hash((params.seed, len(output_ids))) & 0x7FFF_FFFF_FFFF)
            token = int(torch.multinomial(probs, 1, generator=gen))
        return token, _logprob(raw_logprobs, token, params.logprobs)


def _logprob(logprobs: torch.Tensor | None, token: int, top_n: int | None) -> TokenLogprob | None:
    if logprobs is None:
        return None
    top = {}
    if top_n:
        values, ids = torch.topk(logprobs, top_n)
        top = {int(i): float(v) for i, v in zip(ids, values)}
    return TokenLogprob(token, float(logprobs[token]), top)
