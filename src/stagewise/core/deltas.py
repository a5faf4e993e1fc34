"""Engine outputs as deltas: the core's `DeltaEncoder` turns each cumulative `RequestOutput` into
an `OutputDelta` (new token ids, new logprob entries, the change of its text); the client's
`OutputAssembler` rebuilds the cumulative output that response shapes read. Token ids and
logprob lists only ever grow; the text travels as (characters kept, new tail).
"""
from __future__ import annotations

from os.path import commonprefix

from ..request import CompletionOutput, RequestOutput, TokenLogprob
from .wire import OutputDelta


class DeltaEncoder:
    """Core side: remembers what each unfinished request has sent."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[str, int, int, int]] = {}   # id -> (text, ids, logprobs, prompt logprobs)

    def encode(self, out: RequestOutput) -> OutputDelta:
        c = out.outputs[0]
        text, n_ids, n_lps, n_plps = self._sent.pop(out.request_id, ("", 0, 0, 0))
        keep = len(text) if c.text.startswith(text) else len(commonprefix([text, c.text]))
        lps = None if c.logprobs is None else c.logprobs[n_lps:]
        plps = None if out.prompt_logprobs is None else out.prompt_logprobs[n_plps:]
        if not out.finished:
            self._sent[out.request_id] = (c.text, len(c.token_ids), n_lps + len(lps or ()),
                                          n_plps + len(plps or ()))
        return OutputDelta(out.request_id, keep, c.text[keep:], c.token_ids[n_ids:], lps, plps, c.finish_reason,
                           c.error, out.finished, out.num_cached_tokens, out.metrics.get("first_token_time"),
                           out.metrics.get("scheduled_time"), c.error_status, out.embedding)


class _Output:
    __slots__ = ("text", "ids", "lps", "plps")

    def __init__(self) -> None:
        self.text = ""
        self.ids: list[int] = []
        self.lps: list[TokenLogprob] | None = None
        self.plps: list[TokenLogprob | None] | None = None


class OutputAssembler:
    """Client side: the cumulative output of every request with deltas in flight."""

    def __init__(self) -> None:
        self._outputs: dict[str, _Output] = {}

    def apply(self, d: OutputDelta, prompt_token_ids: list[int], arrival_time: float | None) -> RequestOutput:
        acc = self._outputs.pop(d.request_id, None) or _Output()
        acc.text = acc.text[:d.text_kept] + d.text_tail if d.text_kept < len(acc.text) else acc.text + d.text_tail
        acc.ids.extend(d.new_token_ids)
        if d.new_logprobs is not None:
            acc.lps = acc.lps if acc.lps is not None else []
            acc.lps.extend(d.new_logprobs)
        if d.new_prompt_logprobs is not None:
            acc.plps = acc.plps if acc.plps is not None else []
            acc.plps.extend(d.new_prompt_logprobs)
        if not d.finished:
            self._outputs[d.request_id] = acc
        metrics = {} if arrival_time is None else {"arrival_time": arrival_time}
        if d.first_token_time is not None:
            metrics["first_token_time"] = d.first_token_time
        if d.scheduled_time is not None:
            metrics["scheduled_time"] = d.scheduled_time
        # NOTE: copies: a queued output must not change when the next delta arrives
        completion = CompletionOutput(0, acc.text, list(acc.ids), d.finish_reason,
                                      None if acc.lps is None else list(acc.lps), d.error, d.error_status)
        return RequestOutput(d.request_id, None, prompt_token_ids, [completion], finished=d.finished,
                             num_cached_tokens=d.num_cached_tokens, metrics=metrics,
                             prompt_logprobs=None if acc.plps is None else list(acc.plps), embedding=d.embedding)

    def clear(self) -> None:
        self._outputs.clear()
