"""What every endpoint shares: model-name and length checks, prompt intake, running a batch of
submissions to completion (aborting when the client goes away) and streaming it as SSE.

Endpoint-specific request parsing and response shapes live in `routes.py`.
"""
from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask

from ..errors import EngineDeadError
from ..request import RequestOutput, SamplingParams
from .bridge import AsyncEngine, PromptInput, ServerUnavailable, Submission
from .errors import APIError, bad_request, from_validation_error, from_value_error

log = logging.getLogger("stagewise.server")
MAX_CHOICES = 64            # prompts x n per HTTP request


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class Serving:
    def __init__(self, bridge: AsyncEngine, model_name: str, aliases: tuple[str, ...] = ()):
        self.bridge = bridge
        self.engine = bridge.engine
        self.tok = bridge.engine.tok
        self.model_name = model_name
        self.accepted_names = {model_name, *aliases}
        self.max_model_len = int(self.engine.max_model_len)
        # NOTE: block 0 is reserved by the block manager; the rest is what one request could ever hold.
        blocks = int(self.bridge.snapshot.get("num_kv_blocks", 0)) or int(self.engine.executor.num_blocks)
        self.kv_capacity_tokens = (blocks - 1) * int(self.engine.config.block_size)

    # parsing and checks
    async def parse(self, raw: Request, schema):
        body = await raw.body()
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"The request body is not valid JSON ({exc}); send a JSON object.",
                              code="invalid_json") from None
        if not isinstance(data, dict):
            raise bad_request(f"The request body must be a JSON object, not {type(data).__name__}.")
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from None

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.accepted_names:
            raise bad_request(f"The model {name!r} does not exist on this server; use {self.model_name!r} "
                              f"(see GET /v1/models).", "model", "model_not_found")

    def text_input(self, text: str, param: str) -> PromptInput:
        if not text:
            raise bad_request(f"{param} is empty; give at least one character.", param)
        return PromptInput(prompt_token_ids=self.tok.encode(text))

    def max_tokens_for(self, prompt_len: int, requested: int | None, default: int | None) -> int:
        """The explicit limit (checked against the context and the KV cache) or the default, capped to fit.
        `default` None means: the rest of the context."""
        room = min(self.max_model_len, self.kv_capacity_tokens) - prompt_len
        if prompt_len >= self.max_model_len:
            raise bad_request(f"The prompt has {prompt_len} tokens but the model's context is {self.max_model_len}; "
                              f"shorten the prompt to leave room for output.", "prompt", "context_length_exceeded")
        if room < 1:
            raise bad_request(f"The prompt has {prompt_len} tokens but the KV cache holds only "
                              f"{self.kv_capacity_tokens}; shorten the prompt or start the server with a larger "
                              f"--kv-cache-memory.", "prompt", "context_length_exceeded")
        if requested is None:
            return room if default is None else min(default, room)
        if not isinstance(requested, int) or requested < 1:
            raise bad_request(f"max_tokens must be an integer >= 1, got {requested!r}.", "max_tokens")
        if requested > room:
            limit = ("context is" if room == self.max_model_len - prompt_len else "KV cache holds")
            total = min(self.max_model_len, self.kv_capacity_tokens)
            raise bad_request(f"The prompt has {prompt_len} tokens and max_tokens asks for {requested} more, but the "
                              f"model's {limit} {total} tokens; lower max_tokens to at most {room}.",
                              "max_tokens", "context_length_exceeded")
        return requested

    # running
    def submit(self, inputs: list[PromptInput], params: list[SamplingParams]) -> Submission:
        """Queue the requests now, so bad input is a 400 before any response (or stream) starts."""
        if len(inputs) > MAX_CHOICES:
            raise bad_request(f"This request asks for {len(inputs)} completions; the limit is {MAX_CHOICES} "
                              f"(prompts x n).", "n")
        try:
            return self.bridge.submit(inputs, params)
        except ServerUnavailable as exc:
            raise APIError(str(exc), 503, None, None, "service_unavailable") from None
        except EngineDeadError as exc:
            raise APIError(f"The engine is not running ({exc}); restart the server.", 503, None, None,
                           "service_unavailable") from None
        except ValueError as exc:
            raise from_value_error(exc) from None

    async def run(self, raw: Request, sub: Submission) -> list[RequestOutput]:
        """Wait for every final output; a client disconnect aborts them all (and frees their blocks)."""
        finals: list[RequestOutput | None] = [None] * len(sub)

        async def consume():
            async with aclosing(self.bridge.stream(sub)) as gen:
                async for i, out in gen:
                    if out.finished:
                        finals[i] = out

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
                await asyncio.gather(consumer, return_exceptions=True)
            self.bridge.release(sub)
        if consumer not in done:
            raise ClientGone()
        consumer.result()
        if any(f is None for f in finals):          # released under us: only at shutdown
            raise APIError("The request was aborted because the server is shutting down; retry later.", 503,
                           None, None, "service_unavailable")
        failed = [f for f in finals if f.outputs[0].finish_reason in ("error", "abort")]
        if failed:
            raise self.failure(failed[0])
        return finals

    def streaming_response(self, sub: Submission, render: Callable[[int, RequestOutput], list[dict]],
                           tail: Callable[[list], list[dict]]) -> StreamingResponse:
        # NOTE: the background task releases the submission even if the client leaves before the
        # body iterator ever starts (then its `finally` never runs).
        return StreamingResponse(self._sse(sub, render, tail), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(self.bridge.release, sub))

    def failure(self, out: RequestOutput) -> APIError:
        completion = out.outputs[0]
        if completion.finish_reason == "abort" or not self.bridge.is_healthy:
            return APIError(completion.error or "The request was aborted; retry later.", 503, None, None,
                            "service_unavailable")
        return APIError(f"Generation failed: {completion.error or 'unknown engine error'}.", 500, None, None,
                        "server_error")

    def usage(self, inputs: list[PromptInput], finals: list[RequestOutput], n: int) -> dict:
        prompt = sum(inp.num_tokens for inp in inputs[::n])      # each prompt counted once, as OpenAI does
        completion = sum(len(f.outputs[0].token_ids) for f in finals if f is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def _sse(self, sub: Submission, render, tail) -> AsyncIterator[str]:
        """`render(index, output)` chunks per update, `tail(finals)` at the end, then [DONE].
        An engine failure mid-stream becomes one `{"error": ...}` event."""
        finals: list[RequestOutput | None] = [None] * len(sub)
        async with aclosing(self.bridge.stream(sub)) as gen:
            async for i, out in gen:
                if out.finished:
                    finals[i] = out
                    if out.outputs[0].finish_reason in ("error", "abort"):
                        yield _event(self.failure(out).body())
                        break
                for chunk in render(i, out):
                    yield _event(chunk)
            else:
                for chunk in tail(finals):
                    yield _event(chunk)
        yield "data: [DONE]\n\n"


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
