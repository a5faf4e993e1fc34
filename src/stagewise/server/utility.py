"""vLLM's utility endpoints, in vLLM's request and response shapes: POST /tokenize (a prompt, or
chat messages through the chat template), POST /detokenize, GET /version and GET|POST /ping.
Tokenizing runs on the intake threads, like every other request's CPU work."""
from __future__ import annotations

from importlib import metadata
from typing import Annotated

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from .errors import APIError, ClientGone, bad_request
from .intake import parse_request
from .protocol import ChatMessage, ChatTemplateFields, TokenIds, _Lenient
from .serving import Serving


class TokenizeRequest(ChatTemplateFields):
    """vLLM's two tokenize shapes in one: `prompt` (add_special_tokens default true) or `messages`
    (rendered by the chat template; add_special_tokens default false)."""
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: TokenIds


def tokenize_body(serving: Serving, body: bytes) -> dict:
    req = parse_request(body, TokenizeRequest)
    serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("Give exactly one of prompt or messages.", "prompt" if req.prompt is None else "messages")
    if req.messages is not None:
        from .routes import render_chat
        images = serving.images.parts() if serving.images is not None else None
        messages = [m.as_template_dict(i, images) for i, m in enumerate(req.messages)]
        serving.check_chars(sum(len(m["content"]) for m in messages), "messages")
        text = render_chat(serving, messages, req.template_options(serving.trust_request_chat_template))
        special = False if req.add_special_tokens is None else req.add_special_tokens
        ids = serving.text_input(text, "messages", special).prompt_token_ids or []
        if images:        # each image counts its feature tokens (images are not decoded here)
            from ..multimodal.images import ImageError
            try:
                ids = serving.images.count(ids)
            except ImageError as exc:
                raise bad_request(str(exc), exc.where) from None
    else:
        assert req.prompt is not None
        ids = serving.text_input(req.prompt, "prompt", req.add_special_tokens).prompt_token_ids or []
    strs = serving.tok.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize_body(serving: Serving, body: bytes) -> dict:
    req = parse_request(body, DetokenizeRequest)
    serving.check_model(req.model)
    bad = next((t for t in req.tokens if not 0 <= t < serving.vocab_size), None)
    if bad is not None:
        raise bad_request(f"tokens holds the token id {bad}, outside this model's vocabulary [0, "
                          f"{serving.vocab_size}).", "tokens")
    return {"prompt": serving.tok.decode(req.tokens, skip_special_tokens=False)}


async def tokenize(serving: Serving, raw: Request) -> Response:
    return await _answer(serving, raw, tokenize_body)


async def detokenize(serving: Serving, raw: Request) -> Response:
    return await _answer(serving, raw, detokenize_body)


async def _answer(serving: Serving, raw: Request, make) -> Response:
    try:
        body = await serving.read_body(raw)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(await serving.off_loop(make, serving, body))


def version() -> dict:
    try:
        return {"version": metadata.version("stagewise")}
    except metadata.PackageNotFoundError:      # run from a source tree without an install
        return {"version": "unknown"}


def ping(healthy: bool, why: str) -> Response:
    """vLLM's /ping (the SageMaker health check): 200 with an empty body, or 503 in the error shape."""
    if healthy:
        return Response(status_code=200)
    return APIError(f"Unhealthy: {why}", 503, None, None, "service_unavailable").response()
