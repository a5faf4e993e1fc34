"""What every endpoint shares: model-name and size checks, prompt intake off the event loop,
running a batch of submissions to completion (aborting when the client goes away) and
streaming it as SSE.

Intake (JSON parsing, chat templates, tokenization, embedding tensors) runs on a small thread
pool, after checks that cost nothing: a text prompt of more than `max_prompt_chars` characters
cannot fit the context (no text has more characters per token than the vocabulary's longest
token), so it is refused without tokenizing. Endpoint parsing and response shapes live in
`routes.py`.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from ..core.client import EngineClient, PromptInput, ServerUnavailable, Submission
from ..engine.inputs import num_tokens
from ..errors import EngineDeadError
from ..request import RequestOutput, SamplingParams
from .errors import APIError, ClientGone, bad_request, from_value_error, internal_error, overloaded
from .options import ServerOptions

log = logging.getLogger("stagewise.server")
MAX_CHOICES = 64               # prompts x n per HTTP request
MIN_CHARS_PER_TOKEN_BOUND = 64  # the prompt-characters bound per context token, at least
INTAKE_THREADS = 4
RETRY_AFTER_S = 1               # a waiting request leaves the queue within a few engine steps


def chars_per_token_bound(tok) -> int:
    """No text tokenizes to fewer tokens than len(text) / this: the vocabulary's longest token in
    characters (byte-level vocabularies spell one byte per character), at least 64."""
    try:
        longest = max((len(t) for t in tok.tokenizer.get_vocab()), default=0)
    except Exception:          # noqa: BLE001  (a tokenizer without a vocabulary listing: use the floor)
        longest = 0
    return max(MIN_CHARS_PER_TOKEN_BOUND, longest)


class Serving:
    def __init__(self, engine: EngineClient, model_name: str, options: ServerOptions | None = None, *,
                 aliases: tuple[str, ...] = (), images: Any = None):
        """`images`: the multimodal.intake.ImageIntake of a vision-language model, else None."""
        options = options or ServerOptions()
        self.engine = engine
        self.tok = engine.info.tok
        self.model_name = model_name
        self.accepted_names = {model_name, *aliases}
        self.max_model_len = engine.info.max_model_len
        self.kv_capacity_tokens = engine.info.kv_capacity_tokens
        self.vocab_size = engine.info.vocab_size
        self.grammar_limits = engine.info.grammar_limits
        self.body_timeout_s = options.body_timeout_s
        self.trust_request_chat_template = options.trust_request_chat_template
        self.cache_isolation = options.cache_isolation     # "shared" or "api-key": see `isolate`
        self.images = images
        self.default_max_tokens = options.default_max_tokens    # the server's default and largest max_tokens
        self.max_tokens_limit = options.max_tokens_limit
        self.max_logprob_entries = options.max_logprob_entries
        self.max_waiting_requests = options.max_waiting_requests
        self.max_waiting_per_key = options.max_waiting_requests_per_key or key_share(
            options.max_waiting_requests, len(options.api_keys))
        # key -> its place in --api-key (from 1): metrics never show keys
        self.api_keys = {key: place for place, key in enumerate(options.api_keys, 1)}
        self.intake_open = 0                     # requests being read or tokenized (event loop only)
        self.waiting_by_key: dict[int, int] = (dict.fromkeys(self.api_keys.values(), 0)    # per-key limit: each
                                               if self.max_waiting_per_key is not None else {})  # key's not started
        self.waiting_subs: dict[Submission, tuple[int, int]] = {}    # not yet started, of a key: (key, sequences)
        self.chars_per_token = chars_per_token_bound(self.tok)
        self.max_prompt_chars = self.max_model_len * self.chars_per_token
        self.intake = ThreadPoolExecutor(INTAKE_THREADS, thread_name_prefix="stagewise-intake")
        self.closed = False                      # the pools stopped (shutdown): queued work gets 503
        from .tools import default_parser
        self.tool_call_parser = options.tool_call_parser or default_parser(self.tok)

    async def read_body(self, raw: Request) -> bytes:
        """The whole body, within `body_timeout_s` (a trickling client must not hold a connection
        for as long as it likes); raises ClientGone if the client disconnects meanwhile."""
        try:
            return await asyncio.wait_for(raw.body(), self.body_timeout_s)
        except ClientDisconnect:
            raise ClientGone() from None
        except asyncio.TimeoutError:
            raise APIError(f"The request body did not arrive within {self.body_timeout_s:g} s; send it at once "
                           f"(or start the server with a larger --body-timeout).", 408, None, "timeout") from None

    async def off_loop(self, fn, *args):
        """Run a request's CPU work (parsing, templates, tokenization, tensors) on the intake threads.
        A request still queued for them when the server stops gets the documented 503."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.intake, fn, *args)
        except (asyncio.CancelledError, RuntimeError):
            if not self.closed:
                raise
            raise stopping() from None

    def refusal(self, headers) -> APIError | None:
        """Before a generation request's body is read: 429 while the waiting queue is full, or this
        request's API key's share of it, so a burst is refused in microseconds instead of queued (and
        parsed, and tokenized) for minutes. The guard asks first (no route runs); `admit` again."""
        limit, key = self.max_waiting_requests, self.key_of(headers)
        if key is not None and self.waiting_by_key.get(key, 0) >= (self.max_waiting_per_key or 0):
            return overloaded(self.max_waiting_per_key or 0, RETRY_AFTER_S, key)
        if limit is not None and self.intake_open + self.engine.num_waiting >= limit:
            return overloaded(limit, RETRY_AFTER_S)
        return None

    def admit(self, headers) -> int | None:
        """`refusal` raised, else the request counts as waiting from now: its key's place (per-key
        limit on) for `waited` / `submit`, else None."""
        error = self.refusal(headers)
        if error is not None:
            raise error
        key = self.key_of(headers)
        if key is not None:
            self.waiting_by_key[key] = self.waiting_by_key.get(key, 0) + 1
        return key

    def claim(self, key: int | None, seqs: int) -> int:
        """After intake, when the request's sequences (prompts x n) are known: they count in place of
        the one `admit` counted, against its key's share and the server's queue alike (every limit
        counts sequences). 429 if they do not fit now; 400 if they never could. Returns `seqs`."""
        per_key, limit = self.max_waiting_per_key, self.max_waiting_requests
        for cap, flag in ((per_key if key is not None else None, "--max-waiting-requests-per-key"),
                          (limit, "--max-waiting-requests")):
            if cap is not None and seqs > cap:
                raise bad_request(f"This request asks for {seqs} sequences (prompts x n), more than this server "
                                  f"lets wait at once ({cap}, {flag}); lower n or send fewer prompts.", "n")
        if key is not None and per_key is not None and self.waiting_by_key[key] - 1 + seqs > per_key:
            raise overloaded(per_key, RETRY_AFTER_S, key)
        if limit is not None and self.intake_open - 1 + self.engine.num_waiting + seqs > limit:
            raise overloaded(limit, RETRY_AFTER_S)
        if key is not None:
            self.waiting_by_key[key] += seqs - 1
        return seqs

    def tenant_of(self, headers) -> int | None:
        """The place of the request's API key when there are several keys (tenants), else None."""
        if len(self.api_keys) < 2:
            return None
        return self.api_keys.get(headers.get("authorization", "").partition(" ")[2].strip())

    def key_of(self, headers) -> int | None:
        """The place of the request's API key when keys have a waiting limit each (the guard checked it)."""
        if self.max_waiting_per_key is None:
            return None
        return self.api_keys.get(headers.get("authorization", "").partition(" ")[2].strip())

    def waited(self, key: int | None, seqs: int = 1) -> None:
        """A waiting request of `key` (`seqs` sequences) left the queue (it started, failed or its client left)."""
        if key is not None:
            self.waiting_by_key[key] -= seqs

    def started(self, sub: Submission) -> None:
        """The submission's first output arrived (or it ended): it no longer waits. Idempotent."""
        if self.waiting_subs:
            self.waited(*self.waiting_subs.pop(sub, (None, 0)))

    def release(self, sub: Submission) -> None:
        self.started(sub)
        self.engine.release(sub)

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters a request may name as its model (runtime loads and unloads change them)."""
        return tuple(self.engine.info.lora_names)

    # checks (intake threads)
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.accepted_names and name not in self.lora_names:
            raise APIError(f"The model {name[:200]!r} does not exist on this server; use {self.model_name!r} "
                           f"(see GET /v1/models).", 404, "model", "model_not_found")

    def adapter(self, name: str | None) -> dict:
        """The sampling field that runs a request on the LoRA adapter its `model` names ({} for the base model)."""
        return {"lora": name} if name is not None and name in self.lora_names else {}

    def check_choices(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > MAX_CHOICES:
            raise bad_request(f"This request asks for {num_prompts * n} completions; the limit is {MAX_CHOICES} "
                              f"(prompts x n).", "n")

    def check_logprob_entries(self, entries: int, param: str) -> None:
        """A response's prompt logprob entries are bounded: a 40 KB request could otherwise ask for
        hundreds of megabytes of them (the same prompt's entries repeated in each of n choices)."""
        if entries > self.max_logprob_entries:
            raise bad_request(f"This request asks for {entries} prompt logprob entries (prompt tokens x (1 + top-n) "
                              f"for each choice), more than this server answers ({self.max_logprob_entries}, "
                              f"--max-logprob-entries); lower n or the logprobs asked for, or send fewer prompts.",
                              param)

    def check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise bad_request(f"The prompt has {num_chars} characters, more than any prompt that fits the model's "
                              f"context of {self.max_model_len} tokens can have ({self.max_prompt_chars}); shorten "
                              f"it.", param, "context_length_exceeded")

    def text_input(self, text: str, param: str, add_special_tokens: bool | None = None,
                   truncating: bool = False) -> PromptInput:
        """`add_special_tokens` None: the tokenizer's default (vLLM's field, when a request sets it);
        a prompt to be truncated (`truncating`) may be longer than the context."""
        if not text:
            raise bad_request(f"{param} is empty; give at least one character.", param)
        if not truncating:
            self.check_chars(len(text), param)
        ids = (self.tok.encode(text) if add_special_tokens is None
               else self.tok.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return PromptInput(prompt_token_ids=ids, text=text)

    def truncated(self, prompt: PromptInput, k: int | None) -> PromptInput:
        """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (-1: the model's context)."""
        if k is None:
            return prompt
        if not (k == -1 or 1 <= k <= self.max_model_len):
            raise bad_request(f"truncate_prompt_tokens must be -1 or an integer in [1, {self.max_model_len}] (the "
                              f"model's context), got {k}.", "truncate_prompt_tokens")
        k = self.max_model_len if k == -1 else k
        if prompt.input_embeds is not None:
            return PromptInput(input_embeds=prompt.input_embeds[-k:]) if prompt.num_tokens > k else prompt
        ids = prompt.prompt_token_ids or []
        return prompt if len(ids) <= k else PromptInput(prompt_token_ids=ids[-k:])

    def max_tokens_for(self, prompt_len: int, requested: int | None, default: int | None,
                       param: str = "max_tokens", minimum: int = 1) -> int:
        """The explicit limit (checked against the context and the KV cache) or the default, capped to fit.
        `default` None means: the rest of the context; `minimum` 0 allows scoring a prompt only."""
        room = min(self.max_model_len, self.kv_capacity_tokens) - prompt_len
        if prompt_len >= self.max_model_len:
            raise bad_request(f"The prompt has {num_tokens(prompt_len)} but the model's context is "
                              f"{self.max_model_len}; "
                              f"shorten the prompt to leave room for output.", "prompt", "context_length_exceeded")
        if room < 1:
            raise bad_request(f"The prompt has {num_tokens(prompt_len)} but the KV cache holds only "
                              f"{self.kv_capacity_tokens}; shorten the prompt or start the server with a larger "
                              f"--kv-cache-memory.", "prompt", "context_length_exceeded")
        if requested is None:
            default = self.default_max_tokens or default
            return min(room, default or room, self.max_tokens_limit or room)
        if requested < minimum:
            raise bad_request(f"max_tokens must be an integer >= {minimum}, got {requested!r}.", param)
        if self.max_tokens_limit is not None and requested > self.max_tokens_limit:
            raise bad_request(f"{param.rsplit('.', 1)[-1]} asks for {requested} tokens, more than this server allows "
                              f"a request ({self.max_tokens_limit}, --max-tokens-limit); lower it.", param)
        if requested > room:
            limit = ("context is" if room == self.max_model_len - prompt_len else "KV cache holds")
            total = min(self.max_model_len, self.kv_capacity_tokens)
            raise bad_request(f"The prompt has {num_tokens(prompt_len)} and max_tokens asks for {requested} "
                              f"more, but the "
                              f"model's {limit} {total} tokens; lower max_tokens to at most {room}.",
                              param, "context_length_exceeded")
        return requested

    def isolate(self, raw: Request, params: list[SamplingParams]) -> None:
        """With cache isolation per API key, every request's cache_salt becomes a digest of the key it
        presented and the salt it named (if any): tenants share no prefix blocks, whatever they name."""
        if self.cache_isolation != "api-key":
            return
        key = raw.headers.get("authorization", "").partition(" ")[2].strip()
        for p in params:
            digest = hashlib.blake2b(key.encode() + b"\0" + (p.cache_salt or "").encode("utf-8", "surrogatepass"),
                                     digest_size=16, person=b"stagewise-salt").hexdigest()
            p.cache_salt = f"key:{digest}"

    # running (event loop)
    def submit(self, inputs: list[PromptInput], params: list[SamplingParams], key: int | None = None,
               seqs: int = 1, tenant: int | None = None) -> Submission:
        """Queue the requests now, so bad input is a 400 before any response (or stream) starts.
        `key`: the waiting request's (admit), its `seqs` counted (claim) until the submission starts.
        `tenant`: its API key's place (tenant_of), which the engine's scheduler alternates."""
        try:
            sub = self._submit(inputs, params, tenant)
        except BaseException:
            self.waited(key, seqs)
            raise
        if key is not None:
            self.waiting_subs[sub] = (key, seqs)
        return sub

    def _submit(self, inputs: list[PromptInput], params: list[SamplingParams], tenant: int | None) -> Submission:
        try:
            return self.engine.submit(inputs, params, tenant)
        except ServerUnavailable as exc:
            raise APIError(str(exc), 503, None, None, "service_unavailable") from None
        except EngineDeadError as exc:
            raise APIError(f"The engine is not running ({exc}); restart the server.", 503, None, None,
                           "service_unavailable") from None
        except ValueError as exc:
            raise from_value_error(exc) from None

    async def run(self, raw: Request, sub: Submission, param: str | None = None) -> list[RequestOutput]:
        """Wait for every final output; a client disconnect aborts them all (and frees their blocks).
        `param`: the field a request-caused failure names (its grammar's)."""
        finals: list[RequestOutput | None] = [None] * len(sub)

        async def consume():
            async with aclosing(self.engine.stream(sub)) as gen:
                async for i, out in gen:
                    self.started(sub)
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
            self.release(sub)
        if consumer not in done:
            raise ClientGone()
        consumer.result()
        done_outputs = [f for f in finals if f is not None]
        if len(done_outputs) < len(finals):          # released under us: only at shutdown
            raise APIError("The request was aborted because the server is shutting down; retry later.", 503,
                           None, None, "service_unavailable")
        failed = [f for f in done_outputs if f.outputs[0].finish_reason in ("error", "abort")]
        if failed:
            raise self.failure(failed[0], param)
        return done_outputs

    async def first_output(self, raw: Request, sub: Submission, param: str | None = None) -> None:
        """Wait for the submission's first output, left queued for the stream: a constrained stream
        starts only once its grammar compiled, so a bad one is a 4xx rather than an error event after
        a 200. Raises ClientGone (the client left: the requests are aborted) or the failure's APIError."""
        getter = asyncio.ensure_future(sub.queue.get())
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not getter.done():
            getter.cancel()
            self.release(sub)
            raise ClientGone()
        first = getter.result()
        self.started(sub)
        held = [first]
        while not sub.queue.empty():
            held.append(sub.queue.get_nowait())
        for out in held:                      # back in order: a stream keeps each request's newest
            sub.queue.put_nowait(out)
        if first.finished and first.outputs[0].finish_reason in ("error", "abort"):
            self.release(sub)
            raise self.failure(first, param)

    def streaming_response(self, sub: Submission, render: Callable[[int, RequestOutput], list[dict]],
                           tail: Callable[[list], list[dict]], param: str | None = None) -> StreamingResponse:
        # NOTE: the background task releases the submission even if the client leaves before the
        # body iterator ever starts (then its `finally` never runs).
        return StreamingResponse(self._sse(sub, render, tail, param), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(self.release, sub))

    def failure(self, out: RequestOutput, param: str | None = None) -> APIError:
        """The error a failed output answers with: 4xx when the request itself was at fault (`param`
        names its field), 503 when aborted, when the engine is down or its grammar compiler stopped
        (`error_status` 503), else 500 (details in the log)."""
        completion = out.outputs[0]
        status = completion.error_status
        if completion.finish_reason == "error" and status is not None and 400 <= status < 500:
            log.info("request %s failed: %s", out.request_id, completion.error)
            return APIError(completion.error or "The request failed.", status, param,
                            "timeout" if status == 408 else None)
        if completion.finish_reason == "abort" or status == 503 or not self.engine.is_healthy:
            return APIError(completion.error or "The request was aborted; retry later.", 503, None, None,
                            "service_unavailable")
        log.error("request %s failed in the engine: %s", out.request_id, completion.error or "no message")
        return internal_error()

    def usage(self, inputs: list[PromptInput], finals: list[RequestOutput], n: int) -> dict:
        prompt = sum(inp.num_tokens for inp in inputs[::n])      # each prompt counted once, as OpenAI does
        completion = sum(len(f.outputs[0].token_ids) for f in finals if f is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def _sse(self, sub: Submission, render, tail, param: str | None = None) -> AsyncIterator[str]:
        """`render(index, output)` chunks per update, `tail(finals)` at the end, then [DONE].
        An engine failure mid-stream, or the shutdown deadline, becomes one `{"error": ...}` event."""
        finals: list[RequestOutput | None] = [None] * len(sub)
        async with aclosing(self.engine.stream(sub)) as gen:
            async for i, out in gen:
                self.started(sub)
                if out.finished:
                    finals[i] = out
                    if out.outputs[0].finish_reason in ("error", "abort"):
                        yield sse_event(self.failure(out, param).body())
                        break
                for chunk in render(i, out):
                    yield sse_event(chunk)
            else:
                for chunk in tail(finals):
                    yield sse_event(chunk)
        yield "data: [DONE]\n\n"

    def close(self) -> None:
        self.closed = True
        self.intake.shutdown(wait=False, cancel_futures=True)
        if self.images is not None:
            self.images.close()


def stopping() -> APIError:
    return APIError("The server is shutting down; retry the request later (on another replica, or once it is back).",
                    503, None, None, "service_unavailable")


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


# NOTE: JSON allows these raw inside strings, but line splitters (str.splitlines, httpx aiter_lines)
# break lines at them, which would cut an SSE event in two; escaped, every event is one line.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"})


def sse_event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


def key_share(max_waiting: int | None, num_keys: int) -> int | None:
    """Each API key's share of the server's waiting queue when several keys share it and no
    --max-waiting-requests-per-key is given: one key's burst leaves room for the others."""
    if max_waiting is None or num_keys < 2:
        return None
    return max(1, -(-max_waiting // num_keys))
