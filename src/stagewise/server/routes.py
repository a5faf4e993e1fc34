"""The generation endpoints: /v1/completions, /v1/chat/completions and the native /generate.

Each parses and checks its request, submits (prompts x n) engine requests, and answers with
one JSON body or an SSE stream. Defaults for max_tokens: completions 16 (OpenAI's default),
chat the rest of the context, /generate 16 (SamplingParams' default, as offline `LLM`).
"""
from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..request import RequestOutput
from .bridge import PromptInput
from .errors import bad_request
from .formatting import StreamState, chat_logprobs, completion_logprobs, native_logprobs
from .protocol import (DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest, CompletionRequest, GenerateRequest,
                       make_sampling_params, native_sampling_fields)
from .serving import ClientGone, Serving

CLIENT_GONE = 499            # nginx's "client closed request": logged, never seen by anyone


async def completions(serving: Serving, raw: Request) -> Response:
    req = await serving.parse(raw, CompletionRequest)
    serving.check_model(req.model)
    req.check_unsupported()
    prompts = _completion_prompts(serving, req.prompt)
    inputs, params = [], []
    for prompt in prompts:
        max_tokens = serving.max_tokens_for(prompt.num_tokens, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
        for j in range(req.n):
            inputs.append(prompt)
            params.append(make_sampling_params(req.sampling_kwargs(), max_tokens, req.logprobs, j))
    return await _answer(serving, raw, req, inputs, params, _CompletionShape(serving, req))


async def chat_completions(serving: Serving, raw: Request) -> Response:
    req = await serving.parse(raw, ChatCompletionRequest)
    serving.check_model(req.model)
    req.check_unsupported()
    messages = [m.as_template_dict(i) for i, m in enumerate(req.messages)]
    try:
        text = serving.tok.chat_prompt(messages)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    prompt = serving.text_input(text, "messages")
    max_tokens = serving.max_tokens_for(prompt.num_tokens, req.requested_max_tokens, None)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = [make_sampling_params(req.sampling_kwargs(), max_tokens, logprobs, j) for j in range(req.n)]
    return await _answer(serving, raw, req, [prompt] * req.n, params, _ChatShape(serving, req))


async def generate(serving: Serving, raw: Request) -> Response:
    req = await serving.parse(raw, GenerateRequest)
    serving.check_model(req.model)
    req.check()
    if req.text is not None:
        prompt = serving.text_input(req.text, "text")
    elif req.input_ids is not None:
        prompt = PromptInput(prompt_token_ids=list(req.input_ids))
        if not prompt.prompt_token_ids:
            raise bad_request("input_ids is empty; give at least one token id.", "input_ids")
    else:
        prompt = PromptInput(input_embeds=_embeds_tensor(req.input_embeds))
    fields = native_sampling_fields(req.sampling_params)
    requested, logprobs = fields.pop("max_tokens", None), fields.pop("logprobs", None)
    max_tokens = serving.max_tokens_for(prompt.num_tokens, requested, 16)
    params = [make_sampling_params(fields, max_tokens, logprobs)]
    return await _answer(serving, raw, req, [prompt], params, _NativeShape(serving))


async def _answer(serving: Serving, raw: Request, req, inputs, params, shape) -> Response:
    sub = serving.submit(inputs, params)
    if req.stream:
        include_usage = bool(getattr(req, "stream_options", None) and req.stream_options.include_usage)
        return serving.streaming_response(sub, shape.chunks, lambda finals: shape.tail(inputs, finals, include_usage))
    try:
        finals = await serving.run(raw, sub)
    except ClientGone:
        return Response(status_code=CLIENT_GONE)
    return JSONResponse(shape.body(inputs, finals))


def _completion_prompts(serving: Serving, prompt) -> list[PromptInput]:
    if isinstance(prompt, str):
        return [serving.text_input(prompt, "prompt")]
    if not prompt:
        raise bad_request("prompt is empty; give a string, a list of strings or a list of token ids.", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [PromptInput(prompt_token_ids=list(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [serving.text_input(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    for i, ids in enumerate(prompt):
        if not ids:
            raise bad_request(f"prompt[{i}] is an empty list of token ids; give at least one.", "prompt")
    return [PromptInput(prompt_token_ids=list(ids)) for ids in prompt]


def _embeds_tensor(rows: list[list[float]]):
    import torch
    if not rows:
        raise bad_request("input_embeds is empty; give [num_tokens][hidden_size] numbers.", "input_embeds")
    if len({len(r) for r in rows}) != 1:
        raise bad_request("input_embeds rows differ in length; every row needs hidden_size numbers.", "input_embeds")
    return torch.tensor(rows, dtype=torch.float32)    # [T, H]


class _Shape:
    """Response shapes for one endpoint: a whole body, stream chunks, and the stream's tail."""

    object_name = ""

    def __init__(self, serving: Serving, req=None, prefix: str = "cmpl"):
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

    def tail(self, inputs, finals, include_usage: bool) -> list[dict]:
        if not include_usage:
            return []
        return [dict(self.head(self.chunk_object), choices=[], usage=self.serving.usage(inputs, finals, self.n))]

    def chunk(self, choice: dict) -> dict:
        chunk = dict(self.head(self.chunk_object), choices=[choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk


class _CompletionShape(_Shape):
    chunk_object = "text_completion"

    def __init__(self, serving, req: CompletionRequest):
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


class _ChatShape(_Shape):
    chunk_object = "chat.completion.chunk"

    def __init__(self, serving, req: ChatCompletionRequest):
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


class _NativeShape(_Shape):
    chunk_object = "generate.chunk"

    def __init__(self, serving):
        super().__init__(serving, None, "gen")

    def body(self, inputs, finals: list[RequestOutput]) -> dict:
        out = finals[0]
        c = out.outputs[0]
        return {"id": self.id, "text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                "logprobs": native_logprobs(c.logprobs), "num_cached_tokens": out.num_cached_tokens,
                "usage": self.serving.usage(inputs, finals, 1)}

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        st = self.state(i)
        ids_before = st.num_tokens
        text, lps = st.advance(out)
        ids = out.outputs[0].token_ids[ids_before:st.num_tokens]
        if not text and not ids and not out.finished:
            return []
        return [{"id": self.id, "text": text, "token_ids": list(ids), "finish_reason": out.outputs[0].finish_reason,
                 "logprobs": native_logprobs(lps)}]

    def tail(self, inputs, finals, include_usage: bool) -> list[dict]:
        return [{"id": self.id, "usage": self.serving.usage(inputs, finals, 1)}]
