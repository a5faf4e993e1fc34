"""Sampling on the last stage, batched: penalties, temperature, top-k / top-p / min-p, seeded
draws and logprobs for all rows of a step at once.

vLLM's request-level logits processors (logit_bias, allowed_token_ids, bad_words) change only
the rows that ask for them, on their private copy, before everything else
(`apply_logits_processors`); rows that do not ask keep the fast greedy path.
A row whose logits are not finite (a model fault, or numbers no valid request can produce)
fails alone: it gets an error instead of a token and the other rows are untouched. Seeded
rows draw from a generator keyed by (seed, output index), so a request gets the same tokens
whatever it is batched with, and after preemption.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol, cast

import torch

from ..request import SamplingParams, TokenLogprob

TOP_P_HEAD = 1024     # top-p without top-k: tokens ranked before falling back to a full sort
NONFINITE = "the model produced non-finite logits for this request"
NO_TOKEN_LEFT = ("allowed_token_ids, bad_words and logit_bias leave no token to generate; allow at least one "
                 "token")
NO_ALLOWED_TOKEN = "the request's grammar allows no token of the vocabulary here"


class SampleRow(Protocol):
    """What the sampler reads of one request (the worker's per-request state)."""
    params: SamplingParams
    token_ids: list[int]            # prompt + outputs so far
    num_prompt_tokens: int
    input_embeds: object            # not None: the prompt ids are placeholders


@dataclass
class Draw:
    token: int | None
    logprob: TokenLogprob | None = None
    error: str | None = None


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


def apply_logits_processors(x: torch.Tensor, rows: list["SampleRow"]) -> list[bool]:
    """vLLM's request-level logits processors, in place on `x` `[M, V]` (a private copy), for the
    rows that ask for them: `logit_bias` added, everything but `allowed_token_ids` masked, and each
    `bad_words` sequence's last token masked when the output ends with the rest of it. Returns,
    per row, whether any token is left to sample."""
    left = [True] * len(rows)
    vocab = x.shape[1]
    for i, r in enumerate(rows):
        p, row = r.params, x[i]
        if not p.has_logits_processors:
            continue
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
        if p.allowed_token_ids:
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[torch.tensor(p.allowed_token_ids, dtype=torch.long)] = True
            row.masked_fill_(~keep, float("-inf"))
        if p.bad_words_token_ids:
            output = r.token_ids[r.num_prompt_tokens:]
            banned = [seq[-1] for seq in p.bad_words_token_ids if _ends_with(output, seq[:-1])]
            if banned:
                row[torch.tensor(banned, dtype=torch.long)] = float("-inf")
        left[i] = bool(torch.isfinite(row.amax()))
    return left


def _ends_with(ids: list[int], tail: list[int]) -> bool:
    return not tail or (len(tail) <= len(ids) and ids[len(ids) - len(tail):] == tail)


def filter_sorted(sorted_logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p, then min-p masking of rows sorted in descending order `[S, V]`
    (temperature already applied). Returns the masked rows (-inf where dropped)."""
    num_rows, vocab = sorted_logits.shape
    pos = torch.arange(vocab)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    x = sorted_logits.masked_fill(pos[None, :] >= top_k[:, None], float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype)
    if (top_p < 1).any():
        probs = x.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]      # keep the token that crosses top_p
        drop[:, 0] = False                 # NOTE: a top_p that underflows float32 still keeps the top token
        x = x.masked_fill(drop & (top_p[:, None] < 1), float("-inf"))
    min_p = [p.min_p for p in params]
    if any(min_p):
        floor = torch.tensor([math.log(m) if m > 0 else float("-inf") for m in min_p], dtype=x.dtype)
        x = x.masked_fill(x < x[:, :1] + floor[:, None], float("-inf"))  # p < min_p * p_max
    return x


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bits: torch.Tensor) -> None:
    """Mask to -inf, in place, the tokens that row `rows[i]` of `logits` `[R, V]` may not take
    (`bits[i]`: int32 `[ceil(V/32)]`, xgrammar's packed layout). Other rows are not touched."""
    import xgrammar
    if rows == list(range(logits.shape[0])):
        xgrammar.apply_token_bitmask_inplace(logits, bits)
        return
    sub = logits[rows]
    xgrammar.apply_token_bitmask_inplace(sub, bits)
    logits[rows] = sub


def rows_finite(logits: torch.Tensor) -> torch.Tensor:
    """`[R]` True where every logit of the row is finite. max/min propagate NaN and keep +-inf, and
    two vectorised reductions cost a fraction of `isfinite(x).all(-1)` over a large vocabulary."""
    return torch.isfinite(logits.amax(-1)) & torch.isfinite(logits.amin(-1))


ARGMAX_BLOCK = 256


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`argmax(-1)` of finite rows `[R, V]`, the first maximal index like torch's, via block maxima:
    torch's CPU argmax walks the row scalar by scalar, a vectorised max over blocks does not."""
    rows, vocab = logits.shape
    if vocab % ARGMAX_BLOCK or vocab < 4 * ARGMAX_BLOCK:
        return logits.argmax(-1)
    blocks = logits.reshape(rows, vocab // ARGMAX_BLOCK, ARGMAX_BLOCK)
    first = blocks.amax(-1).argmax(-1)                           # [R] the first block holding the max
    within = blocks[torch.arange(rows), first].argmax(-1)       # [R] its first maximal column
    return first * ARGMAX_BLOCK + within


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: tuple[int, ...] = ()):
        self.generator = torch.Generator().manual_seed(seed)     # unseeded requests
        self.eos_token_ids = tuple(eos_token_ids)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow],
               bitmask: tuple[list[int], torch.Tensor] | None = None) -> list[Draw]:
        """logits float32 `[R, V]`, one row per request; not modified unless `bitmask` = (row indices,
        packed allowed tokens) constrains some rows: those are masked in place before every rule."""
        draws: list[Draw | None] = [None] * len(rows)
        ok = rows_finite(logits).tolist()
        for i, good in enumerate(ok):
            if not good:
                draws[i] = Draw(None, None, NONFINITE)
        if bitmask is not None:
            self._constrain(logits, *bitmask, ok, draws)
        live = [i for i in range(len(rows)) if ok[i]]
        plain = [i for i in live if self._is_plain_greedy(rows[i])]
        if plain:
            picked = logits if len(plain) == len(rows) else logits[plain]   # all rows: no copy
            for i, token in zip(plain, row_argmax(picked).tolist()):
                draws[i] = Draw(token)
        rest = [i for i in live if draws[i] is None]
        if rest:
            for i, draw in zip(rest, self._sample_rest(logits[rest], [rows[i] for i in rest])):
                draws[i] = draw
        filled = cast("list[Draw]", draws)   # every row has one now: non-finite, greedy or sampled
        self._add_logprobs(logits, rows, filled)
        return filled

    @staticmethod
    def _constrain(logits: torch.Tensor, idx: list[int], bits: torch.Tensor, ok: list[bool],
                   draws: list[Draw | None]) -> None:
        apply_token_bitmask(logits, idx, bits)
        for i, alive in zip(idx, torch.isfinite(logits[idx].amax(-1)).tolist()):
            if ok[i] and not alive:
                ok[i], draws[i] = False, Draw(None, None, NO_ALLOWED_TOKEN)

    def _is_plain_greedy(self, row: SampleRow) -> bool:
        """Greedy with nothing that changes the row before its argmax."""
        p = row.params
        return (p.is_greedy and p.repetition_penalty == 1.0 and not p.presence_penalty
                and not p.frequency_penalty and not p.has_logits_processors and not self._blocks_eos(row))

    def _blocks_eos(self, row: SampleRow) -> bool:
        p = row.params
        return bool(self.eos_token_ids) and not p.ignore_eos and self._num_outputs(row) < p.min_tokens

    @staticmethod
    def _num_outputs(row: SampleRow) -> int:
        return len(row.token_ids) - row.num_prompt_tokens

    def _sample_rest(self, x: torch.Tensor, rows: list[SampleRow]) -> list[Draw]:
        """Rows that need logits processors, penalties, an EOS block or a random draw; `x` is a private
        copy `[M, V]`."""
        left = apply_logits_processors(x, rows)
        for j, row in enumerate(rows):
            prompt = row.token_ids[:row.num_prompt_tokens] if row.input_embeds is None else []
            apply_penalties(x[j], row.params, prompt, row.token_ids[row.num_prompt_tokens:])
            if self._blocks_eos(row):
                x[j, list(self.eos_token_ids)] = float("-inf")
        tokens: list[int | None] = [None] * len(rows)
        greedy = [j for j, r in enumerate(rows) if r.params.is_greedy]
        if greedy:
            for j, t in zip(greedy, x[greedy].argmax(-1).tolist()):
                tokens[j] = t
        drawn = [j for j, r in enumerate(rows) if not r.params.is_greedy]
        if drawn:
            for j, t in zip(drawn, self._draw(x[drawn], [rows[j] for j in drawn])):
                tokens[j] = t
        return [Draw(None, None, NO_TOKEN_LEFT) if not ok else Draw(t) if t is not None else Draw(None, None, NONFINITE)
                for t, ok in zip(tokens, left)]

    def _draw(self, x: torch.Tensor, rows: list[SampleRow]) -> list[int | None]:
        """Random draws `[S, V]`: temperature, filters, then one uniform number per row through the
        row's cumulative distribution in token-id order (exact, and a few hundred microseconds where
        exponential noise over the whole vocabulary costs ~1 ms per row); None where the
        distribution is not finite. Only rows with a top-k or top-p are ranked, and when every
        such row has a top-k, only as wide as the widest."""
        params = [r.params for r in rows]
        vocab = x.shape[1]
        temps = torch.tensor([p.temperature for p in params], dtype=x.dtype)
        x = x / temps[:, None]
        probs = torch.zeros_like(x)
        ranked = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1]
        unranked = sorted(set(range(len(rows))) - set(ranked))
        if unranked:      # min-p alone compares with the row's maximum: no sort
            y = x[unranked]
            floor = torch.tensor([math.log(params[j].min_p) if params[j].min_p > 0 else float("-inf")
                                  for j in unranked], dtype=y.dtype)
            probs[unranked] = y.masked_fill(y < y.amax(-1, keepdim=True) + floor[:, None], float("-inf")).softmax(-1)
        if ranked:
            sub = [params[j] for j in ranked]
            values, order, sub = self._rank(x[ranked], sub)
            probs[ranked] = torch.zeros(len(ranked), vocab, dtype=x.dtype).scatter_(
                1, order, filter_sorted(values, sub).softmax(-1))
        uniform = torch.empty(len(rows), 1, dtype=torch.float64)
        unseeded = [j for j, p in enumerate(params) if p.seed is None]
        if unseeded:
            uniform[unseeded] = torch.rand(len(unseeded), 1, dtype=torch.float64, generator=self.generator)
        for j, (p, row) in enumerate(zip(params, rows)):
            if p.seed is not None:
                gen = torch.Generator().manual_seed(hash((p.seed, self._num_outputs(row))) & 0x7FFF_FFFF_FFFF)
                uniform[j] = torch.rand(1, dtype=torch.float64, generator=gen)
        cdf = probs.double().cumsum(-1)
        valid = (torch.isfinite(cdf[:, -1]) & (cdf[:, -1] > 0)).tolist()
        # first token whose cumulative mass exceeds u * total: a zero-probability token never is
        picks = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp_(max=vocab - 1)
        return [t if v else None for t, v in zip(picks[:, 0].tolist(), valid)]

    @staticmethod
    def _rank(x: torch.Tensor, params: list[SamplingParams]):
        """The head of each row in descending order, as wide as the filters need, and the params
        to filter it with. A top-k bounds the width. A top-p without a top-k first tries the top
        TOP_P_HEAD tokens: when they hold at least top_p of the row's mass, the cut lies among them,
        and filtering the head with top_p / head_mass cuts exactly where the whole row would.
        Otherwise the whole row is sorted (~2 ms per 50k-token row)."""
        vocab = x.shape[1]
        widths = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if max(widths) < vocab:
            return *x.topk(max(widths), dim=-1), params
        if vocab > 2 * TOP_P_HEAD and all(w <= TOP_P_HEAD or w == vocab for w in widths):
            values, order = x.topk(TOP_P_HEAD, dim=-1)
            mass = (values.logsumexp(-1) - x.logsumexp(-1)).exp().tolist()
            if all(w < vocab or m >= p.top_p for w, m, p in zip(widths, mass, params)):
                return values, order, [p if w < vocab else replace(p, top_p=min(1.0, p.top_p / m))
                                       for w, m, p in zip(widths, mass, params)]
        return *x.sort(dim=-1, descending=True, stable=True), params

    def _add_logprobs(self, logits: torch.Tensor, rows: list[SampleRow], draws: list[Draw]) -> None:
        """The model's raw logprobs (before penalties and filters) of the chosen token and the top-n."""
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None and draws[i].token is not None]
        if not want:
            return
        raw = logits[want].log_softmax(-1)
        counts = [rows[i].params.logprobs or 0 for i in want]   # never None here
        top_n = max(counts)
        best = raw.topk(top_n, -1) if top_n else None
        for j, (i, n) in enumerate(zip(want, counts)):
            token = draws[i].token
            assert token is not None   # `want` holds drawn rows only
            # NOTE: a grammar's mask leaves disallowed tokens at -inf: they are no alternatives
            top = ({int(t): float(v) for t, v in zip(best.indices[j, :n], best.values[j, :n]) if v > float("-inf")}
                   if best is not None and n else {})
            draws[i].logprob = TokenLogprob(token, float(raw[j, token]), top)


PROMPT_LOGPROB_ROWS = 256     # LM-head rows per slice: bounds the [rows, vocab] logits in memory


def prompt_logprobs(compute_logits, hidden: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprob]:
    """Row i of `hidden` `[n, H]` predicts `targets[i]`: its logprob and the top-n alternatives."""
    entries = []
    for lo in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        logprobs = compute_logits(hidden[lo:lo + PROMPT_LOGPROB_ROWS]).float().log_softmax(-1)   # [r, V]
        want = torch.tensor(targets[lo:lo + PROMPT_LOGPROB_ROWS], device=logprobs.device)
        chosen_t = logprobs.gather(1, want[:, None])                              # [r, 1]
        ranks = ((logprobs > chosen_t).sum(-1) + 1).tolist()                     # vLLM reports the rank
        chosen = chosen_t[:, 0].tolist()
        top_vals, top_ids = logprobs.topk(top_n, -1) if top_n else (logprobs[:, :0], want[:, None][:, :0])
        for t, lp, ids, vals, rank in zip(want.tolist(), chosen, top_ids.tolist(), top_vals.tolist(), ranks):
            entries.append(TokenLogprob(t, lp, dict(zip(ids, vals)), rank))
    return entries
