"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Every bad request becomes an `APIError` (HTTP 4xx) with one sentence saying what was wrong
and what to do; FastAPI's default 422 and Starlette's HTML/plain errors never reach a client.
"""
from __future__ import annotations

import logging
import re
import reprlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("stagewise.server")


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type_
        self.headers: dict[str, str] | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class Overloaded(APIError):
    """429 with Retry-After: the waiting queue is full (a burst is refused early, not queued for
    minutes), the server's (`api_key` None) or one API key's share of it (`api_key`: its place in
    --api-key, from 1)."""

    def __init__(self, limit: int, retry_after_s: int, api_key: int | None = None):
        if api_key is None:
            text = f"The server is at its limit of {limit} waiting requests (--max-waiting-requests)"
        else:
            text = (f"This API key is at its limit of {limit} waiting requests (--max-waiting-requests-per-key); "
                    f"its earlier requests must start first")
        super().__init__(f"{text}; retry after {retry_after_s} s.", 429, None, "rate_limit_exceeded",
                         "rate_limit_error")
        self.headers = {"Retry-After": str(retry_after_s)}
        self.api_key = api_key


def overloaded(limit: int, retry_after_s: int, api_key: int | None = None) -> Overloaded:
    return Overloaded(limit, retry_after_s, api_key)


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(f"The request body is larger than this server's limit of {limit} bytes; send less "
                         f"(or start the server with a larger --max-request-bytes).", 413, None,
                         "request_too_large")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def internal_error() -> APIError:
    """A real server fault: the details go to the log, never to the client."""
    return APIError("The server had an internal error while processing the request; it logged the details. "
                    "Retry, and report it if it persists.", 500, None, None, "server_error")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, param, code)


def from_value_error(exc: ValueError, param_prefix: str = "") -> APIError:
    """Engine and SamplingParams errors name their field first ("top_p must be ..."): use it as `param`."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    param = param_prefix + first if first.isidentifier() and first.islower() else None
    code = "context_length_exceeded" if type(exc).__name__ == "PromptTooLongError" else None
    return bad_request(message, param, code)


_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 60, 60, 2, 4, 4
# NOTE: pydantic appends the union member it tried ("stop.str"); drop type names from the path.
_MODEL_NAME = re.compile(r"a valid dictionary or instance of \w+")
_TYPE_NAMES = {"str", "int", "float", "bool", "dict[str,any]", "dict[str,str]", "dict[str,float]"}


def _param(loc) -> str | None:
    parts = [str(p)[:64] for p in loc if p != "body"]
    parts = [p for p in parts if p not in _TYPE_NAMES and not p.startswith(("list[", "function-", "constrained-"))]
    return ".".join(parts) or None


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else exc.errors()
    # NOTE: a union reports one error per member; the deepest one got furthest ("prompt.1.1", not "prompt"),
    # and at equal depth a failed check says more than a type mismatch.
    err = max(errors, key=lambda e: (len(e.get("loc", ())), not str(e.get("type")).endswith("_type")))
    kind, param = err.get("type"), _param(err.get("loc", ()))
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}; remove it.", param,
                           "unrecognized_argument")
    if kind == "missing":
        return bad_request(f"Missing required parameter: {param}.", param, "missing_required_parameter")
    # NOTE: pydantic names the schema class it wanted ("or instance of StreamOptions"); clients know JSON
    msg = _MODEL_NAME.sub("a JSON object", str(err.get("msg", "invalid"))).removeprefix("Value error, ")
    return bad_request(f"Invalid value for {param or 'the request body'}: {msg} "
                       f"(got {_SHORT.repr(err.get('input'))}); fix the request and retry.", param, "invalid_type")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        routes = ("see GET /v1/models, /health, /metrics and POST /v1/completions, /v1/chat/completions, "
                  "/v1/responses, /v1/embeddings, /generate")
        if exc.status_code == 404:
            message = f"No route {request.url.path}; {routes}."
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}; {routes}."
        else:
            message = str(exc.detail)
        return APIError(message, exc.status_code, None, None, kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return internal_error().response()
