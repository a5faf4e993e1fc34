"""Logprob entries in the OpenAI completions, OpenAI chat and native shapes, and which tokens a
response may show them for. A token is shown when its text starts inside the text the response
shows, so a stop string trims tokens and text alike and a stream never sends an entry for a
token whose text is later cut; `TokenSpans` finds where each token's text starts.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from ..engine.outputs import decode_incremental
from ..request import TokenLogprob


class TokenSpans:
    """Decodes ids one at a time the way the engine builds output text (a small window of recent
    tokens, a character held back until its last byte arrives) and records where each token's
    text starts. A token that only begins a character starts where that character does."""

    def __init__(self, tok, skip_special_tokens: bool = True):
        self.tok, self.skip = tok, skip_special_tokens
        self.ids: list[int] = []
        self.starts: list[int] = []
        self.text = ""
        self._window = (0, 0)          # [start, read): tokens decoded as context / already in `text`

    def extend(self, ids) -> "TokenSpans":
        for token_id in ids:
            self.ids.append(int(token_id))
            self.starts.append(len(self.text))
            new, self._window = decode_incremental(self.tok, self.ids, self._window, self.skip)
            self.text += new
        return self

    def flushed_text(self) -> str:
        """All the text, an incomplete last character included (as U+FFFD), as a finished output shows it."""
        return self.text + decode_incremental(self.tok, self.ids, self._window, self.skip, flush=True)[0]

    def count_before(self, num_chars: int) -> int:
        """How many tokens start before character `num_chars` (starts never decrease)."""
        return bisect_left(self.starts, num_chars)


def shown_count(spans: TokenSpans, token_ids: list[int], text: str, finished: bool, keep_stop_token: bool) -> int:
    """How many output tokens a response shows for `text`: those starting inside it. With
    `keep_stop_token` (completions), a finished output whose text nothing cut shows every token,
    the final stop token (EOS, which has no text) included: clients read the generated token last."""
    spans.extend(token_ids[len(spans.ids):])
    if finished and keep_stop_token and spans.flushed_text() == text:
        return len(token_ids)
    return spans.count_before(len(text))


def token_text(tok, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def sorted_top(lp: TokenLogprob) -> list[tuple[int, float]]:
    return sorted((lp.top or {}).items(), key=lambda kv: -kv[1])


def _top_by_text(tok, lp: TokenLogprob) -> dict[str, float]:
    top: dict[str, float] = {}
    for token_id, value in sorted_top(lp):       # two ids with one text: keep the likelier
        top.setdefault(token_text(tok, token_id), float(value))
    return top


def completion_entries(tok, token_ids: list[int], lps: Sequence[TokenLogprob | None], offsets: list[int]) -> dict:
    """The completions `logprobs` object; a None entry (a prompt's first token) has null logprobs."""
    return {"tokens": [token_text(tok, t) for t in token_ids],
            "token_logprobs": [None if lp is None else float(lp.logprob) for lp in lps],
            "top_logprobs": [None if lp is None else _top_by_text(tok, lp) for lp in lps],
            "text_offset": list(offsets)}


def chat_entries(tok, lps: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tok, token_id)
        return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}

    content = [dict(entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, v) for t, v in sorted_top(lp)])
               for lp in lps]
    return {"content": content, "refusal": None}


def native_entries(lps: Sequence[TokenLogprob | None] | None) -> list[dict | None] | None:
    """Native shape; a None entry (the first prompt token, which nothing predicts) stays None."""
    if lps is None:
        return None
    return [None if lp is None else {"token_id": lp.token_id, "logprob": float(lp.logprob),
                                     "top": {str(t): float(v) for t, v in sorted_top(lp)}} for lp in lps]


class TokenIdNames:
    """vLLM's `return_tokens_as_token_ids`: logprob entries name tokens "token_id:<id>", so tokens
    that are not valid UTF-8 on their own stay distinguishable (a stand-in for the tokenizer there)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"token_id:{int(t)}" for t in ids)


def vllm_prompt_logprobs(tok, lps: Sequence[TokenLogprob | None] | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (the first None) a map from token id to its
    logprob, rank and decoded text, for the prompt's own token and the top-n alternatives."""
    if lps is None:
        return None
    out: list[dict | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": float(v), "rank": rank, "decoded_token": token_text(tok, t)}
                 for rank, (t, v) in enumerate(sorted_top(lp), 1)}
        entry.setdefault(str(lp.token_id), {"logprob": float(lp.logprob), "rank": lp.rank,
                                            "decoded_token": token_text(tok, lp.token_id)})
        out.append(entry)
    return out
