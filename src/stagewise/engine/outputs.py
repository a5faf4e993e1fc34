"""Turning sampled tokens into user-facing results: stop rules, stop strings, RequestOutput."""
from __future__ import annotations

from ..request import CompletionOutput, FinishReason, Request, RequestOutput


def finish_check(req: Request, tok, max_model_len: int) -> FinishReason | None:
    """Update `req.text` for the newest token and say whether the request is done."""
    p = req.params
    token = req.output_token_ids[-1]
    full = tok.decode(req.output_token_ids, p.skip_special_tokens)
    n_out = len(req.output_token_ids)
    if p.stop and n_out >= p.min_tokens:
        cut = _find_stop(full, p.stop)
        if cut is not None:
            req.text = full[:cut]
            return FinishReason.STOP
    req.text = full if not p.stop else full[:len(full) - _partial_stop_len(full, p.stop)]
    if n_out >= p.min_tokens and (token in p.stop_token_ids or token in req.eos_token_ids):
        req.text = full
        return FinishReason.STOP
    if n_out >= p.max_tokens or req.num_tokens >= max_model_len:
        req.text = full
        return FinishReason.LENGTH
    return None


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that could begin a stop string (held back while streaming)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def make_output(req: Request) -> RequestOutput:
    reason = req.finish_reason.value if req.finish_reason else None
    completion = CompletionOutput(0, req.text, list(req.output_token_ids), reason,
                                  list(req.output_logprobs) if req.params.logprobs is not None else None,
                                  req.error)
    metrics = {"arrival_time": req.arrival_time}
    if req.first_token_time is not None:
        metrics["first_token_time"] = req.first_token_time
    return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), [completion],
                         finished=req.is_finished, num_cached_tokens=req.num_cached_tokens, metrics=metrics)
