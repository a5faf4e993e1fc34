"""Response shapes: cumulative engine outputs as whole bodies and stream deltas, and engine
logprobs, in the OpenAI completions, OpenAI chat and native /generate forms."""
from __future__ import annotations

import logging
import time
import uuid

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


def native_logprobs(lps: list[TokenLogprob | None] | None) -> list[dict | None] | None:
    """Native shape; a None entry (the first prompt token, which nothing predicts) stays None."""
    if lps is None:
        return None
    return [None if lp is None else {"token_id": lp.token_id, "logprob": float(lp.logprob),
                                     "top": {str(t): float(v) for t, v in _sorted_top(lp)}} for lp in lps]


def _sorted_top(lp: TokenLogprob) -> list[tuple[int, float]]:
    return sorted((lp.top or {}).items(), key=lambda kv: -kv[1])


class Shape:
    """Response shapes for one endpoint: a whole body, stream chunks, and the stream's tail."""

    chunk_object = ""

    def __init__(self, serving, req=None, prefix: str = "cmpl"):
        self.serving, self.tok = serving, serving.tok
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = getattr(req, "n", 1)
        self.include_usage = bool(req is not None and req.stream_options and req.stream_options.include_usage)
        self.states: dict[int, StreamState] = {}

    def head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.serving.model_name}

    def state(self, i: int) -> StreamState:
        return self.states.setdefault(i, StreamState())

    def tail(self, inputs, finals) -> list[dict]:
        if not self.include_usage:
            return []
        return [dict(self.head(self.chunk_object), choices=[], usage=self.serving.usage(inputs, finals, self.n))]

    def chunk(self, choice: dict) -> dict:
        chunk = dict(self.head(self.chunk_object), choices=[choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk


class CompletionShape(Shape):
    chunk_object = "text_completion"

    def __init__(self, serving, req):
        super().__init__(serving, req, "cmpl")
        self.logprobs = req.logprobs is not None

    def body(self, inputs, finals: list[RequestOutput]) -> dict:
        choices = [{"index": i, "text": f.outputs[0].text, "finish_reason": f.outputs[0].finish_reason,
                    "logprobs": completion_logprobs(self.tok, f.outputs[0].logprobs) if self.logprobs else None}
                   for i, f in enumerate(finals)]
        return dict(self.head("text_completion"), choices=choices, usage=self.serving.usage(inputs, finals, self.n))

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        st = self.state(i)
        text, lps = st.advance(out)
        if not text and not out.finished and not lps:
            return []
        lp = completion_logprobs(self.tok, lps, st.offset_before) if self.logprobs else None
        if lp:
            st.offset_before += sum(len(t) for t in lp["tokens"])
        return [self.chunk({"index": i, "text": text, "logprobs": lp, "finish_reason": out.outputs[0].finish_reason})]


class ChatShape(Shape):
    chunk_object = "chat.completion.chunk"

    def __init__(self, serving, req):
        super().__init__(serving, req, "chatcmpl")
        self.logprobs = req.logprobs

    def body(self, inputs, finals: list[RequestOutput]) -> dict:
        choices = [{"index": i, "message": {"role": "assistant", "content": f.outputs[0].text},
                    "logprobs": chat_logprobs(self.tok, f.outputs[0].logprobs) if self.logprobs else None,
                    "finish_reason": f.outputs[0].finish_reason} for i, f in enumerate(finals)]
        return dict(self.head("chat.completion"), choices=choices, usage=self.serving.usage(inputs, finals, self.n))

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        st, chunks = self.state(i), []
        if not st.started:
            st.started = True
            chunks.append(self.chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}))
        text, lps = st.advance(out)
        if text or lps or out.finished:
            delta = {"content": text} if text else {}
            lp = chat_logprobs(self.tok, lps) if self.logprobs else None
            chunks.append(self.chunk({"index": i, "delta": delta, "logprobs": lp,
                                      "finish_reason": out.outputs[0].finish_reason}))
        return chunks


class NativeShape(Shape):
    chunk_object = "generate.chunk"

    def __init__(self, serving):
        super().__init__(serving, None, "gen")

    def body(self, inputs, finals: list[RequestOutput]) -> dict:
        out = finals[0]
        c = out.outputs[0]
        return {"id": self.id, "text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                "logprobs": native_logprobs(c.logprobs), "prompt_logprobs": native_logprobs(out.prompt_logprobs),
                "num_cached_tokens": out.num_cached_tokens, "usage": self.serving.usage(inputs, finals, 1)}

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        st = self.state(i)
        ids_before = st.num_tokens
        text, lps = st.advance(out)
        ids = out.outputs[0].token_ids[ids_before:st.num_tokens]
        if not text and not ids and not out.finished:
            return []
        return [{"id": self.id, "text": text, "token_ids": list(ids), "finish_reason": out.outputs[0].finish_reason,
                 "logprobs": native_logprobs(lps)}]

    def tail(self, inputs, finals) -> list[dict]:
        return [{"id": self.id, "prompt_logprobs": native_logprobs(finals[0].prompt_logprobs),
                 "usage": self.serving.usage(inputs, finals, 1)}]
