"""Engine outputs as deltas, so what crosses from the engine process to the server per step is
O(new tokens), not O(whole output): the engine side (`DeltaEncoder`) sends each request's new
token ids, new logprob entries and the change of its text; the server side (`OutputAssembler`)
rebuilds the cumulative `RequestOutput` the response shapes read.

Token ids and logprob lists only ever grow; the shown text usually grows too, but a stop string
can cut text held back earlier, so the text travels as (characters kept, new tail).
"""
from __future__ import annotations

from os.path import commonprefix

from ..request import CompletionOutput, RequestOutput

# one delta: (request id, text chars kept, text tail, new token ids, new logprobs | None,
#             new prompt logprobs | None, finish reason, error, finished, cached tokens, first-token time)
Delta = tuple


class DeltaEncoder:
    """Engine side: remembers what each unfinished request has sent."""

    def __init__(self):
        self._sent: dict[str, tuple[str, int, int, int]] = {}   # id -> (text, ids, logprobs, prompt logprobs)

    def encode(self, out: RequestOutput) -> Delta:
        c = out.outputs[0]
        text, n_ids, n_lps, n_plps = self._sent.pop(out.request_id, ("", 0, 0, 0))
        keep = len(text) if c.text.startswith(text) else len(commonprefix([text, c.text]))
        lps = None if c.logprobs is None else c.logprobs[n_lps:]
        plps = None if out.prompt_logprobs is None else out.prompt_logprobs[n_plps:]
        if not out.finished:
            self._sent[out.request_id] = (c.text, len(c.token_ids), n_lps + len(lps or ()),
                                          n_plps + len(plps or ()))
        return (out.request_id, keep, c.text[keep:], c.token_ids[n_ids:], lps, plps, c.finish_reason, c.error,
                out.finished, out.num_cached_tokens, out.metrics.get("first_token_time"))


class _Output:
    __slots__ = ("text", "ids", "lps", "plps")

    def __init__(self):
        self.text, self.ids, self.lps, self.plps = "", [], None, None


class OutputAssembler:
    """Server side: the cumulative output of every request with deltas in flight."""

    def __init__(self):
        self._outputs: dict[str, _Output] = {}

    def apply(self, delta: Delta, prompt_token_ids: list[int], arrival_time: float | None) -> RequestOutput:
        rid, keep, tail, ids, lps, plps, reason, error, finished, num_cached, first = delta
        acc = self._outputs.pop(rid, None) or _Output()
        acc.text = acc.text[:keep] + tail if keep < len(acc.text) else acc.text + tail
        acc.ids.extend(ids)
        if lps is not None:
            acc.lps = acc.lps if acc.lps is not None else []
            acc.lps.extend(lps)
        if plps is not None:
            acc.plps = acc.plps if acc.plps is not None else []
            acc.plps.extend(plps)
        if not finished:
            self._outputs[rid] = acc
        metrics = {} if arrival_time is None else {"arrival_time": arrival_time}
        if first is not None:
            metrics["first_token_time"] = first
        # NOTE: copies: a queued output must not change when the next delta arrives
        completion = CompletionOutput(0, acc.text, list(acc.ids), reason, None if acc.lps is None else list(acc.lps),
                                      error)
        return RequestOutput(rid, None, prompt_token_ids, [completion], finished=finished, num_cached_tokens=num_cached,
                             metrics=metrics, prompt_logprobs=None if acc.plps is None else list(acc.plps))

    def clear(self) -> None:
        self._outputs.clear()
