"""Turning sampled tokens into user-facing results: incremental detokenization, stop rules,
stop strings, RequestOutput.

Per step and request the work is O(new tokens): only a small window of recent tokens is
decoded (the text grows by the difference, so multi-byte characters and word-boundary
spaces come out right), and stop strings are searched only in the new tail of the text.
"""
from __future__ import annotations

from ..request import CompletionOutput, FinishReason, Request, RequestOutput

REPLACEMENT = "\ufffd"     # what a decoder gives for an incomplete UTF-8 sequence


class StepOutputs(list):
    """What `Engine.step()` returns: the outputs of the requests that changed (a list, so callers
    that only iterate need nothing else), and whether the step did any work."""

    def __init__(self, outputs=(), progressed: bool = False):
        super().__init__(outputs)
        self.progressed = progressed


def decode_incremental(tok, ids: list[int], offsets: tuple[int, int], skip_special_tokens: bool,
                       flush: bool = False) -> tuple[str, tuple[int, int]]:
    """The text `ids[read:]` adds, decoded with `ids[start:read]` as context (`offsets` = (start,
    read)), and the offsets to use next. Empty, offsets unchanged, while a character is incomplete,
    unless `flush`."""
    start, read = offsets
    before = tok.decode(ids[start:read], skip_special_tokens) if read > start else ""
    now = tok.decode(ids[start:], skip_special_tokens)
    if len(now) <= len(before) or (now.endswith(REPLACEMENT) and not flush):
        return "", offsets
    return now[len(before):], (read, len(ids))


def decode_new_text(req: Request, tok, flush: bool = False) -> str:
    """Decode the request's newest tokens; returns the text they add (empty while a character
    is incomplete, unless `flush`). Updates `req.decoded` and the decode offsets."""
    new, req.decode_offsets = decode_incremental(tok, req.output_token_ids, req.decode_offsets,
                                                 req.params.skip_special_tokens, flush)
    req.decoded += new
    return new


def finish_check(req: Request, tok, max_model_len: int) -> FinishReason | None:
    """Update `req.text` for the newest token and say whether the request is done."""
    p = req.params
    token, n_out = req.output_token_ids[-1], len(req.output_token_ids)
    old_len = len(req.decoded)
    new = decode_new_text(req, tok)
    can_stop = n_out >= p.min_tokens
    if p.stop and can_stop and new:
        cut = _find_stop(req.decoded, p.stop_strings, max(0, old_len - p.max_stop_len + 1),
                         p.include_stop_str_in_output)
        if cut is not None:
            req.text = req.decoded[:cut]
            return FinishReason.STOP
    if can_stop and (token in (p.stop_token_ids or ()) or token in req.eos_token_ids):
        reason = FinishReason.STOP
    elif n_out >= p.max_tokens or req.num_tokens >= max_model_len:
        reason = FinishReason.LENGTH
    else:
        # NOTE: a stop string the output keeps needs no holding back: it is shown either way
        held_back = _partial_stop_len(req.decoded, p.stop_strings) if p.stop and not p.include_stop_str_in_output \
            else 0
        req.text = req.decoded[:len(req.decoded) - held_back]
        return None
    return finish_text(req, tok, reason)


def finish_text(req: Request, tok, reason: FinishReason = FinishReason.STOP) -> FinishReason:
    """The request ends now: its whole decoded text is shown (nothing held back)."""
    decode_new_text(req, tok, flush=True)
    req.text = req.decoded
    return reason


def _find_stop(text: str, stops: list[str], start: int, keep: bool = False) -> int | None:
    """Where the text ends at the first stop string in `text[start:]` (the part that can hold a new
    match): where it begins, or with `keep` (include_stop_str_in_output) where it ends."""
    hits = [(i, -len(s)) for s in stops if (i := text.find(s, start)) >= 0]
    if not hits:
        return None
    begin, minus_len = min(hits)           # the earliest; at one position, the longest
    return begin - minus_len if keep else begin


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that could begin a stop string (held back while streaming).
    Only prefixes ending in the text's last character can match, so only those are compared."""
    if not text:
        return 0
    best, last = 0, text[-1]
    for s in stops:
        k = s.rfind(last, 0, len(s) - 1)
        while k >= best:
            if text.endswith(s[:k + 1]):
                best = k + 1
                break
            k = s.rfind(last, 0, k)
    return best


def make_output(req: Request) -> RequestOutput:
    reason = req.finish_reason.value if req.finish_reason else None
    completion = CompletionOutput(0, req.text, list(req.output_token_ids), reason,
                                  list(req.output_logprobs) if req.params.logprobs is not None else None,
                                  req.error, req.error_status)
    metrics = {"arrival_time": req.arrival_time}
    if req.scheduled_time is not None:
        metrics["scheduled_time"] = req.scheduled_time
    if req.first_token_time is not None:
        metrics["first_token_time"] = req.first_token_time
    prompt_logprobs = list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None
    return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), [completion],
                         finished=req.is_finished, num_cached_tokens=req.num_cached_tokens, metrics=metrics,
                         prompt_logprobs=prompt_logprobs, embedding=req.embedding)



def mark_request_faults(failed: dict[str, str], requests: dict[str, Request], faults: tuple[str, ...]) -> None:
    """Give the requests that failed by their own parameters (`failed`: id -> why, one of `faults`)
    a 400 status: a 4xx for the client, not a server error."""
    for rid, why in failed.items():
        req = requests.get(rid)
        if req is not None and req.error_status is None and why in faults:
            req.error_status = 400
