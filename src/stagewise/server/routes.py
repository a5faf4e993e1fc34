"""The generation endpoints: /v1/completions, /v1/chat/completions and the native /generate.

Each reads its body on the event loop, then parses, checks and tokenizes it on the intake
threads into a `Job` (prompts x n engine requests), submits it and answers with one JSON body
or an SSE stream. Defaults for max_tokens: completions 16 (OpenAI's default), chat the rest of
the context, /generate 16 (SamplingParams' default, as offline `LLM`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..core.client import PromptInput
from ..grammar.limits import GrammarRefused, check_limits
from ..request import SamplingParams, StructuredOutputs
from .completions import CompletionShape
from .errors import ClientGone, bad_request
from .formatting import ChatShape, NativeShape, Shape
from .harmony import STOP_TOKENS as HARMONY_STOPS
from .image_jobs import ImagesJob, run_images_job
from .intake import parse_request
from .protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    make_sampling_params,
)
from .responses import ResponsesRequest, ResponsesShape, format_of, input_messages
from .serving import Serving
from .tools import check_tools, constraint_for, prepare_chat, tool_choice_of

log = logging.getLogger("stagewise.server")
CLIENT_GONE = 499            # nginx's "client closed request": logged, never seen by anyone


@dataclass
class Job:
    inputs: list[PromptInput]
    params: list[SamplingParams]
    shape: Shape
    stream: bool
    grammar_param: str | None = None         # the field a grammar failure names


async def completions(serving: Serving, raw: Request) -> Response:
    return await _serve(serving, raw, completion_job)


async def chat_completions(serving: Serving, raw: Request) -> Response:
    return await _serve(serving, raw, chat_job)


async def responses(serving: Serving, raw: Request) -> Response:
    return await _serve(serving, raw, responses_job)


async def generate(serving: Serving, raw: Request) -> Response:
    return await _serve(serving, raw, generate_job)


async def _serve(serving: Serving, raw: Request, make_job: Callable[[Serving, bytes], Job | ImagesJob]) -> Response:
    key = serving.admit(raw.headers)      # per-key limit on: the key's place, counted until the request starts
    serving.intake_open += 1              # until submitted (no await between): then the engine client counts it
    try:
        body = await serving.read_body(raw)
        job = await serving.off_loop(make_job, serving, body)
        if isinstance(job, ImagesJob):
            job = await run_images_job(serving, job)
        serving.isolate(raw, job.params)
        seqs = serving.claim(key, len(job.inputs))       # last: it raises before it counts
    except ClientGone:
        serving.waited(key)
        # NOTE: a client leaving is not a server fault: no traceback, no warning
        log.debug("client left while sending %s %s", raw.method, raw.url.path)
        return Response(status_code=CLIENT_GONE)
    except BaseException:
        serving.waited(key)
        raise
    finally:
        serving.intake_open -= 1
    return await _answer(serving, raw, job, key, seqs)


def completion_job(serving: Serving, body: bytes) -> Job:
    req = parse_request(body, CompletionRequest)
    serving.check_model(req.model)
    req.check_unsupported()
    prompts = [serving.truncated(p, req.truncate_prompt_tokens) for p in _completion_prompts(serving, req)]
    inputs, params, fields = [], [], dict(req.sampling_kwargs(), **serving.adapter(req.model))
    grammar, source = req.structured_spec()
    grammar = checked_grammar(serving, grammar, source)
    if grammar is not None:
        fields["structured_outputs"] = grammar
    entries = 0
    for prompt in prompts:
        # echo with max_tokens 0 scores the prompt only; the engine computes prompt logprobs for echo
        # with logprobs, and for vLLM's prompt_logprobs
        max_tokens = serving.max_tokens_for(prompt.num_tokens, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS,
                                            minimum=0 if req.echo or req.prompt_logprobs is not None else 1)
        scored = req.echo and (req.logprobs is not None or max_tokens == 0)
        prompt_lps = _max_or_none((req.logprobs or 0) if scored else None, req.prompt_logprobs)
        entries += req.n * prompt.num_tokens * (_entries_per_token(req.logprobs if req.echo else None)
                                                + _entries_per_token(req.prompt_logprobs))
        for j in range(req.n):
            inputs.append(prompt)
            params.append(make_sampling_params(fields, max_tokens, req.logprobs, j,
                                               prompt_logprobs=_choice_prompt_logprobs(j, prompt_lps, max_tokens)))
    serving.check_logprob_entries(entries, "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs")
    return Job(inputs, params, CompletionShape(serving, req, inputs), req.stream, source)


def _entries_per_token(top_n: int | None) -> int:
    return 0 if top_n is None else 1 + top_n


def _choice_prompt_logprobs(j: int, prompt_lps: int | None, max_tokens: int) -> int | None:
    """The prompt's first choice scores it for all n (the shapes share its entries); the others
    score nothing, unless max_tokens 0 leaves scoring as the only thing a request may do."""
    if j == 0 or prompt_lps is None:
        return prompt_lps
    return 0 if max_tokens == 0 else None


def chat_job(serving: Serving, body: bytes) -> Job | ImagesJob:
    req = parse_request(body, ChatCompletionRequest)
    serving.check_model(req.model)
    req.check_unsupported()
    serving.check_choices(1, req.n)
    tools = check_tools(req.tools)
    mode = tool_choice_of(req.tool_choice, tools)
    grammar, source = req.structured_spec(req.response_format)
    if mode not in ("none", "auto") and grammar is not None:
        raise bad_request("tool_choice 'required' or a named function constrains the output already; drop "
                          "response_format or structured outputs.", "tool_choice")
    grammar = checked_grammar(serving, grammar or constraint_for(mode, tools, req.parallel_tool_calls is not False),
                              source)
    if len(req.messages) >= serving.max_model_len:
        raise bad_request(f"The conversation has {len(req.messages)} messages, more than the model's context of "
                          f"{serving.max_model_len} tokens can hold; shorten it.", "messages",
                          "context_length_exceeded")
    images = serving.images.parts() if serving.images is not None else None
    messages = [m.as_template_dict(i, images) for i, m in enumerate(req.messages)]
    truncating = req.truncate_prompt_tokens is not None
    if not truncating:
        serving.check_chars(sum(len(m["content"] or "") for m in messages), "messages")
    options = req.template_options(serving.trust_request_chat_template)
    if serving.tool_call_parser == "harmony" and req.reasoning_effort is not None:
        # gpt-oss's template writes it into the system message ("Reasoning: high")
        options["template_kwargs"] = {"reasoning_effort": req.reasoning_effort, **options.get("template_kwargs", {})}
    text = render_chat(serving, messages, options, tools if mode != "none" else None)

    def finish(prompt: PromptInput) -> Job:
        return _chat_job(serving, req, prompt, grammar, ChatShape(serving, req, messages, mode), source)
    if images:            # fetched and decoded in the image pools (image_jobs.py), then finished there
        return ImagesJob(text, images, finish)
    return finish(serving.text_input(text, "messages", req.add_special_tokens, truncating))


def _chat_job(serving: Serving, req: ChatCompletionRequest, prompt: PromptInput, grammar, shape: Shape,
              source: str | None) -> Job:
    prompt = serving.truncated(prompt, req.truncate_prompt_tokens)
    max_tokens = serving.max_tokens_for(prompt.num_tokens, req.requested_max_tokens, None,
                                        minimum=0 if req.prompt_logprobs is not None else 1)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    fields = dict(req.sampling_kwargs(), **serving.adapter(req.model),
                  **({"structured_outputs": grammar} if grammar is not None else {}))
    if serving.tool_call_parser == "harmony":
        fields.update(harmony_fields(serving, fields))
    serving.check_logprob_entries(prompt.num_tokens * _entries_per_token(req.prompt_logprobs), "prompt_logprobs")
    params = [make_sampling_params(fields, max_tokens, logprobs, j,
                                   prompt_logprobs=_choice_prompt_logprobs(j, req.prompt_logprobs, max_tokens))
              for j in range(req.n)]
    return Job([prompt] * req.n, params, shape, req.stream, source)


def harmony_fields(serving: Serving, fields: dict) -> dict:
    """gpt-oss: the channel tokens stay in the text (the reply is read from them) and <|call|> and
    <|return|> end the turn, whatever the checkpoint's generation config lists."""
    vocab = serving.tok.tokenizer.get_vocab()
    known = [vocab[t] for t in HARMONY_STOPS if t in vocab]
    return {"skip_special_tokens": False,
            "stop_token_ids": list(dict.fromkeys(list(fields.get("stop_token_ids") or []) + known))}


def responses_job(serving: Serving, body: bytes) -> Job:
    req = parse_request(body, ResponsesRequest)
    serving.check_model(req.model)
    req.check_unsupported()
    tools = check_tools(req.tools, flat=True)
    mode = tool_choice_of(req.tool_choice, tools)
    fmt = format_of(req)
    grammar, source = req.structured_spec()
    if fmt is not None and grammar is None:
        grammar, source = StructuredOutputs.from_dict(fmt), "text.format"
    if mode not in ("none", "auto") and grammar is not None:
        raise bad_request("tool_choice 'required' or a named function constrains the output already; drop "
                          "text.format.", "tool_choice")
    grammar = checked_grammar(serving, grammar or constraint_for(mode, tools, req.parallel_tool_calls is not False),
                              source)
    prompt = chat_prompt(serving, input_messages(req), tools if mode != "none" else None)
    max_tokens = serving.max_tokens_for(prompt.num_tokens, req.max_output_tokens, None, "max_output_tokens")
    fields = dict(req.sampling_kwargs(), **serving.adapter(req.model),
                  **({"structured_outputs": grammar} if grammar is not None else {}))
    if serving.tool_call_parser == "harmony":
        fields.update(harmony_fields(serving, fields))
    params = [make_sampling_params(fields, max_tokens, None)]
    return Job([prompt], params, ResponsesShape(serving, req, tools, mode, max_tokens), req.stream, source)


def chat_prompt(serving: Serving, messages: list[dict], tools: list[dict] | None) -> PromptInput:
    """A conversation (template dicts) rendered and tokenized, after the checks that cost nothing."""
    if len(messages) >= serving.max_model_len:
        raise bad_request(f"The conversation has {len(messages)} messages, more than the model's context of "
                          f"{serving.max_model_len} tokens can hold; shorten it.", "messages",
                          "context_length_exceeded")
    serving.check_chars(sum(len(m["content"] or "") for m in messages), "messages")
    return serving.text_input(render_chat(serving, messages, None, tools), "messages")


def checked_grammar(serving: Serving, spec: StructuredOutputs | None, param: str) -> StructuredOutputs | None:
    """A grammar within the server's limits (size, depth, alternatives: a linear check, once per
    request), or a 400 naming the field. Its syntax is checked where it compiles (in the engine's
    compile supervisor), before any output."""
    if spec is not None:
        try:
            check_limits(*spec.key, serving.grammar_limits)
        except (GrammarRefused, ValueError, RecursionError) as exc:
            raise bad_request(str(exc) if isinstance(exc, ValueError) else "The JSON schema nests too deeply.",
                              param) from None
    return spec


def generate_job(serving: Serving, body: bytes) -> Job:
    req = parse_request(body, GenerateRequest)
    serving.check_model(req.model)
    req.check()
    if req.text is not None:
        prompt = serving.text_input(req.text, "text")
    elif req.input_ids is not None:
        prompt = _ids_input(serving, req.input_ids, "input_ids")
    else:
        prompt = PromptInput(input_embeds=_embeds_tensor(serving, req.input_embeds))
    sp = req.sampling_params
    prompt = serving.truncated(prompt, sp.truncate_prompt_tokens)
    max_tokens = serving.max_tokens_for(prompt.num_tokens, sp.max_tokens, 16, "sampling_params.max_tokens",
                                        minimum=0 if sp.prompt_logprobs is not None else 1)
    fields = dict(sp.sampling_kwargs(), **serving.adapter(req.model))
    grammar, source = sp.grammar_spec()
    grammar = checked_grammar(serving, grammar, source)
    if grammar is not None:
        fields["structured_outputs"] = grammar
    serving.check_logprob_entries(prompt.num_tokens * _entries_per_token(sp.prompt_logprobs),
                                  "sampling_params.prompt_logprobs")
    params = [make_sampling_params(fields, max_tokens, sp.logprobs, param_prefix="sampling_params.",
                                   prompt_logprobs=sp.prompt_logprobs)]
    return Job([prompt], params, NativeShape(serving), req.stream, source)


async def _answer(serving: Serving, raw: Request, job: Job, key: int | None = None, seqs: int = 1) -> Response:
    sub = serving.submit(job.inputs, job.params, key, seqs, serving.tenant_of(raw.headers))
    if job.stream:
        if any(p.grammar is not None for p in job.params):
            try:
                await serving.first_output(raw, sub, job.grammar_param)
            except ClientGone:
                return Response(status_code=CLIENT_GONE)
        return serving.streaming_response(sub, job.shape.render, lambda finals: job.shape.tail(job.inputs, finals),
                                          job.grammar_param)
    try:
        finals = await serving.run(raw, sub, job.grammar_param)
    except ClientGone:
        return Response(status_code=CLIENT_GONE)
    if isinstance(job.shape, CompletionShape):
        # NOTE: sent in pieces, shaped on worker threads: the body may carry a million logprob entries
        return StreamingResponse(job.shape.body_pieces(job.inputs, finals), media_type="application/json")
    # NOTE: a long echoed prompt with logprobs takes a decode per token: shape it off the event loop
    return JSONResponse(await serving.off_loop(job.shape.body, job.inputs, finals))


def render_chat(serving: Serving, messages: list[dict], options: dict | None = None,
                tools: list[dict] | None = None) -> str:
    """The conversation through the chat template (tools: see server/tools.py)."""
    options = dict(options or {})
    try:
        template = options.get("chat_template") or getattr(serving.tok.tokenizer, "chat_template", None)
        messages, extra = prepare_chat(template,
                                       messages, tools, serving.tool_call_parser)
        if extra:
            options["template_kwargs"] = dict(options.get("template_kwargs") or {}, **extra)
        return serving.tok.chat_prompt(messages, **options)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    except Exception as exc:
        # NOTE: templates reject conversations they cannot render (roles out of order, ...) with
        # jinja2's raise_exception; that is a bad request, anything else is a server fault.
        if type(exc).__module__.split(".")[0] != "jinja2":
            raise
        raise bad_request(f"The model's chat template rejected these messages: {str(exc)[:300]}", "messages") from None


def _max_or_none(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _completion_prompts(serving: Serving, req: CompletionRequest) -> list[PromptInput]:
    prompt, n = req.prompt, req.n
    special, truncating = req.add_special_tokens, req.truncate_prompt_tokens is not None
    if isinstance(prompt, str):
        serving.check_choices(1, n)
        return [serving.text_input(prompt, "prompt", special, truncating)]
    if not prompt:
        raise bad_request("prompt is empty; give a string, a list of strings or a list of token ids.", "prompt")
    if isinstance(prompt[0], int):          # the schema allows only all-int, all-str or all-list lists
        serving.check_choices(1, n)
        return [_ids_input(serving, prompt, "prompt")]
    serving.check_choices(len(prompt), n)
    if isinstance(prompt[0], str):
        return [serving.text_input(p, f"prompt[{i}]", special, truncating) for i, p in enumerate(prompt)]
    return [_ids_input(serving, ids, f"prompt[{i}]") for i, ids in enumerate(prompt)]


def _ids_input(serving: Serving, ids: list[int], param: str) -> PromptInput:
    if not ids:
        raise bad_request(f"{param} is an empty list of token ids; give at least one.", param.split("[")[0])
    vocab = serving.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"{param} holds the token id {bad}, outside this model's vocabulary [0, {vocab}).",
                          param.split("[")[0])
    return PromptInput(prompt_token_ids=ids)


def _embeds_tensor(serving: Serving, rows: list[list[float]]):
    import torch
    hidden = int(serving.tok.hidden_size)
    if not rows:
        raise bad_request("input_embeds is empty; give [num_tokens][hidden_size] numbers.", "input_embeds")
    if len(rows) >= serving.max_model_len:
        raise bad_request(f"input_embeds has {len(rows)} rows but the model's context is {serving.max_model_len}; "
                          f"shorten the prompt to leave room for output.", "input_embeds", "context_length_exceeded")
    if any(len(r) != hidden for r in rows):
        raise bad_request(f"input_embeds rows must each hold hidden_size = {hidden} numbers.", "input_embeds")
    return torch.tensor(rows, dtype=torch.float32)    # [T, H]
