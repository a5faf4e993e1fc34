"""Turning cumulative engine outputs into stream deltas, and engine logprobs into the OpenAI
completions, OpenAI chat and native shapes."""
from __future__ import annotations

import logging

from ..request import RequestOutput, TokenLogprob

log = logging.getLogger("stagewise.server")


class StreamState:
    """What one choice has sent so far; `advance` returns only the new text and logprobs."""

    def __init__(self):
        self.text = ""
        self.num_tokens = 0
        self.num_logprobs = 0
        self.offset_before = 0        # completions text_offset of the next token
        self.started = False

    def advance(self, out: RequestOutput) -> tuple[str, list[TokenLogprob]]:
        c = out.outputs[0]
        # NOTE: a trailing U+FFFD is half a UTF-8 character that the next token completes: hold it back.
        text = c.text if out.finished else c.text.rstrip("\ufffd")
        delta = ""
        if text.startswith(self.text):
            delta, self.text = text[len(self.text):], text
        elif text:
            log.debug("stream text is not an extension of what was sent; dropping the difference")
        self.num_tokens = len(c.token_ids)
        lps = list(c.logprobs or [])[self.num_logprobs:]
        self.num_logprobs += len(lps)
        return delta, lps


def _token_text(tok, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tok, lps: list[TokenLogprob] | None, start_offset: int = 0) -> dict | None:
    if lps is None:
        return None
    tokens = [_token_text(tok, lp.token_id) for lp in lps]
    offsets, at = [], start_offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [float(lp.logprob) for lp in lps],
            "top_logprobs": [{_token_text(tok, t): float(v) for t, v in _sorted_top(lp)} for lp in lps],
            "text_offset": offsets}


def chat_logprobs(tok, lps: list[TokenLogprob] | None) -> dict | None:
    if lps is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = _token_text(tok, token_id)
        return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}

    content = [dict(entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, v) for t, v in _sorted_top(lp)])
               for lp in lps]
    return {"content": content, "refusal": None}


def native_logprobs(lps: list[TokenLogprob] | None) -> list[dict] | None:
    if lps is None:
        return None
    return [{"token_id": lp.token_id, "logprob": float(lp.logprob),
             "top": {str(t): float(v) for t, v in _sorted_top(lp)}} for lp in lps]


def _sorted_top(lp: TokenLogprob) -> list[tuple[int, float]]:
    return sorted((lp.top or {}).items(), key=lambda kv: -kv[1])
