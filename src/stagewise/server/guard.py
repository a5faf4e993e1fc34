"""The gate in front of every route (pure ASGI middleware): the API key (401), the JSON content
type of request bodies (415) and the body size (413), each answered in the OpenAI error shape
before a route reads anything.

415 matters even without a key: browsers send `text/plain` (and body-less content types)
cross-origin without a preflight, so a web page could otherwise make a local server generate.
"""
from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, BodyTooLarge

OPEN_PATHS = ("/health", "/metrics")
BODY_METHODS = ("POST", "PUT", "PATCH")


class RequestGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, on_reject=lambda: None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_reject = on_reject          # counts the refusal (metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        error = self._check(scope, headers)
        if error is not None:
            self.on_reject()
            response = error.response()
            if error.status == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        if scope["method"] in BODY_METHODS:
            receive = self._limited(receive)
        await self.app(scope, receive, send)

    def _check(self, scope: Scope, headers: Headers) -> APIError | None:
        if self.api_key is not None and _needs_key(scope["path"]) and not self._authorized(headers):
            return APIError("Missing or incorrect API key; send it as the header 'Authorization: Bearer <key>'.",
                            401, None, "invalid_api_key")
        if scope["method"] not in BODY_METHODS:
            return None
        if not _is_json(headers.get("content-type")):
            return APIError(f"Unsupported content type {headers.get('content-type', '(none)')[:100]!r}; send the "
                            f"body as JSON with 'Content-Type: application/json'.", 415, None,
                            "unsupported_media_type")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return BodyTooLarge(self.max_body_bytes)
        return None

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        # NOTE: compare_digest takes time independent of where the strings differ (no timing oracle).
        return (scheme.lower() == "bearer" and self.api_key is not None
                and hmac.compare_digest(token.strip().encode(), self.api_key))

    def _limited(self, receive: Receive) -> Receive:
        """`receive` that counts body bytes (chunked bodies have no Content-Length) and stops at the limit."""
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message
        return limited


def _needs_key(path: str) -> bool:
    return path not in OPEN_PATHS and (path == "/v1" or path.startswith("/v1/") or path == "/generate")


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
